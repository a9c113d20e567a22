"""Exact resume: a run interrupted mid reset cycle and resumed from its checkpoint with a fresh Trainer, model and
callback makes the same reset decisions, logs the same metrics and ends bit-identical to the uninterrupted run.

One run of N steps saves a checkpoint at step K (ModelCheckpoint); a second run resumes from it to N. Covered:
periodic, theory and adaptive policies on bitsandbytes AdamW8bit and QuantizedAdamW (fp8, nearest and stochastic
rounding: the stochastic stream lives in the optimizer state and must resume too).
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import StaleStateCallback
from lightning_stale.optim import QuantizedAdamW


def make_optimizer(kind: str, params, beta2: float) -> torch.optim.Optimizer:
    if kind == "bnb":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-3, betas=(0.9, beta2))
    rounding = kind.split(":")[1]
    return QuantizedAdamW(params, lr=1e-3, betas=(0.9, beta2), state_format="fp8_e4m3", rounding=rounding,
                          min_quantized_size=256, seed=7)


class Regression(L.LightningModule):
    def __init__(self, kind: str, beta2: float) -> None:
        super().__init__()
        self.kind = kind
        self.beta2 = beta2
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(200, 8, 32, generator=g), torch.randn(200, 8, 4, generator=g)

    def training_step(self, batch, batch_idx):
        # Batch i is chosen by batch_idx: Lightning resumes mid-epoch at the right batch_idx but restarts a plain
        # DataLoader from its first batch, so the loader's own order would not survive the interruption.
        return nn.functional.mse_loss(self.net(self.x[batch_idx]), self.y[batch_idx])

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(200)), batch_size=None)

    def configure_optimizers(self):
        return make_optimizer(self.kind, self.parameters(), self.beta2)


# (policy, optimizer family) -> (callback kwargs, beta2, total steps N). b2 = 0.8 brings adaptive resets within 20
# steps. Theory resets need rho-hat >= 1: b2 = 0.96 gives fp8 a K*
# of 32 steps, the 8-bit map needs b2 = 0.985 (K* about 85). A reset of both fp8 moments lets v underflow to zero
# while m does not (the m/eps blow-up, params NaN within 10 steps here), so the theory cases run with the guard.
PERIODIC = (dict(reset="periodic", every=4), 0.8, 14)
ADAPTIVE = (dict(reset="adaptive", s0=0.02, min_interval=3), 0.8, 24)
CONFIGS = {
    ("periodic", "bnb"): PERIODIC,
    ("periodic", "qadamw"): PERIODIC,
    ("theory", "bnb"): (dict(reset="theory"), 0.985, 180),
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
        self.model = Regression(kind, beta2)
        self.trainer = L.Trainer(
            default_root_dir=root, max_steps=steps, logger=CSVLogger(root, name="csv", version=0),
            log_every_n_steps=log_every, callbacks=callbacks, enable_checkpointing=save,
            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", deterministic=True,
        )
        self.trainer.fit(self.model, ckpt_path=ckpt_path)

    def rows(self) -> dict[int, dict[str, str]]:
        with (Path(self.trainer.logger.log_dir) / "metrics.csv").open() as f:
            return {int(r["step"]): {k: v for k, v in r.items() if k.startswith("stale/")} for r in csv.DictReader(f)}


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
