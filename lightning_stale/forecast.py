"""The theory's side of one optimizer: each parameter's rho-hat, its stall build-up curve, and the predicted stall of
every measured second moment, which the metrics set beside the measured one.

rho-hat comes from the paper's closed form where the slot's format has one (no data needed); other grids (8-bit
maps, foreign layouts) take the grid estimate on the stored values at the parameter's first measurement, summed
across ranks so that every rank agrees (with several processes every rho-hat is agreed that way: shards may hold
different formats). Parameters waiting for an estimate are *pending*; the monitor lets the policy choose their period
once their rho-hat is known.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from lightning_stale import predict
from lightning_stale.collective import Collective
from lightning_stale.counting import Batch
from lightning_stale.schedule import ResetSchedule, ResetUnit
from lightning_stale.tracked import Entry, Unit

ESTIMATE_COLUMNS = 5  # per pending parameter: closed forms, their sum, estimates needed, sum of 1/r, values


class StallForecast:
    """rho-hat, curves and predictions of one optimizer's parameters.

    Args:
        collective: agrees grid estimates across ranks.
        warn: ``warn(key, message)`` warns once per key (an estimate that cannot be made yet).
        name: a parameter's readable name, for messages.
    """

    def __init__(self, collective: Collective, warn: Callable[[str, str], None],
                 name: Callable[[ResetUnit], str]) -> None:
        self.collective = collective
        self._warn, self._name = warn, name
        self.curves: list[np.ndarray] = []  # distinct build-up curves in use
        self.curve_of = np.zeros(0, dtype=np.int64)  # per parameter, -1 for none
        self.pending: set[int] = set()  # parameter positions waiting for a grid estimate
        self.sums = np.zeros((0, 2))  # per slot row: sum and count of this window's predictions
        self._keys: list[str] = []  # the slot key of each row of ``sums``
        self._restored: dict[str, list[float]] = {}

    def adopt(self, schedule: ResetSchedule) -> None:
        """Give every parameter of a freshly synced schedule its rho-hat where the closed form knows it and its
        curve; mark the parameters that need a grid estimate pending."""
        self.curve_of = np.full(len(schedule.units), -1, dtype=np.int64)
        self.pending = set()
        for unit in schedule.units:
            if unit.rho is None and self.collective.active and unit.period_source == "":
                self.pending.add(unit.position)  # agreed at its first measurement
                continue
            driver = unit.driver()
            rho, _, needs_estimate = predict.closed_form_rho(driver) if driver is not None else (None, "", False)
            if rho is not None:
                schedule.set_rho(unit.position, rho)
            elif needs_estimate and unit.rho is None:
                self.pending.add(unit.position)
            self._pick_curve(unit)

    def _pick_curve(self, unit: ResetUnit) -> None:
        driver = unit.driver()
        if unit.rho is not None and driver is not None and driver.beta is not None:
            curve = predict.build_up_curve(unit.rho, driver.beta)
            ids = [i for i, c in enumerate(self.curves) if c is curve]
            if not ids:
                self.curves.append(curve)
                ids = [len(self.curves) - 1]
            self.curve_of[unit.position] = ids[0]

    def estimate(self, schedule: ResetSchedule, cohort: list[Unit]) -> list[ResetUnit]:
        """Give the pending parameters of the step's ``cohort`` their rho-hat (one host read each, one collective for
        all); returns those now known. The same on every rank: pending sets change only through agreed results."""
        units = [schedule.units[u.position] for u in cohort if u.position in self.pending]
        if not units:
            return []
        rows = []
        for unit in units:
            driver = unit.driver()
            closed, _, needs = predict.closed_form_rho(driver) if driver is not None else (None, "", False)
            sums = predict.estimate_sums(driver, unit.key) if needs else None
            rows.append([closed is not None, closed or 0.0, needs, *(sums or (0.0, 0))])
        totals = self.collective.sum(np.array(rows, dtype=np.float64).reshape(-1, ESTIMATE_COLUMNS))
        known = []
        for unit, (n_closed, closed_sum, n_needs, inverse_sum, n) in zip(units, totals.tolist()):
            if n > 0:
                rho = predict.rho_from_sums(inverse_sum, int(n), unit.driver().beta)
            elif n_needs > 0:
                self._warn(f"estimate:{unit.key}",
                           f"lightning_stale: no theory prediction yet for {self._name(unit)!r}: its stored second "
                           "moment holds no non-zero value (zero gradients so far?); retrying when it is next measured.")
                continue
            else:
                rho = closed_sum / n_closed if n_closed > 0 else None
            self.pending.discard(unit.position)
            if rho is not None:
                schedule.set_rho(unit.position, rho)
            self._pick_curve(unit)
            known.append(unit)
        return known

    def record(self, measured: list[Batch], ages: np.ndarray) -> None:
        """Add the predicted stall of this step to every measured second moment with a curve (host arrays only;
        ``ages``: each parameter's updates since its zero start or last reset, before this step's)."""
        for batch in measured:
            curve_ids = np.where(batch.is_v, self.curve_of[batch.positions], -1)
            present = curve_ids[curve_ids >= 0]
            if present.size == 0:
                continue
            distinct = [present[0]] if (present == present[0]).all() else np.unique(present)  # usually one curve
            for curve_id in distinct:
                chosen = curve_ids == curve_id
                values = predict.predicted_stall(self.curves[curve_id], ages[batch.positions[chosen]])
                np.add.at(self.sums[:, 0], batch.global_rows[chosen], values)
                np.add.at(self.sums[:, 1], batch.global_rows[chosen], 1)

    def align(self, entries: dict[str, Entry]) -> None:
        """Follow the engine's new slot rows, carrying each kept slot's sums (and a restored checkpoint's)."""
        row_of = {key: i for i, key in enumerate(self._keys)}
        sums = np.zeros((len(entries), 2))
        for entry in entries.values():
            if entry.key in row_of:
                sums[entry.row] = self.sums[row_of[entry.key]]
            elif entry.key in self._restored:
                sums[entry.row] = self._restored.pop(entry.key)
        self.sums, self._keys = sums, list(entries)

    def take_window(self, entries: dict[str, Entry]) -> np.ndarray:
        """(sum, count) of the predictions of every slot row of ``entries`` (the engine's) since the previous call;
        starts a new window."""
        if self._keys != list(entries):  # the slots changed since the last step (e.g. a hook was skipped)
            self.align(entries)
        window = self.sums.copy()
        self.sums[:] = 0.0
        return window

    def resident_bytes(self) -> int:
        """Bytes of the host arrays kept between steps (the curves are shared process-wide)."""
        return self.sums.nbytes + self.curve_of.nbytes

    def state_dict(self) -> dict[str, Any]:
        window = {key: self.sums[i].tolist() for i, key in enumerate(self._keys)}
        return {"window": {**self._restored, **window}}

    def load_state_dict(self, state: dict[str, Any], window: bool = True) -> None:
        """Adopt a checkpoint's unlogged prediction sums (``window``: only where they are this process's); rho-hat,
        curves and pending estimates are re-derived when the parameters appear."""
        self._restored = dict(state.get("window", {})) if window else {}
        self.sums, self._keys = np.zeros((0, 2)), []
        self.curves, self.curve_of, self.pending = [], np.zeros(0, dtype=np.int64), set()
