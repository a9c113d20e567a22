"""Direct tests of the components one optimizer's pipeline runs (ledger, drift, forecast, pipeline, interventions), on
a small real model and optimizer: each component's own methods, not a whole fit."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from lightning_stale import StaleStateMonitor
from lightning_stale.decide.ledger import RHO_FINAL, Ledger
from lightning_stale.monitor.pipeline import OptimizerPipeline
from lightning_stale.optim import QuantizedAdamW


def _pipeline(state_format: str = "bf16", steps: int = 3, **options) -> tuple[OptimizerPipeline, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = QuantizedAdamW(model.parameters(), lr=1e-2, state_format=state_format, min_quantized_size=16,
                               compile=False)
    monitor = StaleStateMonitor(optimizer, names=model, coverage_steps=2, **options)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return monitor._pipelines[0], model


def test_ledger_carries_rows_by_key_and_stashes_departed_ones() -> None:
    track, _ = _pipeline()
    units = track.engine.tracked
    ledger = Ledger()
    ledger.sync(units)
    ledger.arrays["resets"][:] = np.arange(len(units))
    ledger.sync(units[1:])  # the first parameter's state went away: its row is stashed
    assert ledger.keys == [u.key for u in units[1:]] and ledger.arrays["resets"].tolist() == [1, 2, 3]
    assert ledger.state_dict()[units[0].key]["resets"] == 0
    ledger.arrays["resets"][0] = 7
    new = ledger.sync(units)  # it returns with its history; the others keep theirs
    assert [u.key for u in new] == [units[0].key] and ledger.arrays["resets"].tolist() == [0, 7, 2, 3]
    restored = Ledger()
    restored.load_state_dict(ledger.state_dict())
    restored.sync(units)
    assert restored.arrays["resets"].tolist() == [0, 7, 2, 3]


def test_ledger_ages_and_guard_windows() -> None:
    ledger = Ledger.of(3, age=[5, 6, 7])
    ledger.open_guard(np.array([1]), 2)
    ledger.open_guard(np.array([1]), 1)  # a shorter window does not shorten an open one
    assert ledger.arrays["guard_left"].tolist() == [0, 2, 0] and ledger.guarding
    ledger.advance()
    assert ledger.ages.tolist() == [6, 7, 8]


def test_drift_panel_reads_stored_v_against_its_fp32_shadow() -> None:
    track, _ = _pipeline(steps=6)
    readings = track.engine.drift()
    assert readings and all(math.isfinite(value) and value > 0 for value in readings.values())
    for key in readings:
        assert track.engine.drift_weight(key) > 0
    shadows = track.engine.panel.state_dict()
    assert set(shadows) == set(readings) and all(isinstance(t, torch.Tensor) for t in shadows.values())


def test_forecast_knows_rho_hat_of_float_formats_in_closed_form() -> None:
    track, _ = _pipeline(state_format="bf16")
    assert not track.forecast.pending
    rho, state = track.ledger.arrays["rho"], track.ledger.arrays["rho_state"]
    assert np.all(state == RHO_FINAL)
    assert np.all(rho[:3] > 1) and math.isnan(rho[3])  # bf16 at beta2 = 0.999 stalls; the 2-element bias stays fp32
    predicted = track.forecast.window(track.engine.entries)
    assert predicted.shape[0] == len(track.engine.entries) and predicted[:, 1].sum() > 0
    assert np.array_equal(track.forecast.window(track.engine.entries), predicted)  # a readout
    track.forecast.reset_window(track.engine.entries)
    assert not track.forecast.window(track.engine.entries).any()


def test_pipeline_counts_only_steps_that_ran() -> None:
    track, model = _pipeline(steps=4)
    assert track.steps == 4 and track.ledger.ages.tolist() == [4] * len(track.ledger.rows)
    track.optimizer.found_inf = torch.ones(())  # GradScaler's verdict on a fused step: skipped
    track.before_step()
    track.after_step()
    assert track.steps == 4
    del track.optimizer.found_inf


def test_interventions_reset_in_place_and_report_the_event() -> None:
    track, model = _pipeline(steps=4)
    events = []
    track.interventions.listeners.append(events.append)
    unit = track.ledger.rows[0]
    tensors = [t for slot in unit.slots for t in slot.state_tensors()]
    addresses = [t.data_ptr() for t in tensors]
    track.interventions.reset([unit], ("m", "v"), track.steps)
    assert [t.data_ptr() for t in tensors] == addresses  # in place
    assert track.interventions.resets == 1 and len(events) == 1 and events[0].step == 4
    assert track.ledger.arrays["resets"][0] == 1 and track.ledger.ages[0] == 0
