"""Stall and underflow counts of the sampled codes of one cohort, in a few batched tensor ops per layout.

A cohort's parameters that share a layout form a :class:`Batch`: their sampled codes are read with one ``torch.cat``
before and after the step, compared against one shared gradient read, summed per slot (one reshaped sum when the
samples are equal, else one scan; slot by slot for large exact-mode slots) and added to a device-resident totals
matrix with one ``index_add_``. :class:`Counts` owns those matrices and reads them back (the only host reads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_stale.formats.base import unpack_nibbles
from lightning_stale.measure.rows import KeyedRows
from lightning_stale.measure.units import Entry, TrackedParam
from lightning_stale.transfers import to_devices

STALLED, COUNTED, UNDERFLOW, MEASURED = range(4)  # columns of a window's per-slot totals (MEASURED: on the host)
N_STATS = 4
RECENT_COLUMNS = 4  # the recent sums: stalled, counted, underflow, and whether the slot was measured (per step)
EXACT_BATCH = 1 << 22  # elements compared in one batch in exact mode (bounds the transient memory)
PER_SLOT_COUNTS = 1 << 13  # mean sampled elements per parameter from which a batch counts slot by slot


@dataclass(eq=False)
class Batch:
    """Parameters of one cohort whose ``k`` slots have the same layout (device, packing per slot, sample shape):
    their sampled codes are concatenated slot by slot, ``(k, elements)``, and compared against one concatenated
    gradient sample, ``(elements,)``, that every slot row shares."""

    units: list[TrackedParam]
    k: int
    packed: tuple[bool, ...]  # per slot row: two 4-bit codes per byte (QuantizedAdamW's moments may differ)
    code_views: list[Tensor | None]  # k * len(units) strided views of the state, slot-major: valid while tensors are
    # kept; None for a gathered slot (read at every snapshot)
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
    gathered: bool  # some slot's sampled codes are a copy (Slot.gathered), read at every snapshot
    uniform: bool = field(init=False)  # every row packed alike: the raw views concatenate as they are

    def __post_init__(self) -> None:
        self.uniform = len(set(self.packed)) == 1

    @property
    def device(self) -> torch.device:
        return self.units[0].param.device

    @property
    def entries(self) -> list[Entry]:
        return [u.entries[i] for i in range(self.k) for u in self.units]

    def tensors(self) -> list[Tensor]:
        """The tensors the batch keeps between steps (its views of the state excluded)."""
        return [self.last, self.rows, self.weights, *([] if self.zero_codes is None else [self.zero_codes])]

    @property
    def host_bytes(self) -> int:
        """Bytes of the batch's host arrays."""
        return self.global_rows.nbytes + self.positions.nbytes + self.is_v.nbytes

    def views(self) -> list[Tensor]:
        """The sampled codes of every slot row as stored now: the kept views, and the gathered slots' read afresh."""
        if not self.gathered:
            return self.code_views
        entries = self.entries
        return [entries[j].slot.sampled_codes(entries[j].unit.sample) if view is None else view
                for j, view in enumerate(self.code_views)]

    def snapshot(self) -> Tensor:
        """The sampled codes as stored now, concatenated: the views as they are when every row has the same packing
        (one kernel), else each view as one code per element (packed and unpacked rows have different widths)."""
        if self.uniform:
            return torch.cat(self.views())
        n = len(self.units)
        return torch.cat([flat_codes(view, self.packed[j // n]) for j, view in enumerate(self.views())])

    def codes(self, snapshot: Tensor) -> Tensor:
        """A :meth:`snapshot` as ``(k, elements)``, one code per element."""
        return (flat_codes(snapshot, self.packed[0]) if self.uniform else snapshot).view(self.k, -1)


def plan_batches(units: list[TrackedParam], sample_size: int, local_row: dict[str, int]) -> list[Batch]:
    """The batches of one cohort: its parameters grouped by layout (``local_row``: each slot's row in its device's
    totals matrix), their tables on the host until :func:`place_batches` moves them."""
    groups: dict[tuple, list[list[TrackedParam]]] = {}
    for unit in units:
        if unit.sample.count == 0:  # an empty (shard of a) parameter: nothing to read
            continue
        # Code dtypes may differ (torch.cat promotes them exactly: uint8 and int16 codes widen to int32).
        # Parameters with the common sample size form their own batch: equal segments sum without a scan.
        layout = (unit.param.device, unit.sample.full, unit.sample.numel == sample_size,
                  tuple(e.slot.packed for e in unit.entries))
        split = groups.setdefault(layout, [[]])
        if split[-1] and sum(u.sample.numel for u in split[-1]) >= EXACT_BATCH:
            split.append([])
        split[-1].append(unit)
    return [_batch(units, local_row) for split in groups.values() for units in split]


def place_batches(batches: list[Batch]) -> None:
    """Move the tables of ``batches`` to their devices, all of a device's in one copy (:func:`to_devices`)."""
    names = ("last", "rows", "weights", "zero_codes")
    tables = [getattr(batch, name) for batch in batches for name in names]
    placed = iter(to_devices(tables, [batch.device for batch in batches for _ in names]))
    for batch in batches:
        for name in names:
            setattr(batch, name, next(placed))


def _batch(units: list[TrackedParam], local_row: dict[str, int]) -> Batch:
    k = len(units[0].entries)
    lengths = [u.sample.numel for u in units]
    entries = [u.entries[i] for i in range(k) for u in units]
    zeros = [e.slot.zero_code() if e.moment == "v" else None for e in units[0].entries]  # one layout per row
    weights = [[w, w, w if zeros[i // len(units)] is not None else 0.0]
               for i, w in enumerate(e.unit.numel / e.unit.sample.numel for e in entries)]
    zero_codes = None
    if any(zeros):
        zero_codes = torch.tensor([[z or 0] for z in zeros])
    return Batch(
        units, k, tuple(e.slot.packed for e in units[0].entries),
        [None if e.slot.gathered else e.slot.sampled_codes(e.unit.sample) for e in entries], lengths,
        torch.tensor(np.cumsum(lengths) - 1, dtype=torch.int64),
        torch.tensor([local_row[e.key] for e in entries], dtype=torch.int64),
        torch.tensor(weights, dtype=torch.float64), zero_codes, [z is not None for z in zeros],
        sum(lengths) / len(lengths) >= PER_SLOT_COUNTS,
        np.array([e.row for e in entries], dtype=np.int64),
        np.array([e.unit.position for e in entries], dtype=np.int64),
        np.array([e.moment == "v" for e in entries], dtype=bool), any(e.slot.gathered for e in entries))


class Counts:
    """Per-slot sums of one optimizer: weighted (stalled, counted, underflow) on each slot's device since the last
    window, measured steps per slot on the host, and, for the readers that decide from fresh counts (the check steps'
    signals, a policy that observes every measured step), unweighted sums since their last read, on the device.

    Args:
        recent: keep the unweighted sums since the last :meth:`take_recent`.
        per_step: keep them measured step by measured step (a policy that observes each one), read at the same time.
    """

    def __init__(self, recent: bool = False, per_step: bool = False) -> None:
        self.keep_recent, self.per_step = recent or per_step, per_step
        self.totals: dict[torch.device, Tensor] = {}  # per device: (its rows, 3) weighted stalled/counted/underflow
        # per device: (step slots, its rows, RECENT_COLUMNS) int32 unweighted sums, when kept: one slot that every
        # measured step adds into, or one per measured step with ``per_step``
        self.recent: dict[torch.device, Tensor] = {}
        self.steps = 0  # measured steps held in ``recent`` since the last take_recent (``per_step``)
        self.measured = np.zeros(0)  # per row: measured steps in the window
        self.local_row: dict[str, int] = {}  # slot key -> row in its device's totals
        self.rows: KeyedRows[dict[str, Any]] = KeyedRows()  # slot key -> row; the sums of slots not held now
        self._where: dict[str, torch.device] = {}  # slot key -> its device
        self._device_rows: dict[torch.device, list[int]] = {}  # per device: the global row of each local row

    def rebuild(self, entries: dict[str, Entry]) -> None:
        """New rows for the slots ``entries`` (in row order), carrying each kept slot's sums (its recent ones too, on
        the device); a slot that went away keeps its window's sums for when it comes back (as do a loaded
        checkpoint's slots until they appear, with their measured steps not taken yet)."""
        groups: dict[torch.device, list[Entry]] = {}
        for entry in entries.values():
            groups.setdefault(entry.slot.param.device, []).append(entry)
        totals = {d: torch.zeros(len(g), 3, dtype=torch.float64, device=d) for d, g in groups.items()}
        measured = np.zeros(len(entries))
        moves = self.rows.rebuild(entries, self._saved)
        steps = max([self.steps] + [len(saved.get("recent", ())) for saved in moves.returned.values()]) \
            if self.per_step else 0
        slots = max(1, 2 * steps) if self.per_step else 1
        recent = {d: torch.zeros(slots, len(g), RECENT_COLUMNS, dtype=torch.int32, device=d)
                  for d, g in groups.items()} if self.keep_recent else {}
        for device, group in groups.items():
            for local, entry in enumerate(group):
                if entry.key in moves.kept:
                    where, old = self._where[entry.key], self.local_row[entry.key]
                    totals[device][local] = self.totals[where][old]
                    measured[entry.row] = self.measured[moves.kept[entry.key]]
                    if self.keep_recent:
                        kept = self.recent[where][:slots, old]
                        recent[device][:len(kept), local] = kept
                elif entry.key in moves.returned:
                    saved = moves.returned[entry.key]
                    totals[device][local] = saved["totals"].to(totals[device])
                    measured[entry.row] = saved["measured"]
                    if self.keep_recent and saved.get("recent"):
                        pending = torch.tensor(saved["recent"], dtype=torch.int32).to(device)
                        if self.per_step:
                            recent[device][:len(pending), local] = pending
                        else:  # one slot that every measured step adds into
                            recent[device][0, local, :3] += pending[:, :3].sum(0)
        self.totals, self.measured, self.recent, self.steps = totals, measured, recent, steps
        self._where = {e.key: d for d, g in groups.items() for e in g}
        self.local_row = {e.key: local for g in groups.values() for local, e in enumerate(g)}
        self._device_rows = {d: [e.row for e in g] for d, g in groups.items()}

    def _saved(self, key: str, row: int) -> dict[str, Any]:
        """The window's sums of a slot that went away, on the host (what the stash keeps until it comes back)."""
        return {"totals": self.totals[self._where[key]][self.local_row[key]].cpu(),
                "measured": float(self.measured[row])}

    def count(self, batch: Batch, prev: Tensor, placeholders: dict) -> None:
        """Add the stalls and underflows of one measured batch (``prev``: its snapshot before the step)."""
        if batch.per_slot_counts:
            self._count_large(batch, prev, placeholders)
        else:
            new, prev = batch.codes(batch.snapshot()), batch.codes(prev)
            grad = torch.cat([u.grad_view(u.sample, placeholders) for u in batch.units]).reshape(-1)
            magnitude = grad.abs()
            counted = (magnitude > 0).logical_and_(magnitude < math.inf)  # NaN compares false: not counted
            stalled = (new == prev).logical_and_(counted)
            # zero codes on every row; the weights drop the rows that cannot underflow (first moments, zero-free grids)
            zero = (new == (0 if batch.zero_codes is None else batch.zero_codes)).logical_and_(counted)
            sums = _segments(torch.stack([stalled, counted.expand_as(stalled), zero], dim=-2), batch)
            self._add(batch, sums.permute(0, 2, 1).reshape(-1, 3))  # (k * units, 3), slot-major like the rows
        self.measured[batch.global_rows] += 1

    def _count_large(self, batch: Batch, prev: Tensor, placeholders: dict) -> None:
        """:meth:`count` for large segments (exact mode on big tensors): each slot is compared in place with its part
        of the snapshot and counted directly, without concatenating the new codes or the gradients."""
        n = len(batch.units)
        prev_parts = batch.codes(prev).split(batch.lengths, dim=1)  # per parameter
        masks, n_counted = [], []
        for unit in batch.units:
            magnitude = unit.grad_view(unit.sample, placeholders).reshape(-1).abs()
            masks.append((magnitude > 0).logical_and_(magnitude < math.inf))
            n_counted.append(torch.count_nonzero(masks[-1]))
        none = n_counted[0].new_zeros(())
        views = batch.views()
        counts = []
        for i in range(batch.k):
            zero = None if batch.zero_codes is None else batch.zero_codes[i]
            for j, mask in enumerate(masks):
                new = flat_codes(views[i * n + j], batch.packed[i])
                stalled = torch.count_nonzero((new == prev_parts[j][i]).logical_and_(mask))
                underflow = torch.count_nonzero((new == (0 if zero is None else zero)).logical_and_(mask)) \
                    if batch.underflow_rows[i] else none
                counts.append(torch.stack([stalled, n_counted[j], underflow]))
        self._add(batch, torch.stack(counts).int())  # slot-major, like batch.rows

    def _add(self, batch: Batch, sums: Tensor) -> None:
        self.totals[batch.device].index_add_(0, batch.rows, sums.double().mul_(batch.weights))
        if self.keep_recent:  # unweighted, with the same rows dropped from the underflow column
            unweighted = sums * (batch.weights > 0)
            if self.per_step:  # and which rows this step measured
                unweighted = torch.cat([unweighted, torch.ones_like(unweighted[:, :1])], dim=1)
            recent = self.recent[batch.device][self.steps if self.per_step else 0]
            (recent if self.per_step else recent[:, :3]).index_add_(0, batch.rows, unweighted)

    def end_step(self) -> None:
        """Close a measured step whose batches were counted: with ``per_step``, the next one's counts go into a slot
        of their own (the slots double on the device when they are full)."""
        if not self.per_step:
            return
        self.steps += 1
        for device, recent in self.recent.items():
            if self.steps == len(recent):
                self.recent[device] = torch.cat([recent, torch.zeros_like(recent)])

    def window(self) -> Tensor:
        """Per-slot totals since the last :meth:`reset_window`, (rows, N_STATS) float64 on the host in row order (one
        host read per device; the sums are left as they are)."""
        totals = torch.zeros(len(self.measured), N_STATS, dtype=torch.float64)
        for device, local in self.totals.items():
            totals[self._device_rows[device], :MEASURED] = local.cpu()
        totals[:, MEASURED] = torch.from_numpy(self.measured)
        return totals

    def reset_window(self) -> None:
        """Start a new window: zero the per-slot totals (the stash of slots not held now keeps its sums)."""
        for local in self.totals.values():
            local.zero_()
        self.measured[:] = 0.0

    def take_recent(self) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """The unweighted (stalled, counted, underflow) sums of every slot since the last call, (rows, 3) on the host
        in row order, and, with ``per_step``, each measured step's, in order: (the rows it measured, their (rows, 3)
        sums). One host read per device, none where ``per_step`` saw no measured step since; the sums restart."""
        slots = self.steps if self.per_step else 1
        fresh = np.zeros((slots, len(self.measured), RECENT_COLUMNS), dtype=np.int64)
        if slots:
            for device, recent in self.recent.items():
                fresh[:, self._device_rows[device]] = recent[:slots].cpu().numpy()
                recent.zero_()
        self.steps = 0
        steps = [(np.flatnonzero(step[:, 3]), step[step[:, 3] > 0, :3]) for step in fresh] if self.per_step else []
        return fresh[:, :, :3].sum(axis=0), steps

    def tensors(self) -> list[Tensor]:
        """The device tensors kept between steps."""
        return [*self.totals.values(), *self.recent.values()]

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Every slot's sums by key (one host read per device), with those of slots not held now, and the recent sums
        not taken yet (a resumed run's next check reads what the uninterrupted one's would): with ``per_step`` each
        measured step's, else the one slot's where it holds any."""
        host = {device: totals.cpu() for device, totals in self.totals.items()}
        slots = self.steps if self.per_step else 1
        pending = {device: recent[:slots].cpu() for device, recent in self.recent.items()} if slots else {}
        held = {}
        for row, key in enumerate(self.rows.keys):
            where, local = self._where[key], self.local_row[key]
            held[key] = {"totals": host[where][local].clone(), "measured": float(self.measured[row])}
            if where in pending and (self.per_step or bool(pending[where][:, local].any())):
                held[key]["recent"] = pending[where][:, local].tolist()
        return self.rows.state_dict(held)

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Hold no slot and keep ``state``'s sums, each slot's applied when it appears."""
        self.rows.restart(state)
        self.steps = 0
        self.rebuild({})


def _segments(mask: Tensor, batch: Batch) -> Tensor:
    """Per-parameter true counts of a (..., elements) bool mask: (..., parameters) int32, with one reshaped sum (all
    segments equal) or one cumulative sum."""
    if len(set(batch.lengths)) == 1:  # equal segments: a reshaped sum
        return mask.view(torch.uint8).unflatten(-1, (len(batch.lengths), -1)).sum(-1, dtype=torch.int32)
    cumulative = torch.cumsum(mask, dim=-1, dtype=torch.int32).index_select(-1, batch.last)
    return torch.diff(cumulative, dim=-1, prepend=torch.zeros_like(cumulative[..., :1]))


def flat_codes(codes: Tensor, packed: bool) -> Tensor:
    """Concatenated sampled codes as one code per element (two 4-bit codes per byte, high nibble first)."""
    return unpack_nibbles(codes) if packed else codes.reshape(-1)
