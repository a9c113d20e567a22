"""The tracking engine: stall, underflow and drift statistics of every slot of one optimizer, in batched tensor ops.

Definitions (per slot, per measured step):

- **stalled**: the stored code did not change although the element's gradient was finite and non-zero. In
  block-scaled layouts (bitsandbytes, torchao, fp4/int8 ``QuantizedAdamW``) the block scale is recomputed every step,
  so an unchanged *code* may still hold a slightly different *value*: what is counted is the code.
- **underflow** (second moments): the stored value is exactly zero (its zero code) while the gradient was finite
  and non-zero, the precondition of the ``m / (sqrt(v) + eps)`` blow-up. Grids without a zero never underflow.
- **drift**: an fp32 *shadow* EMA of the same gradients (same beta, restarted with the state) on a fixed sample;
  drift is the median ratio stored/shadow for ``v`` and the relative L2 error for ``m``.

How the cost stays independent of the number of tensors:

- Samples are strided views (:mod:`lightning_stale.sampling`): reading a slot's sampled codes launches nothing.
- The parameters are split into *cohorts*. A measured step measures one cohort, in turn (``track="sample"``: at
  most ``params_per_step`` parameters each; ``track="exact"``: one cohort of every element of every slot). The
  cohort's codes are read with one ``torch.cat`` per device before and after the step, compared in a few elementwise
  ops, reduced per slot with one cumulative sum, and added to a device-resident totals matrix with one
  ``index_add_``. Per-slot Python work is limited to building the list of gradient views of the cohort.
- A drift shadow must see every gradient, so shadows are kept for a fixed *panel* of at most ``DRIFT_PARAMS``
  parameters (all of them in exact mode), chosen by a hash of their keys, on the first ``DRIFT_SAMPLE`` elements of
  their sample.

Host synchronisation happens only when plans are (re)built (new optimizer state), in the readouts
(:meth:`StallEngine.window`, :meth:`StallEngine.last_fractions`) and in grid estimates; never in the step hooks.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_stale.adapters.base import OptimizerAdapter, Slot
from lightning_stale.sampling import Sample, choose_sample

STALLED, COUNTED, UNDERFLOW, MEASURED = range(4)  # columns of the per-slot totals
N_STATS = 4
DRIFT_PARAMS = 16  # parameters with a drift shadow in sample mode
DRIFT_SAMPLE = 1024  # shadowed elements per slot
EXACT_BATCH = 1 << 22  # elements compared in one batch in exact mode (bounds the transient memory)


@dataclass(eq=False)
class Unit:
    """A parameter with optimizer state: its slots share one sample and are reset together."""

    key: str
    index: int  # position of the parameter in the optimizer's param groups
    position: int  # position in the engine's unit list (and in the reset schedule's arrays)
    param: Tensor
    sample: Sample
    entries: list[Entry] = field(default_factory=list)

    def grad_view(self, sample: Sample, placeholders: dict) -> Tensor:
        """The gradient at ``sample`` (a view), or NaN (never counted) when the step had no dense gradient."""
        grad = self.param.grad
        if grad is None or grad.is_sparse or grad.numel() != self.param.numel():
            key = (sample.numel, self.param.device)
            if key not in placeholders:
                placeholders[key] = torch.full((sample.numel,), math.nan, device=self.param.device)
            return placeholders[key]
        return sample.view(grad)


@dataclass(eq=False)
class Entry:
    """A tracked slot: its row in the totals matrix and its parameter."""

    key: str
    row: int
    unit: Unit
    slot: Slot

    @property
    def moment(self) -> str:
        return self.slot.moment


@dataclass(eq=False)
class Batch:
    """The slots of one cohort on one device whose sampled codes are concatenated and compared together."""

    entries: list[Entry]
    packed: bool
    code_views: list[Tensor]  # strided views of the state: valid while the optimizer keeps its tensors
    last: Tensor  # index of each slot's last element in the concatenation
    rows: Tensor  # each slot's row in the totals matrix
    weights: Tensor  # (n, N_STATS): elements per sampled element; 0 in the underflow column where none is possible
    zero_codes: Tensor | None  # per element, when some slot's zero code is not 0
    global_rows: np.ndarray  # each slot's row in the engine's row order (host)
    positions: np.ndarray  # each slot's unit position (host)
    is_v: np.ndarray  # each slot is a second moment (host)

    @property
    def device(self) -> torch.device:
        return self.rows.device


@dataclass(eq=False)
class Shadow:
    """fp32 shadow EMAs of the panel slots sharing a device, a moment and a beta, as one flat tensor."""

    moment: str
    beta: float
    entries: list[Entry]
    values: Tensor
    starts: list[int]

    def part(self, i: int) -> Tensor:
        n = self.entries[i].unit.sample.prefix(DRIFT_SAMPLE).numel
        return self.values[self.starts[i]:self.starts[i] + n]


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
    """

    def __init__(self, adapter: OptimizerAdapter, prefix: str, exact: bool, sample_size: int, params_per_step: int,
                 coverage_steps: int, seed: int) -> None:
        self.adapter = adapter
        self.prefix = prefix
        self.exact = exact
        self.sample_size = sample_size
        self.params_per_step = params_per_step
        self.coverage_steps = coverage_steps
        self.seed = seed
        self.units: list[Unit] = []
        self.entries: dict[str, Entry] = {}
        self.version = 0  # bumped whenever the set of slots is rebuilt
        self.cursor = 0  # measured steps so far: picks the cohort
        self.totals: dict[torch.device, Tensor] = {}  # per device: (rows on that device, N_STATS) float64
        self.last: dict[torch.device, Tensor] = {}  # per device: (rows, 2) stalled/counted of the last measurement
        self.predicted = np.zeros(0)  # per row: sum of the theory's predictions over measured steps (host)
        self.predicted_n = np.zeros(0, dtype=np.int64)
        self.cohorts: list[list[Unit]] = []
        self._batches: dict[int, list[Batch]] = {}
        self._shadows: list[Shadow] = []
        self._shadow_of: dict[str, tuple[Shadow, int]] = {}
        self._restored: dict[str, Any] = {}
        self._prev: list[Tensor] | None = None
        self._prev_cohort = -1
        self._placeholders: dict = {}
        self._where: dict[str, tuple[torch.device, int]] = {}  # slot key -> (device, row in that device's totals)
        self._device_rows: dict[torch.device, list[int]] = {}  # per device: the global row of each local row
        self._n_state = -1
        self._state: object = None
        self._empty: list[Tensor] = []

    # -- structure ---------------------------------------------------------------------------------------------------
    def refresh(self, fresh_state: bool) -> bool:
        """Pick up optimizer state created or replaced since the last call; True when the slots were rebuilt.

        ``fresh_state`` says new state was created by the step that just ran, so a new shadow starts from zero (and
        takes this step's gradient); otherwise it starts from the stored value.
        """
        state = self.adapter.optimizer.state
        if len(state) == self._n_state and state is self._state and not any(state[p] for p in self._empty):
            return False
        self._n_state, self._state = len(state), state
        self._empty = [p for p, s in state.items() if not s]  # entries someone created empty (a defaultdict read)
        position = {id(p): i for i, p in enumerate(p for g in self.adapter.optimizer.param_groups for p in g["params"])}
        old_entries, old_shadows = self.entries, {k: s.part(i).clone() for k, (s, i) in self._shadow_of.items()}
        units: dict[int, Unit] = {}
        entries: dict[str, Entry] = {}
        slots = sorted(self.adapter.slots(), key=lambda s: position[id(s.param)])
        pairs = {id(s.param) for s in slots if s.packed}
        for slot in slots:
            index = position[id(slot.param)]
            if id(slot.param) not in units:
                key = f"{self.prefix}.{index}"
                size = None if self.exact else self.sample_size
                sample = choose_sample(key, slot.param.shape, size, self.seed, pairs=id(slot.param) in pairs)
                units[id(slot.param)] = Unit(key, index, len(units), slot.param, sample)
            unit = units[id(slot.param)]
            key = f"{unit.key}.{slot.key}"
            entry = entries[key] = Entry(key, len(entries), unit, slot)
            unit.entries.append(entry)
        self.units = list(units.values())
        self._rebuild_totals(old_entries, entries)
        self.entries = entries
        self._build_cohorts()
        self._build_shadows(old_shadows, old_entries, fresh_state)
        self.version += 1
        return True

    def rebind(self) -> None:
        """Forget the slot objects (optimizer state was reloaded or replaced); histories are kept by key."""
        self._n_state = -1
        self._prev = None

    def _rebuild_totals(self, old: dict[str, Entry], new: dict[str, Entry]) -> None:
        """New totals rows for the new slot set, carrying each kept slot's history (and restored checkpoint rows)."""
        rows: dict[torch.device, list[Entry]] = {}
        for entry in new.values():
            rows.setdefault(entry.slot.param.device, []).append(entry)
        totals = {d: torch.zeros(len(g), N_STATS, dtype=torch.float64, device=d) for d, g in rows.items()}
        predicted, predicted_n = np.zeros(len(new)), np.zeros(len(new), dtype=np.int64)
        restored = self._restored.get("totals", {})
        for device, group in rows.items():
            for local, entry in enumerate(group):
                previous = old.get(entry.key)
                if previous is not None and previous.key in self._where:
                    where_device, where_row = self._where[previous.key]
                    totals[device][local] = self.totals[where_device][where_row]
                    predicted[entry.row] = self.predicted[previous.row]
                    predicted_n[entry.row] = self.predicted_n[previous.row]
                elif entry.key in restored:
                    saved = restored.pop(entry.key)
                    totals[device][local] = saved["totals"].to(totals[device])
                    predicted[entry.row], predicted_n[entry.row] = saved["predicted"]
        self.totals, self.predicted, self.predicted_n = totals, predicted, predicted_n
        self.last = {d: torch.zeros(len(g), 2, dtype=torch.float64, device=d) for d, g in rows.items()}
        self._where = {e.key: (d, local) for d, g in rows.items() for local, e in enumerate(g)}
        self._device_rows = {d: [e.row for e in g] for d, g in rows.items()}

    def _build_cohorts(self) -> None:
        units = [u for u in self.units if u.sample.count > 0]
        size = len(units) if self.exact else max(self.params_per_step, -(-len(units) // self.coverage_steps))
        self.cohorts = [units[i:i + size] for i in range(0, len(units), max(1, size))]
        self._batches = {}
        self._prev = None

    def _plan(self, cohort: int) -> list[Batch]:
        """The batches of one cohort (built on first use, then reused until the slots change)."""
        if cohort not in self._batches:
            groups: dict[tuple[torch.device, bool], list[list[Entry]]] = {}
            for unit in self.cohorts[cohort]:
                for entry in unit.entries:
                    batches = groups.setdefault((entry.slot.param.device, entry.slot.packed), [[]])
                    if batches[-1] and sum(e.unit.sample.numel for e in batches[-1]) >= EXACT_BATCH:
                        batches.append([])
                    batches[-1].append(entry)
            self._batches[cohort] = [self._batch(group, packed)
                                     for (_, packed), split in groups.items() for group in split]
        return self._batches[cohort]

    def _batch(self, entries: list[Entry], packed: bool) -> Batch:
        device = entries[0].slot.param.device
        lengths = [e.unit.sample.numel for e in entries]
        ends = torch.tensor(np.cumsum(lengths) - 1, dtype=torch.int64, device=device)
        rows = torch.tensor([self._where[e.key][1] for e in entries], dtype=torch.int64, device=device)
        weights = []
        zeros = []
        for entry, n in zip(entries, lengths):
            w = entry.slot.param.numel() / n
            zero = entry.slot.zero_code() if entry.moment == "v" else None
            zeros.append(zero)
            weights.append([w, w, w if zero is not None else 0.0, 1.0])
        zero_codes = None
        if any(z not in (0, None) for z in zeros):
            per_slot = torch.tensor([0 if z is None else z for z in zeros], device=device)
            zero_codes = torch.repeat_interleave(per_slot, torch.tensor(lengths, device=device))
        return Batch(entries, packed, [e.slot.sampled_codes(e.unit.sample) for e in entries], ends, rows,
                     torch.tensor(weights, dtype=torch.float64, device=device), zero_codes,
                     np.array([e.row for e in entries], dtype=np.int64),
                     np.array([e.unit.position for e in entries], dtype=np.int64),
                     np.array([e.moment == "v" for e in entries], dtype=bool))

    def _build_shadows(self, old: dict[str, Tensor], old_entries: dict[str, Entry], fresh_state: bool) -> None:
        candidates = [u for u in self.units if u.sample.count > 0 and any(e.slot.beta is not None for e in u.entries)]
        if not self.exact:
            candidates = sorted(candidates, key=lambda u: zlib.crc32(u.key.encode()))[:DRIFT_PARAMS]
            candidates.sort(key=lambda u: u.index)
        groups: dict[tuple, list[Entry]] = {}
        for unit in candidates:
            for entry in unit.entries:
                if entry.slot.beta is not None:
                    groups.setdefault((entry.slot.param.device, entry.moment, entry.slot.beta), []).append(entry)
        restored = self._restored.get("shadows", {})
        self._shadows, self._shadow_of = [], {}
        for (device, moment, beta), entries in groups.items():
            lengths = [e.unit.sample.prefix(DRIFT_SAMPLE).numel for e in entries]
            shadow = Shadow(moment, beta, entries, torch.zeros(sum(lengths), device=device),
                            [int(s) for s in np.cumsum([0] + lengths[:-1])])
            self._shadows.append(shadow)
            for i, entry in enumerate(entries):
                self._shadow_of[entry.key] = (shadow, i)
                if entry.key in old:
                    shadow.part(i).copy_(old[entry.key])
                elif entry.key in restored:
                    shadow.part(i).copy_(restored.pop(entry.key))
                elif not (fresh_state and entry.key not in old_entries):
                    self.resync(entry)

    # -- the step ----------------------------------------------------------------------------------------------------
    def before_step(self, measure: bool) -> None:
        """Snapshot the sampled codes of this step's cohort (only on measured steps)."""
        self.refresh(fresh_state=False)
        self._prev = None
        if measure and self.cohorts:
            self._prev_cohort = self.cursor % len(self.cohorts)
            self._prev = [torch.cat(b.code_views) for b in self._plan(self._prev_cohort)]

    def discard(self) -> None:
        """Drop the snapshot of a step that did not happen (skipped inside a fused optimizer)."""
        self._prev = None

    def after_step(self) -> list[Batch]:
        """Update the drift shadows with this step's gradients and count the snapshotted cohort; returns the batches
        measured on this step."""
        if self.refresh(fresh_state=True):
            self._prev = None  # slots appeared during the step: this step has nothing to compare against
        grads: dict[tuple[int, Sample], Tensor] = {}
        self._update_shadows(grads)
        if self._prev is None:
            return []
        measured = self._plan(self._prev_cohort)
        for batch, prev in zip(measured, self._prev):
            self._count(batch, prev, grads)
        self._prev = None
        self.cursor += 1
        return measured

    def _grad(self, unit: Unit, sample: Sample, grads: dict) -> Tensor:
        key = (unit.index, sample)
        if key not in grads:
            grads[key] = unit.grad_view(sample, self._placeholders)
        return grads[key]

    def _count(self, batch: Batch, prev: Tensor, grads: dict) -> None:
        new = torch.cat(batch.code_views)
        if batch.packed:
            new, prev = _unpack(new), _unpack(prev)
        grad = torch.cat([self._grad(e.unit, e.unit.sample, grads) for e in batch.entries])
        magnitude = grad.abs()
        counted = (magnitude > 0).logical_and_(magnitude < math.inf)  # NaN compares false: not counted
        stalled = (new == prev).logical_and_(counted)
        zero = (new == (0 if batch.zero_codes is None else batch.zero_codes)).logical_and_(counted)
        sums = _segment_sums(torch.stack([stalled, counted, zero], dim=1), batch.last)
        stats = torch.cat([sums.double(), torch.ones_like(sums[:, :1], dtype=torch.float64)], dim=1)
        self.totals[batch.device].index_add_(0, batch.rows, stats.mul_(batch.weights))
        self.last[batch.device].index_copy_(0, batch.rows, sums[:, :2].double())

    def _update_shadows(self, grads: dict) -> None:
        for shadow in self._shadows:
            grad = torch.cat([self._grad(e.unit, e.unit.sample.prefix(DRIFT_SAMPLE), grads) for e in shadow.entries])
            grad = grad.float()
            signal = grad if shadow.moment == "m" else grad * grad
            moved = torch.lerp(shadow.values, signal, 1.0 - shadow.beta)
            shadow.values.copy_(torch.where(torch.isfinite(grad), moved, shadow.values))

    def resync(self, entry: Entry) -> None:
        """Restart a slot's shadow from its stored value (exactly zero right after a full reset)."""
        if entry.key in self._shadow_of:
            shadow, i = self._shadow_of[entry.key]
            index = entry.unit.sample.prefix(DRIFT_SAMPLE).positions(entry.slot.param.device)
            shadow.part(i).copy_(entry.slot.value_at(index).float())

    def add_predictions(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Add the theory's predicted stall of this step to the slots at ``rows`` (host arrays, no device work)."""
        np.add.at(self.predicted, rows, values)
        np.add.at(self.predicted_n, rows, 1)

    # -- readouts ----------------------------------------------------------------------------------------------------
    def last_fractions(self, entries: list[Entry]) -> list[float]:
        """Stall fraction of each slot's last measurement (one host synchronisation)."""
        out = []
        host = {device: last.cpu() for device, last in self.last.items()}
        for entry in entries:
            device, row = self._where[entry.key]
            stalled, counted = host[device][row].tolist()
            out.append(stalled / counted if counted > 0 else math.nan)
        return out

    def window(self) -> dict[str, Tensor]:
        """Per-slot totals since the previous call, on the host (the call starts a new window): a (rows, N_STATS)
        float64 tensor ``totals`` in row order and ``predicted`` (sum, n) per row."""
        totals = torch.zeros(len(self.entries), N_STATS, dtype=torch.float64)
        for device, local in self.totals.items():
            totals[self._device_rows[device]] = local.cpu()
            local.zero_()
        predicted = torch.from_numpy(np.stack([self.predicted, self.predicted_n.astype(np.float64)], axis=1))
        self.predicted[:] = 0.0
        self.predicted_n[:] = 0
        return {"totals": totals, "predicted": predicted}

    def drift(self) -> dict[str, float]:
        """Drift of each shadowed slot (median stored/shadow for v, relative L2 error for m), by slot key."""
        out = {}
        for key, (shadow, i) in self._shadow_of.items():
            entry = shadow.entries[i]
            index = entry.unit.sample.prefix(DRIFT_SAMPLE).positions(entry.slot.param.device)
            stored, reference = entry.slot.value_at(index).float(), shadow.part(i)
            if entry.moment == "v":
                ok = reference > 0
                value = float((stored[ok] / reference[ok]).median()) if bool(ok.any()) else math.nan
            else:
                norm = float(reference.norm())
                value = float((stored - reference).norm()) / norm if norm > 0 else math.nan
            if math.isfinite(value):
                out[key] = value
        return out

    def drift_weight(self, key: str) -> int:
        """Shadowed elements of a slot (the weight of its drift in aggregates)."""
        shadow, i = self._shadow_of[key]
        return shadow.entries[i].unit.sample.prefix(DRIFT_SAMPLE).numel

    def resident_bytes(self) -> int:
        """Bytes the engine keeps between steps: totals, shadows, batch plans (device) and prediction sums (host)."""
        tensors = [*self.totals.values(), *self.last.values(), *(s.values for s in self._shadows)]
        for batches in self._batches.values():
            for batch in batches:
                tensors += [batch.last, batch.rows, batch.weights]
                if batch.zero_codes is not None:
                    tensors.append(batch.zero_codes)
        host = self.predicted.nbytes + self.predicted_n.nbytes
        return sum(t.numel() * t.element_size() for t in tensors) + host

    # -- checkpointing -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        host = {device: totals.cpu() for device, totals in self.totals.items()}
        window = {}
        for entry in self.entries.values():
            device, row = self._where[entry.key]
            window[entry.key] = {"totals": host[device][row].clone(),
                                 "predicted": (float(self.predicted[entry.row]), int(self.predicted_n[entry.row]))}
        shadows = {key: s.part(i).cpu().clone() for key, (s, i) in self._shadow_of.items()}
        return {"cursor": self.cursor, "totals": window, "shadows": shadows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a checkpoint's histories; each slot's part is applied when the slot appears."""
        self.cursor = int(state["cursor"])
        self._restored = {"totals": dict(state["totals"]), "shadows": dict(state["shadows"])}
        self._n_state = -1
        self.entries, self.units, self.totals, self._where = {}, [], {}, {}


def _segment_sums(masks: Tensor, last: Tensor) -> Tensor:
    """Per-segment column sums of the (n, k) bool ``masks`` whose segments end at rows ``last`` (int64, n_seg x k)."""
    dtype = torch.int32 if masks.shape[0] < 2**31 else torch.int64
    cumulative = torch.cumsum(masks, dim=0, dtype=dtype).index_select(0, last)
    return torch.diff(cumulative, dim=0, prepend=torch.zeros_like(cumulative[:1]))


def _unpack(packed: Tensor) -> Tensor:
    """Two 4-bit codes per byte, high nibble first, as one code per element."""
    return torch.stack([packed >> 4, packed & 0b1111], dim=1).reshape(-1)
