"""The tracking engine: stall, underflow and drift statistics of every slot of one optimizer.

Definitions (per slot, per measured step):

- **stalled**: the stored code did not change although the element's gradient was finite and non-zero. In
  block-scaled layouts (bitsandbytes, torchao, fp4/int8 ``QuantizedAdamW``) the block scale is recomputed every step,
  so an unchanged *code* may still hold a slightly different *value*: what is counted is the code.
- **underflow** (second moments): the stored value is exactly zero (its zero code) while the gradient was finite
  and non-zero, the precondition of the ``m / (sqrt(v) + eps)`` blow-up. Grids without a zero never underflow.
- **drift**: see :mod:`lightning_stale.measure.drift`.
- **non-finite** (per parameter, on logging steps): sampled weights that hold NaN/Inf
  (:mod:`lightning_stale.measure.finite`).

How the cost stays independent of the number of tensors: samples are strided views
(:mod:`lightning_stale.adapters.sampling`), so reading a slot's sampled codes launches nothing. The parameters are split
into *cohorts*; a measured step measures one cohort, in turn (``track="sample"``: ``params_per_step`` parameters each,
more when ``coverage_steps`` asks for it; ``track="exact"``: one cohort of every element of every slot), in a few
batched ops per layout (:mod:`lightning_stale.measure.counting`). Per-parameter Python work is limited to building the
gradient views of the cohort.

Host synchronisation happens only when batch plans are built (the first measurement of each cohort after the
optimizer state changes: zero codes of 8-bit maps are looked up once) and in the readouts (:meth:`StallEngine.window`,
:meth:`StallEngine.take_recent`, :meth:`StallEngine.drift`, :meth:`StallEngine.signals`,
:meth:`StallEngine.nonfinite`), which the monitor calls on logging and check steps; never in the step hooks otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor

from lightning_stale._compat import local_tensor
from lightning_stale.adapters.protocol import OptimizerAdapter
from lightning_stale.adapters.sampling import choose_sample
from lightning_stale.measure.counting import Batch, Counts, place_batches, plan_batches
from lightning_stale.measure.drift import DriftPanel
from lightning_stale.measure.finite import nonfinite
from lightning_stale.measure.units import Entry, TrackedParam, driver_group, driver_slot, weight_slot
from lightning_stale.vocab import WEIGHT

# per parameter in a check step's vector: drift * weight, weight, v stored as zero, v counted, w stalled, w counted
SIGNAL_COLUMNS = 6


class StallEngine:
    """Counts stalls, underflow and drift for every slot of one optimizer, a cohort at a time.

    Args:
        adapter: reads the optimizer's slots.
        prefix: names this optimizer's units (``<prefix>.<position in the param groups>``).
        exact: compare every element of every slot on each measured step.
        sample_size: sampled elements per slot in sample mode.
        params_per_step: parameters per cohort in sample mode (at least).
        coverage_steps: in sample mode, cohorts grow beyond ``params_per_step`` so that every parameter is measured
            at least once in this many measured steps (the front-ends pass their logging interval).
        seed: seed of the sample offsets.
        recent: keep the counts since the last :meth:`take_recent` (check steps read them).
        per_step: keep them measured step by measured step (a policy that observes each one).
    """

    def __init__(self, adapter: OptimizerAdapter, prefix: str, exact: bool, sample_size: int, params_per_step: int,
                 coverage_steps: int, seed: int, recent: bool = False, per_step: bool = False) -> None:
        self.adapter = adapter
        self.prefix = prefix
        self.exact = exact
        self.sample_size = sample_size
        self.params_per_step = params_per_step
        self.coverage_steps = coverage_steps
        self.seed = seed
        self.tracked: list[TrackedParam] = []
        self.entries: dict[str, Entry] = {}
        self.version = 0  # bumped whenever the set of slots is rebuilt
        self.cursor = 0  # measured steps so far: picks the cohort
        self.cohorts: list[list[TrackedParam]] = []
        self.measured_cohort: list[TrackedParam] = []  # the parameters of the last measured step, empty shards included
        self.counts = Counts(recent, per_step)
        self.panel = DriftPanel(exact)
        self._batches: dict[int, list[Batch]] = {}
        self._prev: list[Tensor] | None = None
        self._prev_cohort = -1
        self._placeholders: dict = {}
        self._n_state = -1
        self._state: object = None
        self._empty: list[Tensor] = []
        self._watch = 0  # refreshes that still compare the slots' tensors with the live state (after a reset)

    # -- structure ---------------------------------------------------------------------------------------------------
    def refresh(self, fresh_state: bool) -> bool:
        """Pick up optimizer state created or replaced since the last call; True when the slots were rebuilt.

        ``fresh_state`` says new state was created by the step that just ran, so a new shadow starts from zero (and
        takes this step's gradient); otherwise it starts from the stored value.
        """
        state = self.adapter.optimizer.state
        unchanged = len(state) == self._n_state and state is self._state and not any(state[p] for p in self._empty)
        if unchanged and not self._watch:
            return False
        self._n_state, self._state = len(state), state
        self._empty = [p for p, s in state.items() if not s]  # entries someone created empty (a defaultdict read)
        position = {id(p): i for i, p in enumerate(p for g in self.adapter.optimizer.param_groups for p in g["params"])}
        slots = sorted(self.adapter.slots(), key=lambda s: position[id(s.param)])
        if unchanged:
            self._watch -= 1
            if _layout(slots) == _layout(e.slot for e in self.entries.values() if e.moment != WEIGHT):
                return False
        units: dict[int, TrackedParam] = {}
        entries: dict[str, Entry] = {}
        pairs = {id(s.param) for s in slots if s.packed}
        for slot in slots:
            if id(slot.param) not in units:
                key = f"{self.prefix}.{position[id(slot.param)]}"
                size = None if self.exact else self.sample_size
                shard = local_tensor(slot.param)
                sample = choose_sample(key, shard.shape, size, self.seed, pairs=id(slot.param) in pairs)
                units[id(slot.param)] = TrackedParam(key, len(units), slot.param, sample, shard.numel())
            unit = units[id(slot.param)]
            key = f"{unit.key}.{slot.key}"
            entry = entries[key] = Entry(key, len(entries), unit, slot)
            unit.entries.append(entry)
        for unit in units.values():  # weights stored below fp32 are measured like one more slot of their parameter
            weight = weight_slot(unit.param)
            if weight is not None:
                key = f"{unit.key}.{weight.key}"
                entry = entries[key] = Entry(key, len(entries), unit, weight)
                unit.entries.append(entry)
        old_entries, self.entries, self.tracked = self.entries, entries, list(units.values())
        self.counts.rebuild(entries)
        self._build_cohorts()
        self.panel.rebuild(self.tracked, old_entries, fresh_state)
        self.version += 1
        return True

    def invalidate(self, watch: int = 0) -> None:
        """Rebuild the slots at the next refresh (the optimizer's state was loaded), or, with ``watch``, compare them
        with the live state at that many refreshes and rebuild if the optimizer replaced or removed a tensor (after
        a reset: SGD recreates a deleted momentum buffer at its next step)."""
        if watch:
            self._watch = max(self._watch, watch)
        else:
            self._n_state = -1

    def _build_cohorts(self) -> None:
        # Every unit, empty shards included: the cohort schedule must be the same on every rank.
        units = self.tracked
        size = len(units) if self.exact else max(self.params_per_step, -(-len(units) // self.coverage_steps))
        self.cohorts = [units[i:i + size] for i in range(0, len(units), max(1, size))]
        self._batches = {}
        self._prev = None

    def _plan(self, cohort: int) -> list[Batch]:
        """The batches of one cohort: every cohort's built at the first use after the slots changed (their tables go
        to the devices in one copy per device), then reused until the slots change again."""
        if not self._batches:
            plans = [plan_batches(units, self.sample_size, self.counts.local_row) for units in self.cohorts]
            place_batches([batch for plan in plans for batch in plan])
            self._batches = dict(enumerate(plans))
        return self._batches[cohort]

    # -- the step ----------------------------------------------------------------------------------------------------
    def before_step(self, measure: bool) -> None:
        """Snapshot the sampled codes of this step's cohort (only on measured steps)."""
        self.refresh(fresh_state=False)
        self._prev = None
        if measure and self.cohorts:
            self._prev_cohort = self.cursor % len(self.cohorts)
            self._prev = [b.snapshot() for b in self._plan(self._prev_cohort)]

    def discard(self) -> None:
        """Drop the snapshot of a step that did not happen (skipped inside a fused optimizer)."""
        self._prev = None

    def after_step(self) -> list[Batch]:
        """Update the drift shadows with this step's gradients and count the snapshotted cohort; returns the batches
        measured on this step (``measured_cohort`` holds its parameters, the same on every rank)."""
        self.measured_cohort = []
        if self.refresh(fresh_state=True):
            self._prev = None  # slots appeared during the step: this step has nothing to compare against
        self.panel.update(self._placeholders)
        if self._prev is None:
            return []
        measured = self._plan(self._prev_cohort)
        self.measured_cohort = self.cohorts[self._prev_cohort]
        for batch, prev in zip(measured, self._prev):
            self.counts.count(batch, prev, self._placeholders)
        self.counts.end_step()
        self._prev = None
        self.cursor += 1
        return measured

    def resync(self, positions: list[int], moments: tuple[str, ...]) -> None:
        """Restart the drift shadows of the ``moments`` of the units at ``positions`` from their stored values (after
        a reset)."""
        for position in positions:
            for entry in self.tracked[position].entries:
                if entry.moment in moments:
                    self.panel.resync(entry)

    # -- readouts ----------------------------------------------------------------------------------------------------
    def window(self) -> Tensor:
        """Per-slot totals since the last :meth:`reset_window`, (rows, N_STATS) float64 on the host in row order (a
        readout: calling it again gives the same totals)."""
        return self.counts.window()

    def reset_window(self) -> None:
        """Start a new window of per-slot totals."""
        self.counts.reset_window()

    def nonfinite(self) -> np.ndarray:
        """Per tracked parameter, whether its sampled weights hold NaN/Inf now (bool, host; one read per device)."""
        return nonfinite(self.tracked)

    def take_recent(self) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """Sampled (stalled, counted, underflow) counts of every slot since the previous call, (rows, 3) on the host
        in row order, unweighted, and with ``per_step`` each measured step's (its rows, their counts); one host read
        per device (:meth:`Counts.take_recent`)."""
        return self.counts.take_recent()

    def drift(self) -> dict[str, float]:
        """Drift of each shadowed slot (median stored/shadow for v, relative L2 error for m), by slot key."""
        return self.panel.readings(self.entries)

    def drift_weight(self, key: str) -> int:
        """Shadowed elements of a slot (the weight of its drift in aggregates)."""
        return self.panel.weight(key)

    def signals(self, recent: np.ndarray | None) -> np.ndarray:
        """A check step's local readings, (units, SIGNAL_COLUMNS): per parameter the drift of its driver v slot where
        the panel shadows it (drift * weight, weight) and, from ``recent`` counts, its v stored as zero and v counted,
        and its weight's stalled and counted elements. Parameters are the same on every rank whatever each shard
        holds, so these vectors add up across ranks."""
        local = np.zeros((len(self.tracked), SIGNAL_COLUMNS))
        for key, value in self.drift().items():
            entry = self.entries[key]
            if entry.moment == "v" and driver_slot(entry.unit.slots) is entry.slot:
                local[entry.unit.position, :2] += (value * self.drift_weight(key), self.drift_weight(key))
        if recent is not None:
            for entry in self.entries.values():
                if entry.moment == "v":
                    local[entry.unit.position, 2:4] += recent[entry.row, 2], recent[entry.row, 1]
                elif entry.moment == WEIGHT:
                    local[entry.unit.position, 4:6] += recent[entry.row, 0], recent[entry.row, 1]
        return local

    def agreed_signals(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(drift, underflow, weight stall) per parameter from :meth:`signals` summed across ranks: each parameter
        takes its driver group's drift (nan where the panel has none), its underflow fraction and its weight's stall
        fraction (nan where nothing was counted)."""
        groups = {g: i for i, g in enumerate(dict.fromkeys(driver_group(u) for u in self.tracked))}
        group_of = np.array([groups[driver_group(u)] for u in self.tracked], dtype=np.int64)
        drift = np.zeros((len(groups), 2))  # per driver group: sum of drift * weight, weight
        np.add.at(drift, group_of, values[:, :2])
        underflow = np.full(len(self.tracked), np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            group_drift = np.where(drift[:, 1] > 0, drift[:, 0] / drift[:, 1], np.nan)
            read = values[:, 3] > 0
            underflow[read] = values[read, 2] / values[read, 3]
            weight_stall = np.where(values[:, 5] > 0, values[:, 4] / values[:, 5], np.nan)
        return group_drift[group_of], underflow, weight_stall

    def tensors(self) -> list[Tensor]:
        """Every device tensor the engine keeps between steps: totals, recent counts, shadows, batch plans and the
        NaN stand-ins for missing gradients."""
        plans = [t for batches in self._batches.values() for batch in batches for t in batch.tensors()]
        return [*self.counts.tensors(), *self.panel.tensors(), *plans, *self._placeholders.values()]

    def resident_bytes(self) -> int:
        """Bytes the engine keeps between steps: :meth:`tensors` and its host arrays."""
        host = self.counts.measured.nbytes + sum(b.host_bytes for batches in self._batches.values() for b in batches)
        return sum(t.numel() * t.element_size() for t in self.tensors()) + host

    # -- checkpointing -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The cohort cursor, each slot's unlogged counts and its drift shadow (with what a loaded checkpoint holds
        for slots that have not appeared yet)."""
        return {"cursor": self.cursor, "totals": self.counts.state_dict(), "shadows": self.panel.state_dict()}

    def load_state_dict(self, state: dict[str, Any], counts: bool = True, shadows: bool = True) -> None:
        """Adopt a checkpoint's histories; each slot's part is applied when the slot appears (the slots are rebuilt
        at the next step, so what this engine held before is dropped).

        The cohort cursor is shared by every process; the unlogged ``counts`` and the drift ``shadows`` describe the
        saving process's own samples and shards, so the monitor leaves them out where they are not this process's."""
        self.cursor = int(state["cursor"])
        self._n_state = -1
        self.entries, self.tracked = {}, []
        self.counts.load_state_dict(state["totals"] if counts else {})
        self.panel.load_state_dict(state["shadows"] if shadows else {})


def _layout(slots: object) -> list[tuple[int, str, tuple[int, ...]]]:
    """Each slot's parameter, key and the addresses of the state tensors it reads, in order."""
    return [(id(s.param), s.key, tuple(t.data_ptr() for t in s.state_tensors())) for s in slots]
