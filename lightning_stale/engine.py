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
- The parameters are split into *cohorts*. A measured step measures one cohort, in turn (``track="sample"``:
  ``params_per_step`` parameters each, more when ``coverage_steps`` asks for it; ``track="exact"``: one cohort of
  every element of every slot). A cohort's parameters that share a layout form a *batch*: its codes are read with one
  ``torch.cat`` before and after the step, compared in a few elementwise ops against one shared gradient read, summed
  per slot (one reshaped sum when the samples are equal, else one scan; slot by slot for large exact-mode slots) and
  added to a device-resident totals matrix with one ``index_add_``. Per-parameter Python work is limited to building
  the gradient views of the cohort.
- A drift shadow must see every gradient, so shadows are kept for a fixed *panel* of at most ``DRIFT_PARAMS``
  parameters (all of them in exact mode), chosen by a hash of their keys, on the first ``DRIFT_SAMPLE`` elements of
  their sample.

Host synchronisation happens only when batch plans are built (the first measurement of each cohort after the
optimizer state changes: zero codes of 8-bit maps are looked up once) and in the readouts (:meth:`StallEngine.window`,
:meth:`StallEngine.take_recent`, :meth:`StallEngine.drift`); never in the step hooks otherwise.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_stale._compat import local_tensor
from lightning_stale.adapters.base import OptimizerAdapter, Slot
from lightning_stale.formats.base import unpack_nibbles
from lightning_stale.sampling import Sample, choose_sample

STALLED, COUNTED, UNDERFLOW, MEASURED = range(4)  # columns of the window's per-slot totals (MEASURED: on the host)
N_STATS = 4
_PRED_SUM, _PRED_N = 1, 2  # columns of the host per-slot array after MEASURED (0)
DRIFT_PARAMS = 4  # parameters with a drift shadow in sample mode
DRIFT_SAMPLE = 128  # shadowed elements per slot
EXACT_BATCH = 1 << 22  # elements compared in one batch in exact mode (bounds the transient memory)
PER_SLOT_COUNTS = 1 << 13  # mean sampled elements per parameter from which a batch counts slot by slot


@dataclass(eq=False)
class Unit:
    """A parameter with optimizer state: its slots share one sample and are reset together."""

    key: str
    index: int  # position of the parameter in the optimizer's param groups
    position: int  # position in the engine's unit list (and in the reset schedule's arrays)
    param: Tensor
    sample: Sample
    numel: int  # elements of this process's shard (all of the parameter unless it is a DTensor)
    entries: list[Entry] = field(default_factory=list)

    def grad_view(self, sample: Sample, placeholders: dict) -> Tensor:
        """The gradient at ``sample`` (a view of this process's shard), or NaN (never counted) when the step had no
        dense gradient."""
        grad = local_tensor(self.param.grad)
        if grad is None or grad.is_sparse or grad.numel() != self.numel:
            key = (sample, self.param.device)
            if key not in placeholders:
                shape = sample.view(torch.empty(self.numel, device="meta")).shape
                placeholders[key] = torch.full(shape, math.nan, device=self.param.device)
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
    """Parameters of one cohort whose ``k`` slots have the same layout (device, packing per slot, sample shape):
    their sampled codes are concatenated slot by slot, ``(k, elements)``, and compared against one concatenated
    gradient sample, ``(elements,)``, that every slot row shares."""

    units: list[Unit]
    k: int
    packed: tuple[bool, ...]  # per slot row: two 4-bit codes per byte (QuantizedAdamW's moments may differ)
    code_views: list[Tensor]  # k * len(units) strided views of the state, slot-major: valid while tensors are kept
    lengths: list[int]  # sampled elements per unit
    last: Tensor  # index of each unit's last element in the concatenation
    rows: Tensor  # (k * units,) row of each slot in this device's totals matrix, slot-major
    weights: Tensor  # (k * units, 3): elements per sampled element; 0 for underflow where none is possible
    zero_codes: Tensor | None  # (k, 1): each row's zero code, only when some zero code is not 0
    underflow_rows: list[bool]  # per slot row: a second moment whose grid has a zero (underflow is counted)
    per_slot_counts: bool  # large segments: one count_nonzero per slot is faster than a cumulative sum
    global_rows: np.ndarray  # (k * units,) rows in the engine's row order (host)
    positions: np.ndarray  # (k * units,) unit positions (host)
    is_v: np.ndarray  # (k * units,) second moments (host)
    uniform: bool = field(init=False)  # every row packed alike: the raw views concatenate as they are

    def __post_init__(self) -> None:
        self.uniform = len(set(self.packed)) == 1

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def entries(self) -> list[Entry]:
        return [u.entries[i] for i in range(self.k) for u in self.units]

    def snapshot(self) -> Tensor:
        """The sampled codes as stored now, concatenated: the views as they are when every row has the same packing
        (one kernel), else each view as one code per element (packed and unpacked rows have different widths)."""
        if self.uniform:
            return torch.cat(self.code_views)
        n = len(self.units)
        return torch.cat([_flat_codes(view, self.packed[j // n]) for j, view in enumerate(self.code_views)])

    def codes(self, snapshot: Tensor) -> Tensor:
        """A :meth:`snapshot` as ``(k, elements)``, one code per element."""
        return (_flat_codes(snapshot, self.packed[0]) if self.uniform else snapshot).view(self.k, -1)


@dataclass(eq=False)
class Shadow:
    """fp32 shadow EMAs of panel parameters whose slots share a layout (device, sample shape, moments and betas):
    one row per slot, one gradient concatenation per step for all of them."""

    units: list[Unit]
    samples: list[Sample]  # the shadowed prefix of each unit's sample
    squared: list[bool]  # per row: the EMA averages g**2 (a second moment) rather than g
    weight: Tensor  # (rows, 1): 1 - beta
    values: Tensor  # (rows, elements)
    starts: list[int]  # each unit's first element

    def part(self, row: int, unit: int) -> Tensor:
        start = self.starts[unit]
        return self.values[row, start:start + self.samples[unit].numel]


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
        self.keep_recent = False  # also sum (stalled, counted, underflow) per slot for decisions (take_recent)
        self.totals: dict[torch.device, Tensor] = {}  # per device: (its rows, 3) weighted stalled/counted/underflow
        self.recent: dict[torch.device, Tensor] = {}  # per device: (its rows, 3) int32, when keep_recent
        self.host = np.zeros((0, 3))  # per row: measured steps, sum and count of the theory's predictions
        self.cohorts: list[list[Unit]] = []
        self._batches: dict[int, list[Batch]] = {}
        self._shadows: list[Shadow] = []
        self._shadow_of: dict[str, tuple[Shadow, int, int]] = {}  # slot key -> (shadow, row, unit index)
        self._restored: dict[str, Any] = {}
        self.measured_cohort: list[Unit] = []  # the parameters of the last measured step, empty shards included
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
        old_entries = self.entries
        old_shadows = {k: s.part(row, i).clone() for k, (s, row, i) in self._shadow_of.items()}
        units: dict[int, Unit] = {}
        entries: dict[str, Entry] = {}
        slots = sorted(self.adapter.slots(), key=lambda s: position[id(s.param)])
        pairs = {id(s.param) for s in slots if s.packed}
        for slot in slots:
            index = position[id(slot.param)]
            if id(slot.param) not in units:
                key = f"{self.prefix}.{index}"
                size = None if self.exact else self.sample_size
                shard = local_tensor(slot.param)
                sample = choose_sample(key, shard.shape, size, self.seed, pairs=id(slot.param) in pairs)
                units[id(slot.param)] = Unit(key, index, len(units), slot.param, sample, shard.numel())
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

    def _rebuild_totals(self, old: dict[str, Entry], new: dict[str, Entry]) -> None:
        """New totals rows for the new slot set, carrying each kept slot's history (and restored checkpoint rows)."""
        rows: dict[torch.device, list[Entry]] = {}
        for entry in new.values():
            rows.setdefault(entry.slot.param.device, []).append(entry)
        totals = {d: torch.zeros(len(g), 3, dtype=torch.float64, device=d) for d, g in rows.items()}
        host = np.zeros((len(new), 3))
        restored = self._restored.get("totals", {})
        for device, group in rows.items():
            for local, entry in enumerate(group):
                previous = old.get(entry.key)
                if previous is not None and previous.key in self._where:
                    where_device, where_row = self._where[previous.key]
                    totals[device][local] = self.totals[where_device][where_row]
                    host[entry.row] = self.host[previous.row]
                elif entry.key in restored:
                    saved = restored.pop(entry.key)
                    totals[device][local] = saved["totals"].to(totals[device])
                    host[entry.row] = saved["host"]
        self.totals, self.host = totals, host
        self.recent = {d: torch.zeros(len(g), 3, dtype=torch.int32, device=d) for d, g in rows.items()} \
            if self.keep_recent else {}
        self._where = {e.key: (d, local) for d, g in rows.items() for local, e in enumerate(g)}
        self._device_rows = {d: [e.row for e in g] for d, g in rows.items()}

    def _build_cohorts(self) -> None:
        # Every unit, empty shards included: the cohort schedule must be the same on every rank.
        units = self.units
        size = len(units) if self.exact else max(self.params_per_step, -(-len(units) // self.coverage_steps))
        self.cohorts = [units[i:i + size] for i in range(0, len(units), max(1, size))]
        self._batches = {}
        self._prev = None

    def _plan(self, cohort: int) -> list[Batch]:
        """The batches of one cohort (built on first use, then reused until the slots change)."""
        if cohort not in self._batches:
            groups: dict[tuple, list[list[Unit]]] = {}
            for unit in self.cohorts[cohort]:
                if unit.sample.count == 0:  # an empty (shard of a) parameter: nothing to read
                    continue
                # Code dtypes may differ (torch.cat promotes them exactly: uint8 and int16 codes widen to int32).
                # Parameters with the common sample size form their own batch: equal segments sum without a scan.
                layout = (unit.param.device, unit.sample.full, unit.sample.numel == self.sample_size,
                          tuple(e.slot.packed for e in unit.entries))
                split = groups.setdefault(layout, [[]])
                if split[-1] and sum(u.sample.numel for u in split[-1]) >= EXACT_BATCH:
                    split.append([])
                split[-1].append(unit)
            self._batches[cohort] = [self._batch(units) for split in groups.values() for units in split]
        return self._batches[cohort]

    def _batch(self, units: list[Unit]) -> Batch:
        device, k = units[0].param.device, len(units[0].entries)
        lengths = [u.sample.numel for u in units]
        entries = [u.entries[i] for i in range(k) for u in units]
        zeros = [e.slot.zero_code() if e.moment == "v" else None for e in units[0].entries]  # one layout per row
        weights = [[w, w, w if zeros[i // len(units)] is not None else 0.0]
                   for i, w in enumerate(e.unit.numel / e.unit.sample.numel for e in entries)]
        zero_codes = None
        if any(zeros):
            zero_codes = torch.tensor([[z or 0] for z in zeros], device=device)
        return Batch(
            units, k, tuple(e.slot.packed for e in units[0].entries),
            [e.slot.sampled_codes(e.unit.sample) for e in entries], lengths,
            torch.tensor(np.cumsum(lengths) - 1, dtype=torch.int64, device=device),
            torch.tensor([self._where[e.key][1] for e in entries], dtype=torch.int64, device=device),
            torch.tensor(weights, dtype=torch.float64, device=device), zero_codes, [z is not None for z in zeros],
            sum(lengths) / len(lengths) >= PER_SLOT_COUNTS,
            np.array([e.row for e in entries], dtype=np.int64),
            np.array([e.unit.position for e in entries], dtype=np.int64),
            np.array([e.moment == "v" for e in entries], dtype=bool))

    def _build_shadows(self, old: dict[str, Tensor], old_entries: dict[str, Entry], fresh_state: bool) -> None:
        candidates = [u for u in self.units if u.sample.count > 0 and any(e.slot.beta is not None for e in u.entries)]
        if not self.exact:  # a hashed choice, one parameter of every driver format first (drift is read per format)
            candidates.sort(key=lambda u: zlib.crc32(u.key.encode()))
            firsts = list({driver_group(u): u for u in reversed(candidates)}.values())
            candidates = (firsts + [u for u in candidates if u not in firsts])[:max(DRIFT_PARAMS, len(firsts))]
            candidates.sort(key=lambda u: u.index)
        groups: dict[tuple, list[Unit]] = {}
        for unit in candidates:
            layout = tuple((e.moment, e.slot.beta) for e in unit.entries if e.slot.beta is not None)
            groups.setdefault((unit.param.device, unit.sample.full, layout), []).append(unit)
        restored = self._restored.get("shadows", {})
        self._shadows, self._shadow_of = [], {}
        for (device, _, layout), units in groups.items():
            samples = [u.sample.prefix(DRIFT_SAMPLE) for u in units]
            lengths = [s.numel for s in samples]
            shadow = Shadow(units, samples, [m == "v" for m, _ in layout],
                            torch.tensor([[1.0 - b] for _, b in layout], device=device),
                            torch.zeros(len(layout), sum(lengths), device=device),
                            [int(x) for x in np.cumsum([0] + lengths[:-1])])
            self._shadows.append(shadow)
            for i, unit in enumerate(units):
                for row, entry in enumerate(e for e in unit.entries if e.slot.beta is not None):
                    self._shadow_of[entry.key] = (shadow, row, i)
                    if entry.key in old:
                        shadow.part(row, i).copy_(old[entry.key])
                    elif entry.key in restored:
                        shadow.part(row, i).copy_(restored.pop(entry.key))
                    elif not (fresh_state and entry.key not in old_entries):
                        self.resync(entry)

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
        measured on this step (``measured_cohort`` holds its parameters, empty shards included)."""
        self.measured_cohort = []
        if self.refresh(fresh_state=True):
            self._prev = None  # slots appeared during the step: this step has nothing to compare against
        self._update_shadows()
        if self._prev is None:
            return []
        measured = self._plan(self._prev_cohort)
        self.measured_cohort = self.cohorts[self._prev_cohort]
        for batch, prev in zip(measured, self._prev):
            self._count(batch, prev)
            self.host[batch.global_rows, 0] += 1
        self._prev = None
        self.cursor += 1
        return measured

    def _count(self, batch: Batch, prev: Tensor) -> None:
        if batch.per_slot_counts:
            self._count_large(batch, prev)
            return
        new, prev = batch.codes(batch.snapshot()), batch.codes(prev)
        grad = torch.cat([u.grad_view(u.sample, self._placeholders) for u in batch.units]).reshape(-1)
        magnitude = grad.abs()
        counted = (magnitude > 0).logical_and_(magnitude < math.inf)  # NaN compares false: not counted
        stalled = (new == prev).logical_and_(counted)
        # zero codes on every row; the weights drop the rows that cannot underflow (first moments, zero-free grids)
        zero = (new == (0 if batch.zero_codes is None else batch.zero_codes)).logical_and_(counted)
        sums = self._segments(torch.stack([stalled, counted.expand_as(stalled), zero], dim=-2), batch)
        sums = sums.permute(0, 2, 1).reshape(-1, 3)  # (k * units, stalled/counted/underflow), slot-major like rows
        self.totals[batch.device].index_add_(0, batch.rows, sums.double().mul_(batch.weights))
        if self.keep_recent:  # unweighted, with the same rows dropped from the underflow column
            self.recent[batch.device].index_add_(0, batch.rows, sums * (batch.weights > 0))

    def _count_large(self, batch: Batch, prev: Tensor) -> None:
        """:meth:`_count` for large segments (exact mode on big tensors): each slot is compared in place with its part
        of the snapshot and counted directly, without concatenating the new codes or the gradients."""
        n = len(batch.units)
        prev_parts = batch.codes(prev).split(batch.lengths, dim=1)  # per parameter
        masks, n_counted = [], []
        for unit in batch.units:
            magnitude = unit.grad_view(unit.sample, self._placeholders).reshape(-1).abs()
            masks.append((magnitude > 0).logical_and_(magnitude < math.inf))
            n_counted.append(torch.count_nonzero(masks[-1]))
        none = n_counted[0].new_zeros(())
        counts = []
        for i in range(batch.k):
            zero = None if batch.zero_codes is None else batch.zero_codes[i]
            for j, mask in enumerate(masks):
                new = _flat_codes(batch.code_views[i * n + j], batch.packed[i])
                stalled = torch.count_nonzero((new == prev_parts[j][i]).logical_and_(mask))
                underflow = torch.count_nonzero((new == (0 if zero is None else zero)).logical_and_(mask)) \
                    if batch.underflow_rows[i] else none
                counts.append(torch.stack([stalled, n_counted[j], underflow]))
        sums = torch.stack(counts).int()  # slot-major, like batch.rows
        self.totals[batch.device].index_add_(0, batch.rows, sums.double().mul_(batch.weights))
        if self.keep_recent:  # unweighted, with the same rows dropped from the underflow column
            self.recent[batch.device].index_add_(0, batch.rows, sums * (batch.weights > 0))

    @staticmethod
    def _segments(mask: Tensor, batch: Batch) -> Tensor:
        """Per-parameter true counts of a (..., elements) bool mask: (..., parameters) int32, with one reshaped sum
        (all segments equal) or one cumulative sum."""
        if len(set(batch.lengths)) == 1:  # equal segments: a reshaped sum
            return mask.view(torch.uint8).unflatten(-1, (len(batch.lengths), -1)).sum(-1, dtype=torch.int32)
        cumulative = torch.cumsum(mask, dim=-1, dtype=torch.int32).index_select(-1, batch.last)
        return torch.diff(cumulative, dim=-1, prepend=torch.zeros_like(cumulative[..., :1]))

    def _update_shadows(self) -> None:
        for shadow in self._shadows:
            grad = torch.cat([u.grad_view(sample, self._placeholders) for u, sample in zip(shadow.units, shadow.samples)])
            grad = grad.reshape(-1).float()
            signal = torch.stack([grad * grad if squared else grad for squared in shadow.squared])
            signal = torch.where(grad.abs() < math.inf, signal, shadow.values)  # NaN/Inf: the EMA stays put
            shadow.values.lerp_(signal, shadow.weight)

    def _shadow_positions(self, entry: Entry) -> Tensor:
        shadow, _, i = self._shadow_of[entry.key]
        return shadow.samples[i].positions(entry.slot.param.device)

    def resync(self, entry: Entry) -> None:
        """Restart a slot's shadow from its stored value (exactly zero right after a full reset)."""
        if entry.key in self._shadow_of:
            shadow, row, i = self._shadow_of[entry.key]
            shadow.part(row, i).copy_(entry.slot.value_at(self._shadow_positions(entry)).float())

    def add_predictions(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Add the theory's predicted stall of this step to the slots at ``rows`` (host arrays, no device work)."""
        np.add.at(self.host[:, _PRED_SUM], rows, values)
        np.add.at(self.host[:, _PRED_N], rows, 1)

    # -- readouts ----------------------------------------------------------------------------------------------------
    def take_recent(self) -> np.ndarray:
        """Sampled (stalled, counted, underflow) counts of every slot since the previous call, (rows, 3) in row order
        on the host, unweighted; the call starts over (one host synchronisation; needs ``keep_recent``)."""
        out = np.zeros((len(self.entries), 3), dtype=np.int64)
        for device, recent in self.recent.items():
            out[self._device_rows[device]] = recent.cpu().numpy()
            recent.zero_()
        return out

    def window(self) -> dict[str, Tensor]:
        """Per-slot totals since the previous call, on the host (the call starts a new window): ``totals`` (rows,
        N_STATS) float64 in row order, and ``predicted`` (sum, count) per row."""
        totals = torch.zeros(len(self.entries), N_STATS, dtype=torch.float64)
        for device, local in self.totals.items():
            totals[self._device_rows[device], :MEASURED] = local.cpu()
            local.zero_()
        totals[:, MEASURED] = torch.from_numpy(self.host[:, 0])
        predicted = torch.from_numpy(self.host[:, 1:].copy())
        self.host[:] = 0.0
        return {"totals": totals, "predicted": predicted}

    def drift(self) -> dict[str, float]:
        """Drift of each shadowed slot (median stored/shadow for v, relative L2 error for m), by slot key."""
        out = {}
        for key, (shadow, row, i) in self._shadow_of.items():
            entry = self.entries[key]
            stored, reference = entry.slot.value_at(self._shadow_positions(entry)).float(), shadow.part(row, i)
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
        shadow, _, i = self._shadow_of[key]
        return shadow.samples[i].numel

    def resident_bytes(self) -> int:
        """Bytes the engine keeps between steps: totals, shadows, batch plans (device) and prediction sums (host)."""
        tensors = [*self.totals.values(), *self.recent.values(), *(t for s in self._shadows for t in (s.values, s.weight))]
        for batches in self._batches.values():
            for batch in batches:
                tensors += [batch.last, batch.rows, batch.weights]
                if batch.zero_codes is not None:
                    tensors.append(batch.zero_codes)
        return sum(t.numel() * t.element_size() for t in tensors) + self.host.nbytes

    # -- checkpointing -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        host = {device: totals.cpu() for device, totals in self.totals.items()}
        window = {}
        for entry in self.entries.values():
            device, row = self._where[entry.key]
            window[entry.key] = {"totals": host[device][row].clone(), "host": self.host[entry.row].tolist()}
        shadows = {key: s.part(row, i).cpu().clone() for key, (s, row, i) in self._shadow_of.items()}
        return {"cursor": self.cursor, "totals": window, "shadows": shadows}

    def load_state_dict(self, state: dict[str, Any], counts: bool = True, shadows: bool = True) -> None:
        """Adopt a checkpoint's histories; each slot's part is applied when the slot appears.

        The cohort cursor is shared by every process; the unlogged ``counts`` and the drift ``shadows`` describe the
        saving process's own samples and shards, so the monitor leaves them out where they are not this process's."""
        self.cursor = int(state["cursor"])
        self._restored = {"totals": dict(state["totals"]) if counts else {},
                          "shadows": dict(state["shadows"]) if shadows else {}}
        self._n_state = -1
        self.entries, self.units, self.totals, self._where = {}, [], {}, {}


def driver_group(unit: Unit) -> tuple[str, str, float | None]:
    """(moment, format, beta) of the slot that drives a parameter's decisions (v when present): parameters of one
    group share a drift reading, measured on the panel parameters of that group."""
    slots = {e.moment: e.slot for e in unit.entries}
    slot = slots.get("v") or slots["m"]
    return slot.moment, slot.format, slot.beta


def _flat_codes(codes: Tensor, packed: bool) -> Tensor:
    """Concatenated sampled codes as one code per element (two 4-bit codes per byte, high nibble first)."""
    return unpack_nibbles(codes) if packed else codes.reshape(-1)
