"""The keyed-rows helper and the four components that keep per-key rows with it (counts, drift shadows, forecast,
ledger): a key that stays keeps its values, one that goes away is stashed, one that returns (or first appears after a
checkpoint was loaded) gets its values back, on the live state's device and dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_stale.adapters import adapter_for
from lightning_stale.decide.forecast import StallForecast
from lightning_stale.decide.ledger import Ledger, without_periods
from lightning_stale.measure.counting import Counts
from lightning_stale.measure.drift import DriftPanel
from lightning_stale.measure.engine import StallEngine
from lightning_stale.measure.rows import KeyedRows


def test_keeps_rows_by_key_stashes_departed_ones_and_returns_them() -> None:
    rows: KeyedRows[str] = KeyedRows()
    saved: list[tuple[str, int]] = []

    def save(key: str, row: int) -> str:
        saved.append((key, row))
        return f"values of {key}"

    moves = rows.rebuild(["a", "b", "c"], save)
    assert moves.kept == {} and moves.returned == {} and rows.keys == ["a", "b", "c"]
    moves = rows.rebuild(["c", "a"], save)  # b went away: read from its old row into the stash
    assert moves.kept == {"c": 2, "a": 0} and saved == [("b", 1)] and rows.stash == {"b": "values of b"}
    assert "a" in rows and "b" not in rows and rows.row("a") == 1
    assert rows.peek("b") == "values of b" and rows.peek("d") is None and "b" in rows.stash  # peeking leaves it
    moves = rows.rebuild(["b", "c", "a"], save)  # b returns with its values, which leave the stash
    assert moves.returned == {"b": "values of b"} and moves.kept == {"c": 0, "a": 1} and rows.stash == {}


def test_a_key_that_stays_live_but_leaves_the_rows_is_dropped() -> None:
    rows: KeyedRows[int] = KeyedRows()
    rows.rebuild(["a", "b"], lambda key, row: row)
    rows.rebuild(["a"], lambda key, row: row, live={"a", "b"})  # b is still live, just not held (the drift panel)
    assert rows.stash == {}
    rows.rebuild([], lambda key, row: row, live=set())
    assert rows.stash == {"a": 0}


def test_state_dict_round_trip_through_restart() -> None:
    rows: KeyedRows[int] = KeyedRows()
    rows.rebuild(["a", "b"], lambda key, row: row)
    rows.rebuild(["b"], lambda key, row: 10 + row)
    state = rows.state_dict({"b": 20})
    assert state == {"a": 10, "b": 20}
    loaded: KeyedRows[int] = KeyedRows()
    loaded.restart(state)
    assert loaded.keys == [] and "b" not in loaded
    moves = loaded.rebuild(["b", "c"], lambda key, row: row)
    assert moves.kept == {} and moves.returned == {"b": 20} and loaded.state_dict({}) == {"a": 10}


def _engine(steps: int = 2) -> tuple[StallEngine, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = StallEngine(adapter_for(optimizer), "opt0", exact=True, sample_size=64, params_per_step=8,
                         coverage_steps=1, seed=0)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        engine.before_step(measure=True)
        optimizer.step()
        engine.after_step()
        optimizer.zero_grad()
    return engine, model


def _subset(entries: dict, keep) -> dict:
    """The entries whose key passes ``keep``, renumbered as the engine would (rows in order)."""
    from dataclasses import replace

    kept = [e for e in entries.values() if keep(e.key)]
    return {e.key: replace(e, row=i) for i, e in enumerate(kept)}


def test_counts_stash_a_departed_slot_and_restore_it_on_the_state_dtype() -> None:
    engine, _ = _engine()
    entries = engine.entries
    before = engine.counts.state_dict()
    first = next(iter(entries))
    counts = Counts()
    counts.load_state_dict(before)
    counts.rebuild(_subset(entries, lambda key: key != first))  # the first slot has not appeared yet: still stashed
    assert set(counts.state_dict()) == set(before)
    counts.rebuild(entries)
    for key, row in counts.state_dict().items():
        assert torch.equal(row["totals"], before[key]["totals"]) and row["measured"] == before[key]["measured"]
    assert counts.measured[0] == before[first]["measured"] > 0
    state = {key: {"totals": row["totals"].float(), "measured": row["measured"]} for key, row in before.items()}
    counts.load_state_dict(state)  # a checkpoint row in another dtype lands on the live totals' dtype and device
    counts.rebuild(entries)
    assert all(t.dtype == torch.float64 and t.device == entries[first].slot.param.device
               for t in counts.totals.values())


@pytest.mark.parametrize("per_step", [False, True])
def test_counts_carry_the_recent_sums_a_check_has_not_taken_yet(per_step: bool) -> None:
    """The counts since the last check (which the automatic remedy's weight decision and the adaptive policy read at
    the next check) travel in the state: a resumed run's next check reads what the uninterrupted run's reads."""
    engine, _ = _engine()
    entries = engine.entries
    counts = Counts(recent=True, per_step=per_step)
    counts.rebuild(entries)
    for device, recent in counts.recent.items():  # two measured steps' sums, as _add and end_step leave them
        values = torch.arange(recent[0].numel(), dtype=torch.int32, device=device).view_as(recent[0]) + 1
        recent[0] = values if per_step else values * (torch.arange(4, device=device) < 3)
        counts.end_step()
        if per_step:
            counts.recent[device][1] = values * 2
            counts.end_step()
    state = counts.state_dict()
    resumed = Counts(recent=True, per_step=per_step)
    resumed.load_state_dict(state)
    resumed.rebuild(entries)
    (sums, steps), (expected, expected_steps) = resumed.take_recent(), counts.take_recent()
    assert expected.any() and np.array_equal(sums, expected)
    assert len(steps) == len(expected_steps) == (2 if per_step else 0)
    assert all(np.array_equal(a, c) and np.array_equal(b, d) for (a, b), (c, d) in zip(steps, expected_steps))
    taken = Counts(recent=True, per_step=per_step)  # after a check took them, nothing is pending
    taken.load_state_dict(resumed.state_dict())
    taken.rebuild(entries)
    assert not taken.take_recent()[0].any()


def test_drift_panel_stashes_the_shadow_of_a_departed_slot_and_restores_it() -> None:
    engine, _ = _engine()
    panel, units = engine.panel, engine.tracked
    shadows = panel.state_dict()
    key = next(iter(shadows))
    others = [u for u in units if not key.startswith(u.key + ".")]
    panel.rebuild(others, engine.entries, fresh_state=False)  # its parameter's state went away
    assert key in panel.rows.stash and torch.equal(panel.state_dict()[key].cpu(), shadows[key])
    panel.rebuild(units, {}, fresh_state=True)  # it returns with its shadow, not from zero
    assert torch.equal(panel.state_dict()[key], shadows[key]) and not panel.rows.stash
    loaded = DriftPanel(exact=True)
    loaded.load_state_dict({k: v.double() for k, v in shadows.items()})  # restored into the fp32 shadows
    loaded.rebuild(units, {}, fresh_state=True)
    restored = loaded.state_dict()
    assert all(restored[k].dtype == torch.float32 and torch.equal(restored[k], shadows[k]) for k in shadows)


def _forecast(entries: dict) -> tuple[StallForecast, np.ndarray]:
    """A forecast aligned with ``entries`` whose prediction sums are 0, 1, 2, ... row by row."""
    forecast = StallForecast(None, lambda key, message: None, lambda unit: "")
    forecast.align(entries)
    values = np.arange(2.0 * len(entries)).reshape(-1, 2)
    forecast.sums[:] = values
    return forecast, values


def test_forecast_carries_and_restores_prediction_sums() -> None:
    engine, _ = _engine()
    entries = engine.entries
    first = next(iter(entries))
    forecast, values = _forecast(entries)
    forecast.align(_subset(entries, lambda key: key != first))  # the first slot went away: its sums are stashed
    assert forecast.sums.tolist() == values[1:].tolist() and forecast.rows.stash == {first: [0.0, 1.0]}
    forecast.align(entries)  # and come back with it
    assert forecast.sums.tolist() == values.tolist() and not forecast.rows.stash
    loaded = StallForecast(None, lambda key, message: None, lambda unit: "")
    loaded.load_state_dict(forecast.state_dict())
    loaded.align(entries)
    assert loaded.sums.tolist() == values.tolist()


def test_forecast_window_is_a_readout_even_when_the_slots_changed() -> None:
    engine, _ = _engine()
    entries = engine.entries
    first = next(iter(entries))
    others = _subset(entries, lambda key: key != first)
    forecast, values = _forecast(entries)
    forecast.align(others)
    window = forecast.window(entries)  # the slots changed without an align (a skipped hook): read as aligned
    assert window.tolist() == values.tolist() and forecast.window(entries).tolist() == window.tolist()
    assert forecast.rows.keys == list(others) and first in forecast.rows.stash  # nothing moved
    forecast.reset_window(entries)  # aligns, then starts a new window
    assert forecast.rows.keys == list(entries) and not forecast.sums.any() and not forecast.rows.stash


def test_ledger_loads_a_state_without_the_periods_another_policy_chose() -> None:
    engine, _ = _engine()
    ledger = Ledger()
    ledger.sync(engine.tracked)
    ledger.rows[0].period = 9
    ledger.rows[0].period_source = "theory"
    saved = ledger.state_dict()
    again = Ledger()
    again.load_state_dict(without_periods(saved))
    again.sync(engine.tracked)
    assert again.rows[0].period is None and again.rows[0].period_source == ""
    again.load_state_dict(saved)
    again.sync(engine.tracked)
    assert again.rows[0].period == 9 and again.rows[0].period_source == "theory"
