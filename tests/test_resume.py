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


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    # b2 = 0.8: theory periods of 4-5 steps and adaptive resets within 20 steps.
    if kind == "bnb":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-3, betas=(0.9, 0.8))
    rounding = kind.split(":")[1]
    return QuantizedAdamW(params, lr=1e-3, betas=(0.9, 0.8), state_format="fp8_e4m3", rounding=rounding,
                          min_quantized_size=256, seed=7)


class Regression(L.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 8, 32, generator=g), torch.randn(32, 8, 4, generator=g)

    def training_step(self, batch, batch_idx):
        # Batch i is chosen by batch_idx: Lightning resumes mid-epoch at the right batch_idx but restarts a plain
        # DataLoader from its first batch, so the loader's own order would not survive the interruption.
        return nn.functional.mse_loss(self.net(self.x[batch_idx]), self.y[batch_idx])

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(32)), batch_size=None)

    def configure_optimizers(self):
        return make_optimizer(self.kind, self.parameters())


# policy -> (callback kwargs, total steps N, checkpoint step K): K lies inside a reset cycle.
POLICIES = {
    "periodic": (dict(reset="periodic", every=4), 14, 6),
    "theory": (dict(reset="theory"), 14, 7),
    "adaptive": (dict(reset="adaptive", s0=0.02, min_interval=3), 20, 13),
}
OPTIMIZERS = ["bnb", "qadamw:nearest", "qadamw:stochastic"]


class Run:
    """One fit with a CSV logger and a reset recorder (steps counted as completed optimizer steps)."""

    def __init__(self, root: Path, kind: str, policy: str, ckpt_every: int | None = None, ckpt_path=None) -> None:
        kwargs, steps, _ = POLICIES[policy]
        self.callback = StaleStateCallback(**kwargs)
        self.resets: list[int] = []
        self.callback.add_reset_listener(lambda opt, slots: self.resets.append(self.trainer.global_step + 1))
        callbacks = [self.callback]
        if ckpt_every is not None:
            callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=ckpt_every, save_top_k=-1))
        self.model = Regression(kind)
        self.trainer = L.Trainer(
            default_root_dir=root, max_steps=steps, logger=CSVLogger(root, name="csv", version=0),
            log_every_n_steps=1, callbacks=callbacks, enable_checkpointing=ckpt_every is not None,
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


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_resume_mid_cycle_equals_uninterrupted_run(tmp_path, policy, kind):
    _, steps, k = POLICIES[policy]
    full = Run(tmp_path / "full", kind, policy, ckpt_every=k)
    ckpt = tmp_path / "full" / "ckpt" / f"epoch=0-step={k}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (tmp_path / "full" / "ckpt").iterdir())
    resumed = Run(tmp_path / "resumed", kind, policy, ckpt_path=ckpt)

    # The interruption falls inside a cycle, and the cycle completes after the resume.
    assert full.resets, "the uninterrupted run never reset: the case tests nothing"
    assert any(s > k for s in full.resets), f"no reset after the checkpoint step {k}: {full.resets}"
    assert k not in full.resets
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
