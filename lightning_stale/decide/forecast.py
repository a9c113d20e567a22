"""The theory's side of one optimizer: each parameter's rho-hat and the predicted stall of every measured second moment,
which the metrics set beside the measured one.

rho-hat comes from the paper's closed form where the slot's format has one (no data needed); other grids (8-bit
maps, foreign layouts) take the grid estimate on the stored values: a first one when the parameter is first measured,
then again at every check step (one host read and, with several processes, one collective for all of them) until the
state has settled (``slot_theory.settle_age``: an estimate of the first steps overstates rho-hat), and in rotation after
that, so that the live estimate stays within a few percent of one taken offline from a checkpoint. With several
processes every rho-hat is agreed that way (shards may hold different formats). Parameters waiting for an estimate are
*pending*; the monitor lets the policy choose (and revise) their period as their rho-hat comes in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lightning_stale.decide import slot_theory
from lightning_stale.decide.ledger import RHO_FINAL, RHO_PENDING, RHO_TRACKING, Ledger, LedgerRow
from lightning_stale.measure.counting import Batch
from lightning_stale.measure.rows import KeyedRows
from lightning_stale.measure.units import Entry
from lightning_stale.ranks import Reduce, summed

ESTIMATE_COLUMNS = 5  # per pending parameter: closed forms, their sum, estimates needed, sum of value/spacing, values
TRACKING_ROTATION = 4  # a settled grid estimate is re-taken every this many check steps


class StallForecast:
    """rho-hat and predictions of one optimizer's parameters.

    Args:
        reduce: sums across ranks, to agree grid estimates (None: a single process).
        warn: ``warn(key, message)`` warns once per key (an estimate that cannot be made yet).
        name: a parameter's readable name, for messages.
    """

    def __init__(self, reduce: Reduce | None, warn: Callable[[str, str], None],
                 name: Callable[[LedgerRow], str]) -> None:
        self.reduce = reduce
        self._warn, self._name = warn, name
        self.pending: set[int] = set()  # positions whose rho-hat is unknown or a young state's: every check
        self.tracked: set[int] = set()  # positions whose settled grid estimate is kept current, in rotation
        self.sums = np.zeros((0, 2))  # per slot row: sum and count of this window's predictions
        self.rows: KeyedRows[list[float]] = KeyedRows()  # the slot key of each row; the sums of slots not held now

    def adopt(self, ledger: Ledger) -> None:
        """Sort the parameters of a freshly synced ledger: rho-hat final where the closed form knows it (or there
        is none), pending where a grid estimate is needed, tracked where a settled one is kept current."""
        self.pending, self.tracked = set(), set()
        for unit in ledger.rows:
            if unit.rho_state == RHO_FINAL:
                continue
            if unit.rho_state == RHO_TRACKING:
                self.tracked.add(unit.position)
                continue
            if self.reduce is not None:
                self.pending.add(unit.position)  # agreed at the next estimate: shards may hold different formats
                continue
            driver = unit.driver()
            rho, _, needs_estimate = slot_theory.closed_form_rho(driver) if driver is not None else (None, "", False)
            if needs_estimate:
                self.pending.add(unit.position)
            else:
                ledger.set_rho(unit.position, math.nan if rho is None else rho, RHO_FINAL)

    def waiting(self, unit: LedgerRow) -> bool:
        """Whether the parameter still waits for its first rho-hat (its period cannot be chosen yet)."""
        return unit.position in self.pending and unit.rho is None

    def due(self, checks: int) -> list[int]:
        """The positions a check step (the ``checks``-th) estimates: every pending one, and the tracked ones in
        turn (each every ``TRACKING_ROTATION`` checks)."""
        tracked = sorted(self.tracked)[checks % TRACKING_ROTATION::TRACKING_ROTATION]
        return sorted(self.pending) + tracked

    def estimate(self, ledger: Ledger, positions: list[int]) -> list[LedgerRow]:
        """(Re-)estimate the rho-hat of the parameters at ``positions`` (pending or tracked), agreed across ranks
        (one host read per device, one collective); returns those whose period is to be chosen again: a changed
        estimate of a young state, or the first of a settled one (a settled parameter keeps its period). The same on
        every rank: the sets change only through agreed results."""
        units = [ledger.rows[i] for i in positions if i in self.pending or i in self.tracked]
        if not units:
            return []
        closed_rows, sums = [], []
        for unit in units:
            driver = unit.driver()
            closed, _, needs = slot_theory.closed_form_rho(driver) if driver is not None else (None, "", False)
            estimate = slot_theory.estimate_sums(driver, unit.key) if needs else None
            closed_rows.append([closed is not None, closed or 0.0, needs])
            sums.append(estimate if estimate is not None else torch.zeros(2, dtype=torch.float64))
        rows = np.concatenate([np.array(closed_rows, dtype=np.float64), to_host(sums)], axis=1)
        totals = summed(rows.reshape(-1, ESTIMATE_COLUMNS), self.reduce)
        changed = []
        for unit, (n_closed, closed_sum, n_needs, inverse_sum, n) in zip(units, totals.tolist()):
            if n > 0:
                rho = slot_theory.rho_from_sums(inverse_sum, int(n), unit.driver().beta)
                settled = unit.rho_state == RHO_TRACKING or unit.age >= slot_theory.settle_age(unit.driver().beta)
                state = RHO_TRACKING if settled else RHO_PENDING
            elif n_needs > 0:
                self._warn(f"estimate:{unit.key}",
                           f"lightning_stale: no theory prediction yet for {self._name(unit)!r}: its stored second "
                           "moment holds no non-zero value (zero gradients so far?); retrying at the next check step.")
                continue
            else:
                rho, state = (closed_sum / n_closed if n_closed > 0 else None), RHO_FINAL
            if state != RHO_PENDING:
                self.pending.discard(unit.position)
            if state == RHO_TRACKING:
                self.tracked.add(unit.position)
            if rho != unit.rho or state != unit.rho_state:
                settled_before = unit.rho_state == RHO_TRACKING
                ledger.set_rho(unit.position, math.nan if rho is None else rho, state)
                if not settled_before:  # a settled parameter's period stays; its rho-hat keeps up with the state
                    changed.append(unit)
        return changed

    def record(self, measured: list[Batch], ledger: Ledger) -> None:
        """Add the predicted stall of this step to every measured second moment whose rho-hat is known (host arrays
        only; the ledger's ages count the updates before this step's)."""
        rho, beta, ages = ledger.arrays["rho"], ledger.betas, ledger.ages
        for batch in measured:
            rows = batch.is_v & ~np.isnan(rho[batch.positions]) & ~np.isnan(beta[batch.positions])
            if rows.any():
                positions = batch.positions[rows]
                values = slot_theory.predicted_stall(ages[positions], rho[positions], beta[positions])
                np.add.at(self.sums[:, 0], batch.global_rows[rows], values)
                np.add.at(self.sums[:, 1], batch.global_rows[rows], 1)

    def align(self, entries: dict[str, Entry]) -> None:
        """Follow the engine's new slot rows, carrying each kept slot's sums (and a returning or restored slot's)."""
        sums = np.zeros((len(entries), 2))
        moves = self.rows.rebuild(entries, lambda _, row: self.sums[row].tolist())
        for entry in entries.values():
            if entry.key in moves.kept:
                sums[entry.row] = self.sums[moves.kept[entry.key]]
            elif entry.key in moves.returned:
                sums[entry.row] = moves.returned[entry.key]
        self.sums = sums

    def window(self, entries: dict[str, Entry]) -> np.ndarray:
        """(sum, count) of the predictions of every slot row of ``entries`` (the engine's) since the last
        :meth:`reset_window`; a readout (the sums are left as they are)."""
        if self.rows.keys == list(entries):
            return self.sums.copy()
        window = np.zeros((len(entries), 2))  # the slots changed since the last step (e.g. a hook was skipped)
        for entry in entries.values():
            saved = self.sums[self.rows.row(entry.key)] if entry.key in self.rows else self.rows.peek(entry.key)
            if saved is not None:
                window[entry.row] = saved
        return window

    def reset_window(self, entries: dict[str, Entry]) -> None:
        """Start a new window of predictions for the slot rows of ``entries`` (the stash keeps its sums)."""
        if self.rows.keys != list(entries):
            self.align(entries)
        self.sums[:] = 0.0

    def resident_bytes(self) -> int:
        """Bytes of the host arrays kept between steps."""
        return self.sums.nbytes

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.rows.state_dict({key: self.sums[i].tolist() for i, key in enumerate(self.rows.keys)})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a checkpoint's unlogged prediction sums (an empty state: none); pending estimates are re-derived
        when the parameters appear."""
        self.rows.restart(state.get("window", {}))
        self.sums, self.pending = np.zeros((0, 2)), set()


def to_host(sums: list[torch.Tensor], width: int = 2) -> np.ndarray:
    """(n, width) float64 on the host from ``width``-vectors on any devices: one read per device."""
    out = np.zeros((len(sums), width))
    for device in {t.device for t in sums}:
        rows = [i for i, t in enumerate(sums) if t.device == device]
        out[rows] = torch.stack([sums[i] for i in rows]).cpu().numpy()
    return out
