"""The theory's side of one optimizer: each parameter's rho-hat and the predicted stall of every measured second moment,
which the metrics set beside the measured one.

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
    """rho-hat and predictions of one optimizer's parameters.

    Args:
        collective: agrees grid estimates across ranks.
        warn: ``warn(key, message)`` warns once per key (an estimate that cannot be made yet).
        name: a parameter's readable name, for messages.
    """

    def __init__(self, collective: Collective, warn: Callable[[str, str], None],
                 name: Callable[[ResetUnit], str]) -> None:
        self.collective = collective
        self._warn, self._name = warn, name
        self.pending: set[int] = set()  # parameter positions waiting for a grid estimate
        self.sums = np.zeros((0, 2))  # per slot row: sum and count of this window's predictions
        self._keys: list[str] = []  # the slot key of each row of ``sums``
        self._restored: dict[str, list[float]] = {}

    def adopt(self, schedule: ResetSchedule) -> None:
        """Give every parameter of a freshly synced schedule its rho-hat where the closed form knows it; mark the
        parameters that need a grid estimate pending."""
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
            known.append(unit)
        return known

    def record(self, measured: list[Batch], schedule: ResetSchedule) -> None:
        """Add the predicted stall of this step to every measured second moment whose rho-hat is known (host arrays
        only; the schedule's ages count the updates before this step's)."""
        rho, beta, ages = schedule.arrays["rho"], schedule.betas, schedule.ages
        for batch in measured:
            rows = batch.is_v & ~np.isnan(rho[batch.positions]) & ~np.isnan(beta[batch.positions])
            if rows.any():
                positions = batch.positions[rows]
                values = predict.predicted_stall(ages[positions], rho[positions], beta[positions])
                np.add.at(self.sums[:, 0], batch.global_rows[rows], values)
                np.add.at(self.sums[:, 1], batch.global_rows[rows], 1)

    def align(self, entries: dict[str, Entry]) -> None:
        """Follow the engine's new slot rows, carrying each kept slot's sums (and a restored checkpoint's)."""
        row_of = {key: i for i, key in enumerate(self._keys)}
        sums = np.zeros((len(entries), 2))
        for entry in entries.values():
            if entry.key in row_of:
                sums[entry.row] = self.sums[row_of[entry.key]]
            elif entry.key in self._restored:
                sums[entry.row] = self._restored.pop(entry.key)
        for key, i in row_of.items():  # a slot that went away keeps its sums for when it comes back
            if key not in entries:
                self._restored[key] = self.sums[i].tolist()
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
        """Bytes of the host arrays kept between steps."""
        return self.sums.nbytes

    def state_dict(self) -> dict[str, Any]:
        window = {key: self.sums[i].tolist() for i, key in enumerate(self._keys)}
        return {"window": {**self._restored, **window}}

    def load_state_dict(self, state: dict[str, Any], window: bool = True) -> None:
        """Adopt a checkpoint's unlogged prediction sums (``window``: only where they are this process's); pending
        estimates are re-derived when the parameters appear."""
        self._restored = dict(state.get("window", {})) if window else {}
        self.sums, self._keys, self.pending = np.zeros((0, 2)), [], set()
