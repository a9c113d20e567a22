"""Exact resume: a run interrupted mid reset cycle and resumed from its checkpoint with a fresh Trainer, model and
callback makes the same reset decisions, logs the same metrics and ends bit-identical to the uninterrupted run.

One run of N steps saves a checkpoint at step K (ModelCheckpoint); a second run resumes from it to N. Covered:
periodic, theory and adaptive policies on bitsandbytes AdamW8bit and QuantizedAdamW (fp8, nearest and stochastic
rounding: the stochastic stream lives in the optimizer state and must resume too).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import Regression, read_metrics, trainer_for
from lightning_stale import StaleStateCallback


class ByIndex(Regression):
    """The shared regression as 200 batches of 8, batch i served by ``batch_idx``: Lightning resumes mid-epoch at the
    right ``batch_idx`` but restarts a plain DataLoader from its first batch, so the loader's own order would not
    survive the interruption. ``kind`` is ``bnb`` or ``qadamw:<rounding>`` (fp8 states, seed 7)."""

    def __init__(self, kind: str, beta2: float) -> None:
        if kind == "bnb":
            super().__init__("bnb", betas=(0.9, beta2), data_size=200 * 8)
        else:
            super().__init__(f"qadamw:fp8_e4m3:{kind.split(':')[1]}", betas=(0.9, beta2), data_size=200 * 8, seed=7)
        x, y = self.dataset()
        self.x, self.y = x.view(200, 8, -1), y.view(200, 8, -1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self(self.x[batch_idx]), self.y[batch_idx])

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(200)), batch_size=None)


# (policy, optimizer family) -> (callback kwargs, beta2, total steps N). b2 = 0.8 brings adaptive resets within 20
# steps. Theory resets need rho-hat >= 1: b2 = 0.96 gives fp8 a K* of 32 steps; the 8-bit map's settled grid
# estimate needs b2 = 0.995 (rho-hat 1.9, K* about 240). A reset of both fp8 moments lets v underflow to zero
# while m does not (the m/eps blow-up, params NaN within 10 steps here), so the theory cases run with the guard.
PERIODIC = (dict(reset="periodic", every=4), 0.8, 14)
ADAPTIVE = (dict(reset="adaptive", s0=0.02, min_interval=3), 0.8, 24)
CONFIGS = {
    ("periodic", "bnb"): PERIODIC,
    ("periodic", "qadamw"): PERIODIC,
    ("theory", "bnb"): (dict(reset="theory"), 0.995, 300),
    ("theory", "qadamw"): (dict(reset="theory", underflow_guard=True), 0.96, 75),
    ("adaptive", "bnb"): ADAPTIVE,
    ("adaptive", "qadamw"): ADAPTIVE,
}
OPTIMIZERS = ["bnb", "qadamw:nearest", "qadamw:stochastic"]
# Fast suite: every optimizer once, periodic and adaptive; theory cases (long cycles) and the rest are marked slow.
FAST = {("periodic", "bnb"), ("periodic", "qadamw:stochastic"), ("adaptive", "qadamw:nearest")}
CASES = [
    pytest.param(policy, kind, marks=() if (policy, kind) in FAST else pytest.mark.slow, id=f"{policy}-{kind}")
    for policy in ("periodic", "theory", "adaptive")
    for kind in OPTIMIZERS
]


def config(policy: str, kind: str) -> tuple[dict, float, int]:
    return CONFIGS[(policy, kind.split(":")[0])]


class Run:
    """One fit with a CSV logger and a reset recorder (steps counted as completed optimizer steps)."""

    def __init__(self, root: Path, kind: str, policy: str, save: bool = False, ckpt_path=None,
                 log_every: int = 1) -> None:
        kwargs, beta2, steps = config(policy, kind)
        self.callback = StaleStateCallback(**kwargs)
        self.resets: list[int] = []
        self.callback.add_reset_listener(lambda event: self.resets.append(event.step))
        callbacks = [self.callback]
        if save:  # a checkpoint after every step; the test picks one inside a reset cycle afterwards
            callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1))
        self.model = ByIndex(kind, beta2)
        self.trainer = trainer_for(root, callbacks, steps, log_every_n_steps=log_every, enable_checkpointing=save,
                                   deterministic=True)
        self.trainer.fit(self.model, ckpt_path=ckpt_path)

    def rows(self) -> dict[int, dict[str, str]]:
        rows = read_metrics(self.trainer)
        return {int(r["step"]): {k: v for k, v in r.items() if k.startswith("stale/")} for r in rows}


def assert_same_tensors(a, b, where: str) -> None:
    """Recursively compare (nested dicts/lists of) tensors and plain values for exact equality."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def inside_a_cycle(resets: list[int]) -> int:
    """A step that is not a reset step, after the first reset when possible, with a later reset to come."""
    assert resets, "the uninterrupted run never reset: the case tests nothing"
    inside = [s for s in range(resets[0] + 1, resets[-1]) if s not in resets]
    inside = inside or [s for s in range(1, resets[-1]) if s not in resets]
    return inside[len(inside) // 2]


def interrupted_and_full(root: Path, policy: str, kind: str, log_every: int = 1, k: int | None = None):
    """The uninterrupted run and a run resumed from its checkpoint at step ``k`` (default: inside a reset cycle)."""
    full = Run(root / "full", kind, policy, save=True, log_every=log_every)
    k = inside_a_cycle(full.resets) if k is None else k
    ckpt = root / "full" / "ckpt" / f"epoch=0-step={k}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (root / "full" / "ckpt").iterdir())
    resumed = Run(root / "resumed", kind, policy, ckpt_path=ckpt, log_every=log_every)
    return full, resumed, k


@pytest.mark.parametrize(("policy", "kind"), CASES)
def test_resume_mid_cycle_equals_uninterrupted_run(tmp_path, policy, kind):
    full, resumed, k = interrupted_and_full(tmp_path, policy, kind)

    # The interruption falls inside a cycle, and the cycle completes after the resume.
    assert any(s > k for s in full.resets) and k not in full.resets, (k, full.resets)
    assert resumed.resets == [s for s in full.resets if s > k]
    assert resumed.callback.reset_events == full.callback.reset_events
    assert resumed.callback.reset_periods() == full.callback.reset_periods()

    # The same metrics from the resume point on (the resumed run's rows start at the first logged step after K).
    full_rows, resumed_rows = full.rows(), resumed.rows()
    assert sorted(resumed_rows) == [s for s in sorted(full_rows) if s >= k]
    for step, row in resumed_rows.items():
        assert row == full_rows[step], f"logged metrics differ at step {step}"

    # Bit-identical parameters and optimizer state (codes, scales, ages, the stochastic-rounding generator).
    assert_same_tensors(full.model.state_dict(), resumed.model.state_dict(), "parameters")
    assert_same_tensors(full.trainer.optimizers[0].state_dict(), resumed.trainer.optimizers[0].state_dict(),
                        "optimizer state")


def test_resume_between_log_steps_keeps_the_unlogged_totals(tmp_path):
    """Checkpoint at step 6 with a log every 4 steps: the counts of steps 5-6 are in the checkpoint, not yet logged;
    the first row after the resume (step 8) must still include them."""
    full, resumed, k = interrupted_and_full(tmp_path, "periodic", "bnb", log_every=4, k=6)
    full_rows, resumed_rows = full.rows(), resumed.rows()
    assert sorted(resumed_rows) == [s for s in sorted(full_rows) if s >= k] and min(resumed_rows) == 7
    for step, row in resumed_rows.items():
        assert row == full_rows[step], f"logged metrics differ at step {step}"
    assert_same_tensors(full.model.state_dict(), resumed.model.state_dict(), "parameters")
