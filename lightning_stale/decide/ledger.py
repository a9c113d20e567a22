"""Reset bookkeeping per parameter: ages, periods, resets, warm-up, guard windows, the theory's rho-hat, the signals
of check steps and the automatic remedy's choice; arrays over parameters.

One :class:`Ledger` per optimizer. Its per-parameter fields are numpy arrays so that the per-step work
(every age advances, built-in policies compare ages with periods) is a few vectorized operations whatever the number
of parameters; a policy sees one parameter through a :class:`LedgerRow`, a view into those arrays. Only this module
writes the arrays: the other components call the ledger's named mutators, and policies write the fields that are
theirs (``period``, ``period_source``, ``accumulator``, ``measured``) through the unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from lightning_stale.adapters.protocol import Slot
from lightning_stale.measure.rows import KeyedRows
from lightning_stale.measure.units import TrackedParam, driver_slot

NO_PERIOD = -1

# Per-parameter numeric fields: name -> (dtype, value of a new parameter). Saved in checkpoints by parameter key.
FIELDS: dict[str, tuple[type, float]] = {
    "age": (np.int64, 0),  # real optimizer steps since the zero start or the last reset
    "period": (np.int64, NO_PERIOD),  # chosen reset period, NO_PERIOD for none
    "resets": (np.int64, 0),
    "last_reset_step": (np.int64, -1),
    "warmup_left": (np.int64, 0),  # post-reset warm-up steps still to apply
    "guard_left": (np.int64, 0),  # steps still under the underflow guard (after a reset, or the automatic remedy's)
    "measured": (np.int64, 0),  # measured steps in the current cycle (adaptive policy)
    "accumulator": (np.float64, 0.0),  # sum of excess staleness in the current cycle (adaptive policy)
    "rho": (np.float64, math.nan),  # rho-hat of the driver slot; nan while unknown or not applicable
    "rho_state": (np.int64, 0),  # how rho-hat is known: RHO_PENDING, RHO_FINAL or RHO_TRACKING (below)
    # The signals read on check steps (drift of the driver's format group, v underflow fraction; nan: not read yet)
    # and what the automatic remedy last chose (an index into remedies.REMEDIES).
    "drift": (np.float64, math.nan),
    "underflow": (np.float64, math.nan),
    "remedy": (np.int64, 0),
    # the stall fraction of the stored weight (bf16/fp16 weights only) at the last check, and whether the weight
    # write-back has taken its write over (the automatic remedy's choice)
    "weight_stall": (np.float64, math.nan),
    "weights": (np.int64, 0),
}
# Kept across a resume (measured history, the same on every rank); the period is re-derived by the policy configured
# at resume.
HISTORY = ("age", "resets", "last_reset_step", "warmup_left", "guard_left", "measured", "accumulator", "rho",
           "rho_state", "drift", "underflow", "remedy", "weight_stall", "weights")
# rho_state: an estimate of a young state (or none yet), re-taken at every check; final (a closed form, or no
# theory); a grid estimate of a settled state, kept current in rotation.
RHO_PENDING, RHO_FINAL, RHO_TRACKING = range(3)


class LedgerRow:
    """One parameter as a policy sees it: its slots and its bookkeeping fields (read and written in place)."""

    def __init__(self, ledger: Ledger, position: int, tracked: TrackedParam) -> None:
        self._ledger, self.position, self._tracked = ledger, position, tracked

    key = property(lambda self: self._tracked.key)
    param = property(lambda self: self._tracked.param)

    @property
    def slots(self) -> list[Slot]:
        return self._tracked.slots

    def driver(self) -> Slot | None:
        """The slot whose staleness drives the decision: the second moment when there is one, else the first."""
        return driver_slot(self.slots)

    @property
    def period(self) -> int | None:
        value = int(self._ledger.arrays["period"][self.position])
        return None if value == NO_PERIOD else value

    @period.setter
    def period(self, value: int | None) -> None:
        self._ledger.arrays["period"][self.position] = NO_PERIOD if value is None else value

    @property
    def rho(self) -> float | None:
        value = float(self._ledger.arrays["rho"][self.position])
        return None if math.isnan(value) else value

    @property
    def period_source(self) -> str:
        return self._ledger.sources[self.position]

    @period_source.setter
    def period_source(self, value: str) -> None:
        self._ledger.sources[self.position] = value

    def __repr__(self) -> str:
        return f"LedgerRow({self.key!r}, age={self.age}, period={self.period})"


def _field(name: str, kind: type, writable: bool) -> property:
    def get(self: LedgerRow) -> Any:
        return kind(self._ledger.arrays[name][self.position])

    def set(self: LedgerRow, value: Any) -> None:
        self._ledger.arrays[name][self.position] = value

    return property(get, set if writable else None)


POLICY_FIELDS = ("measured", "accumulator")  # the fields a policy keeps itself (besides its period)
for _name in ("age", "resets", "last_reset_step", "warmup_left", "guard_left", "measured", "remedy", "rho_state"):
    setattr(LedgerRow, _name, _field(_name, int, _name in POLICY_FIELDS))
for _name in ("accumulator", "drift", "underflow", "weight_stall"):
    setattr(LedgerRow, _name, _field(_name, float, _name in POLICY_FIELDS))


class Ledger:
    """Reset bookkeeping of one optimizer's parameters, a row per parameter its engine tracks."""

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.rows: list[LedgerRow] = []
        self._keyed: KeyedRows[dict[str, Any]] = KeyedRows()  # each row's key; fields of parameters not synced now
        self.arrays: dict[str, np.ndarray] = {name: np.zeros(0, dtype=kind) for name, (kind, _) in FIELDS.items()}
        self.sources: list[str] = []  # why each period was chosen ("" until the policy configured the unit)
        self.betas = np.zeros(0)  # beta of each driver slot (nan when it is not an EMA)

    @property
    def keys(self) -> list[str]:
        """The parameter key of each row."""
        return self._keyed.keys

    def sync(self, units: list[TrackedParam],
             initial_ages: Callable[[list[TrackedParam]], list[int]] | None = None) -> list[LedgerRow]:
        """Align with the engine's units (same order), keeping each known parameter's fields; returns the new ones.

        A new parameter takes its fields from a loaded checkpoint (or from before its state went away) when there is
        one, else starts at its age from ``initial_ages(units)`` (called once, with all such parameters: the age of
        optimizer state that existed before monitoring began) or 0."""
        arrays = {name: np.full(len(units), default, dtype=kind) for name, (kind, default) in FIELDS.items()}
        sources = [""] * len(units)
        fresh: list[int] = []
        unaged: list[int] = []
        # a parameter whose state went away (a reset that deletes a buffer) keeps its history for when it returns
        moves = self._keyed.rebuild([u.key for u in units], self._saved)
        for i, unit in enumerate(units):
            if unit.key in moves.kept:
                j = moves.kept[unit.key]
                for name in FIELDS:
                    arrays[name][i] = self.arrays[name][j]
                sources[i] = self.sources[j]
            else:
                fresh.append(i)
                restored = moves.returned.get(unit.key)
                if restored is None:
                    unaged.append(i)
                for name in HISTORY + ("period",) if restored is not None else ():
                    if name in restored:
                        arrays[name][i] = restored[name]
                if restored is not None and "period" in restored:  # the period the same policy chose
                    sources[i] = restored.get("period_source", "")
        if unaged and initial_ages is not None:
            arrays["age"][unaged] = initial_ages([units[i] for i in unaged])
        self.arrays, self.sources = arrays, sources
        self.rows = [LedgerRow(self, i, unit) for i, unit in enumerate(units)]
        self.betas = np.array([_beta(u.driver()) for u in self.rows], dtype=np.float64)
        return [self.rows[i] for i in fresh]

    def _saved(self, key: str, row: int) -> dict[str, Any]:
        """Every field of the parameter at ``row`` (what is stashed and saved of it)."""
        return {**{name: self.arrays[name][row].item() for name in FIELDS}, "period_source": self.sources[row]}

    @classmethod
    def of(cls, n: int, **fields: Any) -> Ledger:
        """A ledger of ``n`` parameters with the given fields (arrays or scalars; the others at their defaults),
        without slots: to ask a policy or remedy what it would decide on given signals."""
        ledger = cls()
        ledger.arrays = {name: np.full(n, default, dtype=kind) for name, (kind, default) in FIELDS.items()}
        for name, values in fields.items():
            ledger.arrays[name][:] = values
        ledger.sources = [""] * n
        ledger._keyed.rebuild([str(i) for i in range(n)], ledger._saved)
        return ledger

    def resident_bytes(self) -> int:
        """Bytes of the per-parameter arrays."""
        return sum(a.nbytes for a in self.arrays.values()) + self.betas.nbytes

    @property
    def ages(self) -> np.ndarray:
        return self.arrays["age"]

    # -- mutators: how the other components change the bookkeeping ---------------------------------------------------
    def advance(self) -> None:
        """One real optimizer step for every parameter."""
        self.arrays["age"] += 1

    def set_rho(self, position: int, rho: float, state: int) -> None:
        """The theory's rho-hat of a parameter's driver slot and how it is known (``RHO_PENDING``, ...)."""
        self.arrays["rho"][position] = rho
        self.arrays["rho_state"][position] = state

    def set_signals(self, drift: np.ndarray, underflow: np.ndarray, weight_stall: np.ndarray) -> None:
        """A check step's readings, agreed across ranks: every parameter's drift (nan: none), and the underflow and
        weight stall of the parameters counted since the last check (nan elsewhere keeps the previous reading)."""
        for name, values in (("underflow", underflow), ("weight_stall", weight_stall)):
            read = ~np.isnan(values)
            self.arrays[name][read] = values[read]
        self.arrays["drift"][:] = drift

    def set_weights(self, rows: np.ndarray) -> None:
        """The weight write-back took over the parameters at ``rows``."""
        self.arrays["weights"][rows] = 1

    def set_remedy(self, chosen: np.ndarray) -> None:
        """What the automatic remedy chose per parameter (indices into ``remedies.REMEDIES``)."""
        self.arrays["remedy"][:] = chosen

    def open_guard(self, rows: np.ndarray, steps: int) -> None:
        """Keep the parameters at ``rows`` under the underflow guard for at least ``steps`` more steps."""
        self.arrays["guard_left"][rows] = np.maximum(self.arrays["guard_left"][rows], steps)

    def use_guard_step(self) -> list[LedgerRow]:
        """The parameters inside a guard window, each window one step shorter afterwards."""
        rows = np.flatnonzero(self.arrays["guard_left"] > 0)
        self.arrays["guard_left"][rows] -= 1
        return [self.rows[i] for i in rows]

    def use_warmup_step(self, position: int, steps: int) -> float:
        """The factor ``i / steps`` of a parameter's ``i``-th post-reset warm-up step (of ``steps``), which it uses
        up."""
        factor = (steps - int(self.arrays["warmup_left"][position]) + 1) / steps
        self.arrays["warmup_left"][position] -= 1
        return factor

    def record_reset(self, units: list[LedgerRow], step: int, warmup_steps: int, guard_steps: int) -> None:
        """Restart the cycle of ``units`` after their reset at optimizer step ``step``."""
        rows = np.array([u.position for u in units], dtype=np.int64)
        for name, value in (("age", 0), ("measured", 0), ("accumulator", 0.0), ("warmup_left", warmup_steps),
                            ("last_reset_step", step), ("drift", math.nan)):
            self.arrays[name][rows] = value
        self.open_guard(rows, guard_steps)
        self.arrays["resets"][rows] += 1

    @property
    def warming_any(self) -> bool:
        """Some parameter is inside a post-reset warm-up."""
        return bool(self.arrays["warmup_left"].any())

    def warming(self) -> list[LedgerRow]:
        """Parameters inside a post-reset warm-up."""
        return [self.rows[i] for i in np.flatnonzero(self.arrays["warmup_left"] > 0)]

    @property
    def guarding(self) -> bool:
        """Some parameter is inside a guard window."""
        return bool(self.arrays["guard_left"].any())

    # -- checkpointing -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every parameter's fields by key (with what a loaded checkpoint holds for parameters not seen again yet)."""
        return self._keyed.state_dict({key: self._saved(key, i) for i, key in enumerate(self.keys)})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt the measured history of a checkpoint (ages, reset counts, warm-up, adaptive accumulators, rho-hat
        estimates, periods) in place of what the ledger held; each parameter takes its part when it is next
        synced."""
        self._clear()
        self._keyed.restart(state)


def without_periods(state: dict[str, Any]) -> dict[str, Any]:
    """A saved ledger without the periods its policy chose: what a resume under another policy loads (that policy
    chooses them anew)."""
    return {key: {name: value for name, value in fields.items() if name not in ("period", "period_source")}
            for key, fields in state.items()}


def _beta(slot: Slot | None) -> float:
    return math.nan if slot is None or slot.beta is None else float(slot.beta)

