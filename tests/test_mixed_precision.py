"""Mixed precision: GradScaler-skipped steps are not counted and do not advance reset schedules; bf16-mixed works.

On CPU ``precision="16-mixed"`` is downgraded to bf16 (no scaler), so the fp16 path is built explicitly with
``MixedPrecision("16-mixed", "cpu", GradScaler("cpu"))``. An inf in the loss of chosen batches makes every gradient
non-finite: the scaler then skips ``optimizer.step()`` for a plain optimizer (no step hooks run), while a fused
optimizer's ``step`` still runs (its hooks fire) with a ``found_inf`` flag and skips internally.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from helpers import Regression, fit, logged, read_metrics, trainer_for
from lightning_stale import StaleStateCallback

INF_BATCHES = (2, 5, 6)  # batch indices whose loss is multiplied by inf
STEPS = 14
EVERY = 4


class InfLoss(Regression):
    """The shared regression (32 -> 64 -> 4, 128 samples) on torch AdamW, plain or fused, with the loss of
    ``inf_batches`` multiplied by inf so that every gradient of those steps is non-finite."""

    def __init__(self, fused: bool, inf_batches: tuple[int, ...]) -> None:
        super().__init__("torch_fp32", width=64, data_size=128, fused=fused)
        self.inf_batches = inf_batches

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx in self.inf_batches:
            loss = loss * torch.tensor(float("inf"))  # every gradient becomes inf or nan
        return loss


class ScalerProbe(L.Callback):
    """Independent record of which optimizer steps the GradScaler skipped: the scale drops exactly then."""

    def __init__(self) -> None:
        self.skipped: list[int] = []  # completed-step numbers (1-based global steps)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._scale = trainer.precision_plugin.scaler.get_scale()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.precision_plugin.scaler.get_scale() < self._scale:
            self.skipped.append(trainer.global_step)


def fit_fp16(tmp_path: Path, fused: bool, inf_batches: tuple[int, ...]):
    callback = StaleStateCallback(reset="periodic", every=EVERY, track="exact")
    resets: list[int] = []
    callback.add_reset_listener(lambda event: resets.append(trainer.global_step + 1))  # global steps count skips
    probe = ScalerProbe()
    # A small initial scale: fp16 overflow of the real gradients would add skips of its own.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = trainer_for(tmp_path, [callback, probe], STEPS, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer.fit(InfLoss(fused=fused, inf_batches=inf_batches))
    rows = {int(r["step"]): r for r in read_metrics(trainer)}
    return callback, resets, probe.skipped, rows, trainer


def expected_resets(skipped: list[int]) -> list[int]:
    """Global steps completing every EVERY-th real (not skipped) optimizer step."""
    out, real = [], 0
    for step in range(1, STEPS + 1):
        if step not in skipped:
            real += 1
            if real % EVERY == 0:
                out.append(step)
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_skipped_steps_are_not_counted_and_shift_the_schedule(tmp_path, fused):
    callback, resets, skipped, rows, trainer = fit_fp16(tmp_path, fused, INF_BATCHES)
    assert skipped == [b + 1 for b in INF_BATCHES], "the scaler did not skip exactly the injected steps"
    assert resets == expected_resets(skipped)
    assert resets != expected_resets([])  # the shift is visible: resets moved by the skipped steps before them

    assert callback.monitor.steps == [STEPS - len(skipped)]  # real steps seen by the callback
    since_last = STEPS - resets[-1] - sum(s > resets[-1] for s in skipped)
    assert {u.age for u in callback.monitor.rows()} == {since_last}

    # Nothing was measured on a skipped step. The callback logs nothing then, so the CSV row of a skipped step only
    # repeats the previous row (Lightning re-emits a step metric until the epoch ends). Counted as a stall, the
    # unchanged state would have logged 1.0: these fp32 moments otherwise never stall.
    stale = {step: {k: v for k, v in r.items() if k.startswith("stale/")} for step, r in rows.items()}
    for step in skipped:
        assert stale[step - 1] == stale[step - 2], f"something was logged on the skipped step {step}"
    fractions = [float(r["stale/v/frac"]) for r in stale.values() if r.get("stale/v/frac")]
    assert len(fractions) >= STEPS - 2 and set(fractions) == {0.0}
    for p in trainer.optimizers[0].state.values():
        assert torch.isfinite(p["exp_avg"]).all() and torch.isfinite(p["exp_avg_sq"]).all()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_without_skips_the_schedule_is_unshifted(tmp_path, fused):
    callback, resets, skipped, rows, _ = fit_fp16(tmp_path, fused, ())
    assert skipped == []
    assert resets == expected_resets([]) == [4, 8, 12]
    assert callback.monitor.steps == [STEPS]


def test_bf16_mixed_with_bf16_parameters_logs_stalls(tmp_path):
    callback = StaleStateCallback(track="exact")
    model = Regression("torch_bf16", width=64, data_size=128, fused=False)  # bf16 parameters
    trainer = fit(tmp_path, model, callback, 12, precision="bf16-mixed")
    state = next(iter(trainer.optimizers[0].state.values()))
    assert state["exp_avg_sq"].dtype == torch.bfloat16
    fractions = logged(trainer, "stale/v/frac")
    assert len(fractions) == 11  # every step but the first
    assert all(0.0 <= f <= 1.0 for f in fractions) and max(fractions) > 0.0  # bf16 v does stall
    assert "stale/v/predicted" in trainer.callback_metrics
