"""The underflow guard: zero the first moment of elements whose stored second moment is exactly zero.

The hazard: when an element's v rounds to zero in storage while its m does not, a later zero (or tiny) gradient gives
the update ``lr * m / eps`` (tests/test_underflow_guard.py reproduces it with torchao's and ``QuantizedAdamW``'s
8-bit states). After each real optimizer step the guard writes the zero code into m wherever v reads as zero and m does
not, so the element holds a fresh state (m = v = 0). Its next update is then 0 for a zero gradient and
``lr * (1 - b1) * g / sqrt((1 - b2) * g**2)`` for any other gradient (bias-corrected, at most about ``3.2 * lr`` at the
default betas): the size of a first Adam step, never ``m / eps``. An m that already reads as zero keeps its bits
(bitsandbytes stores code 0 under a zero block scale, which the zero code would replace): where nothing underflows, the
guard changes no bit, so a reset followed by guarded steps stays what a fresh optimizer holds.

Why reset m rather than clamp the update: a clamp must see the update, i.e. keep a copy of every parameter before
each step (memory as large as the model) or change the optimizer's own arithmetic; zeroing m works on the stored
state alone, in place, for every optimizer whose slots can write a zero code. What it loses is the momentum of
elements so small against their block that their v already reads as zero.

Cost: one pass that reads v's stored bits and rewrites m's. Where both slots describe their storage as bit lanes
(:class:`~lightning_stale.adapters.layouts.ZeroLanes`: every built-in layout, fp8 and packed 4-bit included; a custom
slot through :meth:`Slot.zero_view`), the pass works on 32-bit words, several lanes at a time, with shifts and masks
only (a lane reads as zero where ``(lane ^ zero) & care`` is 0, or where its block's scale is 0). :class:`GuardPlan`
guards large pairs in place, ``PAIRS_PER_CALL`` per call of one ``torch.compile`` kernel, and copies small pairs (and
the partial last block of large ones) of one layout into buffers it keeps, so they take one pass together. Without a
working compiler the same pass runs in eager ops on slices of ``EAGER_WORDS`` words, so its temporaries do not grow
with the tensor. Other slots take a few eager mask operations each (``zero_mask``/``zero_elements``, full-size masks),
as does ``count=True``; both paths write the same bits.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale.adapters.layouts import ZeroLanes
from lightning_stale.adapters.protocol import Slot

FUSED_MIN_NUMEL = 1 << 16  # larger pairs are guarded in place; a smaller group runs eagerly unless its kernel is
# compiled for large pairs anyway (a compile costs seconds)
PAIRS_PER_CALL = 4  # large pairs per compiled call: fewer calls dispatch less; eight made gcc's kernel slower here
SCALED_CHUNK = 256  # elements per buffer row of small states with one scale per tensor (one scale read per row)
EAGER_WORDS = 1 << 18  # 32-bit words per eager slice: its int32 temporaries stay a few MiB whatever the tensor size
_fused_failed = False  # set when torch.compile failed here once; the eager ops are used from then on


@dataclass(frozen=True)
class _Kernel:
    """The constants of one pass: the lane width and how v's and m's lanes read and store zero (see ZeroLanes)."""

    bits: int
    v_zero: int | None
    v_care: int
    m_zero: int
    m_care: int


def _lanes(value: int, bits: int) -> int:
    """``value`` in every ``bits``-wide lane of a 32-bit word, as a signed int32."""
    word = 0
    for shift in range(0, 32, bits):
        word |= (value & ((1 << bits) - 1)) << shift
    return word - (1 << 32) if word >= 1 << 31 else word


def _nonzero_lanes(words: Tensor, bits: int, zero: int, care: int) -> Tensor:
    """Where the lanes of the int32 ``words`` do not read as zero (``(lane ^ zero) & care`` is not 0): bit 0 of each
    lane, the other bits 0; for 32-bit lanes a bool per word."""
    x = words ^ _lanes(zero, bits) if zero else words
    if care != (1 << bits) - 1:
        x = x & _lanes(care, bits)
    if bits == 32:
        return x != 0
    shift = bits // 2
    while shift:  # or each lane's upper half onto its lower half: shifts and masks, so nothing crosses a lane
        x = x | ((x >> shift) & _lanes((1 << shift) - 1, bits))
        shift //= 2
    return x & _lanes(1, bits)


def _nonempty(scale: Tensor, bits: int) -> Tensor:
    """Where a row's scale is not 0, in the form of :func:`_nonzero_lanes` (every lane of the row)."""
    return scale != 0 if bits == 32 else (scale != 0).to(torch.int32) * _lanes(1, bits)


def _guard_pair(kernel: _Kernel, v: Tensor, m: Tensor, v_scale: Tensor | None, m_scale: Tensor | None) -> None:
    """One pass over one (v, m) pair: float32 views ``(rows, words)`` of the stored bits (float32 because Inductor's
    CPU kernels load floats with full vectors and integers through a copy), scales ``(rows or 1, 1)`` or None."""
    bits = kernel.bits
    words = m.view(torch.int32)
    m_nonzero = _nonzero_lanes(words, bits, kernel.m_zero, kernel.m_care)
    if m_scale is not None:
        m_nonzero = m_nonzero & _nonempty(m_scale, bits)
    if kernel.v_zero is None:  # no code of v's map is zero: only an empty block is
        v_nonzero = _nonempty(v_scale, bits)
    else:
        v_nonzero = _nonzero_lanes(v.view(torch.int32), bits, kernel.v_zero, kernel.v_care)
        if v_scale is not None:
            v_nonzero = v_nonzero & _nonempty(v_scale, bits)
    rewrite = m_nonzero & ~v_nonzero  # the lanes where v reads zero and m does not
    if bits == 32:
        words.masked_fill_(rewrite, _lanes(kernel.m_zero, bits))
        return
    lanes = (rewrite << bits) - rewrite  # every bit of those lanes
    written = words & ~lanes
    if kernel.m_zero:
        written = written | (lanes & _lanes(kernel.m_zero, bits))
    words.copy_(written)


def _guard_pairs(*pairs: Tensor | None) -> None:
    """The pass over any number of pairs, four arguments each (see :func:`_guard_pair`), with the kernel ``_KERNEL``:
    a global of the copy :func:`_pass` makes per kernel (dynamo bakes a global's constants into the graph)."""
    for i in range(0, len(pairs), 4):
        _guard_pair(_KERNEL, *pairs[i:i + 4])  # noqa: F821 - in each copy's globals


@cache
def _pass(kernel: _Kernel) -> Callable[..., None]:
    """:func:`_guard_pairs` for ``kernel``, with its own code object: dynamo keeps its compiled graphs (and counts
    recompiles against its limit) per code object."""
    namespace = {"__builtins__": builtins, "_guard_pair": _guard_pair, "_KERNEL": kernel}
    return types.FunctionType(_guard_pairs.__code__.replace(), namespace, _guard_pairs.__name__)


@cache
def _compiled_pass(kernel: _Kernel) -> Callable[..., None]:
    """:func:`_pass` compiled with dynamic shapes."""
    return torch.compile(_pass(kernel), dynamic=True)


def _fused() -> Callable[[_Kernel], Callable[..., None]]:
    """The compiled pass of a kernel."""
    return _compiled_pass


def _fusable(tensor: Tensor) -> bool:
    return not _fused_failed and (tensor.device.type != "cpu" or _compat.compiler_available())


def _guard_pass(kernel: _Kernel, args: tuple[Tensor | None, ...], fuse: bool) -> None:
    """One call over pairs of one kernel: compiled if ``fuse`` and it works, else the same in eager ops."""
    global _fused_failed
    if fuse and _fusable(args[0]):
        try:
            _fused()(kernel)(*args)
            return
        except Exception as error:  # no working compiler here: the eager ops do the same, slower
            _fused_failed = True
            _compat.log.info("[lightning_stale] the fused underflow guard is unavailable (%s); using eager ops", error)
    for i in range(0, len(args), 4):
        _eager_pair(kernel, *args[i:i + 4])


def _eager_pair(kernel: _Kernel, v: Tensor, m: Tensor, v_scale: Tensor | None, m_scale: Tensor | None) -> None:
    """:func:`_guard_pair` in eager ops, ``EAGER_WORDS`` words at a time (whole rows, or slices of one long row): each
    eager op makes a temporary as large as its input, so slicing keeps the transient memory from growing with the
    tensor."""
    rows, words = m.shape
    if words > EAGER_WORDS:
        for row in range(rows):
            for start in range(0, words, EAGER_WORDS):
                columns = slice(start, start + EAGER_WORDS)
                _guard_pair(kernel, v[row:row + 1, columns], m[row:row + 1, columns],
                            _scale_rows(v_scale, row, 1), _scale_rows(m_scale, row, 1))
        return
    per_slice = EAGER_WORDS // words
    for row in range(0, rows, per_slice):
        _guard_pair(kernel, v[row:row + per_slice], m[row:row + per_slice],
                    _scale_rows(v_scale, row, per_slice), _scale_rows(m_scale, row, per_slice))


def _scale_rows(scale: Tensor | None, first: int, count: int) -> Tensor | None:
    """The ``(rows, 1)`` scales of ``count`` rows from ``first`` (one scale ``(1, 1)`` serves every row)."""
    return scale if scale is None or scale.shape[0] == 1 else scale[first:first + count]


def zero_lanes(slot: Slot) -> ZeroLanes | None:
    """The slot's :class:`ZeroLanes`: its own where the layout has them, else read from :meth:`Slot.zero_view`
    (floats compare equal to 0 at +0 and -0, integer codes at the zero code), else None."""
    own = getattr(slot, "zero_lanes", None)
    if own is not None:
        return own()
    view = slot.zero_view()
    if view is None:
        return None
    codes, zero = view
    bits = 8 * codes.element_size()
    if bits > 32 or not codes.is_contiguous():
        return None
    if codes.is_floating_point():
        return ZeroLanes(codes.reshape(-1), bits, 0, (1 << (bits - 1)) - 1) if zero == 0 else None
    every = (1 << bits) - 1
    return ZeroLanes(codes.reshape(-1), bits, int(zero) & every, every)


@dataclass
class _Side:
    """One slot of a pair as the planned pass reads it: its bytes, and its scales with their kind."""

    bytes: Tensor  # flat uint8 view of the stored bits
    scale: Tensor | None  # flat per-block scales, or one scale
    regular: bool  # more than one block: one scale per ``block`` elements

    def row_scales(self, rows: int) -> Tensor | None:
        """Scales ``(rows, 1)`` for the first ``rows`` blocks (``(1, 1)`` for one scale)."""
        if self.scale is None:
            return None
        return self.scale[:rows].view(rows, 1) if self.regular else self.scale.view(1, 1)

    def chunk_scales(self, first: int, chunks: int) -> Tensor | None:
        """One scale per buffer row for ``chunks`` rows from block ``first`` (a view: no copy until gathered)."""
        if self.scale is None:
            return None
        return self.scale[first:first + chunks] if self.regular else self.scale.view(1).expand(chunks)


@dataclass
class _Segment:
    """Elements of one pair that a :class:`_Group` copies into its buffers."""

    v: Tensor  # v's bytes
    m: Tensor  # m's bytes
    numel: int
    v_scales: Tensor | None  # one scale per chunk of the group
    m_scales: Tensor | None


class GuardPlan:
    """The guard for a fixed set of slots, planned once (the monitor keeps one per slot set and rebuilds it when the
    optimizer state is replaced): per step one compiled call per ``PAIRS_PER_CALL`` large (v, m) pairs of a layout,
    in place; one pass per group of small pairs of a layout (gathered into buffers kept by the plan and copied back);
    and the mask-based path for slots without bit lanes."""

    def __init__(self, slots: Iterable[Slot]) -> None:
        by_param: dict[int, list[Slot]] = {}
        for slot in slots:
            by_param.setdefault(id(slot.param), []).append(slot)
        self.pairs: list[tuple[list[Slot], list[Slot]]] = []  # (v slots, m slots) per parameter
        for group in by_param.values():
            v_slots = [s for s in group if s.moment == "v"]
            m_slots = [s for s in group if s.moment == "m"]
            if v_slots and m_slots:
                for m in m_slots:
                    if m.numel != v_slots[0].numel:
                        raise ValueError(f"slot {m.key!r} has {m.numel} elements but its second moment has "
                                         f"{v_slots[0].numel}")
                self.pairs.append((v_slots, m_slots))
        self._masked: list[tuple[list[Slot], list[Slot]]] = []
        large: dict[tuple[_Kernel, torch.device], list[tuple[Tensor | None, ...]]] = {}
        segments: dict[tuple, list[_Segment]] = {}
        for v_slots, m_slots in self.pairs:
            for m in m_slots:
                if len(v_slots) > 1 or not self._plan(v_slots[0], m, large, segments):
                    self._masked.append((v_slots, [m]))
        self._calls: list[tuple[_Kernel, tuple[Tensor | None, ...]]] = []  # (kernel, pairs' arguments), compiled
        for (kernel, _), args in large.items():
            full = len(args) - len(args) % PAIRS_PER_CALL
            chunks = [args[i:i + PAIRS_PER_CALL] for i in range(0, full, PAIRS_PER_CALL)] + [[a] for a in args[full:]]
            for chunk in chunks:  # a call of PAIRS_PER_CALL pairs or of one: two graphs per kernel
                self._calls.append((kernel, tuple(t for pair in chunk for t in pair)))
        # A group is compiled when it is large or its kernel is compiled anyway (for large pairs).
        compiled = {kernel for kernel, _ in self._calls}
        self._groups = [_Group(kernel, chunk, members, kernel in compiled)
                        for (kernel, _, chunk, _, _), members in segments.items()]
        self._compiles = bool(self._calls) or any(group.fuse for group in self._groups)

    @staticmethod
    def _plan(v_slot: Slot, m_slot: Slot, large: dict[tuple, list], segments: dict[tuple, list[_Segment]]) -> bool:
        """File one (v, m) pair under the large calls or the groups; False where it needs the mask-based path."""
        v, m = zero_lanes(v_slot), zero_lanes(m_slot)
        if v is None or m is None or m.zero is None or v.bits != m.bits or v.stored.device != m.stored.device:
            return False
        if v.zero is None and v.scale is None:
            return True  # v never reads as zero: nothing to guard
        bits, numel = v.bits, m_slot.numel
        sides = []
        for lanes in (v, m):
            data = lanes.stored.view(torch.uint8)
            if data.numel() * 8 != numel * bits:
                return False
            regular = lanes.scale is not None and lanes.scale.numel() > 1
            if regular and lanes.scale.numel() != math.ceil(numel / lanes.block):
                return False
            sides.append(_Side(data, lanes.scale, regular))
        blocks = {lanes.block for lanes, side in zip((v, m), sides) if side.regular}
        if len(blocks) > 1:
            return False
        kernel = _Kernel(bits, v.zero, v.care, m.zero, m.care)
        device = v.stored.device
        # Rows of whole blocks where a side has them, else one row; the tail (a partial block, or the elements short
        # of a whole word) joins the group of the same kernel and row length.
        if blocks:
            row = blocks.pop()
            if row * bits % 32:
                return False
            rows, chunk = numel // row, row
        else:
            row = numel - numel % (32 // bits)
            rows = 1 if row else 0
            chunk = SCALED_CHUNK if v.scale is not None or m.scale is not None else 32 // bits
        head = rows * row
        key = (kernel, device, chunk, *(None if side.scale is None else side.scale.dtype for side in sides))
        if head >= FUSED_MIN_NUMEL:
            if any(side.bytes.storage_offset() % 4 for side in sides):
                return False  # no word view in place (and too large to copy)
            head_bytes = head * bits // 8
            words = [side.bytes[:head_bytes].view(torch.float32).view(rows, -1) for side in sides]
            large.setdefault((kernel, device), []).append(
                (words[0], words[1], sides[0].row_scales(rows), sides[1].row_scales(rows)))
            if head < numel:  # shorter than a row: one buffer row
                segments.setdefault(key, []).append(_Segment(
                    sides[0].bytes[head_bytes:], sides[1].bytes[head_bytes:], numel - head,
                    sides[0].chunk_scales(rows, 1), sides[1].chunk_scales(rows, 1)))
        else:
            chunks = math.ceil(numel / chunk)
            scales = [side.chunk_scales(0, chunks) for side in sides]
            segments.setdefault(key, []).append(_Segment(sides[0].bytes, sides[1].bytes, numel, *scales))
        return True

    def run(self, count: bool = False) -> Tensor | None:
        """Guard once. With ``count=True`` every pair takes the mask-based path and the number of elements whose m
        was non-zero and got zeroed is returned (a 0-d tensor on the state's device, no host sync)."""
        if count:
            counts = [n for v_slots, m_slots in self.pairs for n in _guard_masked(v_slots, m_slots, count=True)]
            return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
        with _compat.distinct_sizes() if self._compiles else contextlib.nullcontext():
            for kernel, args in self._calls:
                _guard_pass(kernel, args, fuse=True)
            for group in self._groups:
                group.run()
        for v_slots, m_slots in self._masked:
            _guard_masked(v_slots, m_slots, count=False)
        return None

    def tensors(self) -> list[Tensor]:
        """The buffers the plan keeps between steps (its views of the state excluded)."""
        return [t for group in self._groups for t in group.buffers]


class _Group:
    """Segments of one kernel guarded together: copied into buffers of ``chunk``-element rows (each segment from the
    start of a row, so a row holds one block of one segment and the scales gathered per row apply), one pass, and m
    copied back."""

    def __init__(self, kernel: _Kernel, chunk: int, members: list[_Segment], compiled: bool) -> None:
        self.kernel = kernel
        row_bytes = chunk * kernel.bits // 8
        starts, rows = [], 0
        for s in members:
            starts.append(rows * row_bytes)
            rows += math.ceil(s.numel / chunk)
        device = members[0].v.device
        v_buffer = torch.empty(rows * row_bytes, dtype=torch.uint8, device=device)
        m_buffer = torch.empty_like(v_buffer)
        self.v_sources, self.m_sources = [s.v for s in members], [s.m for s in members]
        self.v_parts = [v_buffer[start:start + s.v.numel()] for start, s in zip(starts, members)]
        self.m_parts = [m_buffer[start:start + s.m.numel()] for start, s in zip(starts, members)]
        self.v_scales = [s.v_scales for s in members if s.v_scales is not None]
        self.m_scales = [s.m_scales for s in members if s.m_scales is not None]
        self.v_flags = torch.empty(rows, dtype=self.v_scales[0].dtype, device=device) if self.v_scales else None
        self.m_flags = torch.empty(rows, dtype=self.m_scales[0].dtype, device=device) if self.m_scales else None
        self.buffers = [t for t in (v_buffer, m_buffer, self.v_flags, self.m_flags) if t is not None]
        end = starts[-1] + members[-1].v.numel()
        # Without padding between segments one cat gathers them (three times faster than a foreach copy on CPU).
        self.v_gathered = v_buffer[:end] if end == sum(s.v.numel() for s in members) else None
        self.m_gathered = m_buffer[:end] if self.v_gathered is not None else None
        shape = (rows, -1) if self.v_scales or self.m_scales else (1, -1)  # unscaled: one long row
        self.args = (v_buffer.view(torch.float32).view(shape), m_buffer.view(torch.float32).view(shape),
                     None if self.v_flags is None else self.v_flags.view(rows, 1),
                     None if self.m_flags is None else self.m_flags.view(rows, 1))
        self.fuse = compiled or rows * chunk >= FUSED_MIN_NUMEL

    def run(self) -> None:
        if self.v_gathered is not None:
            torch.cat(self.v_sources, out=self.v_gathered)
            torch.cat(self.m_sources, out=self.m_gathered)
        else:
            torch._foreach_copy_(self.v_parts, self.v_sources)
            torch._foreach_copy_(self.m_parts, self.m_sources)
        if self.v_flags is not None:
            torch.cat(self.v_scales, out=self.v_flags)
        if self.m_flags is not None:
            torch.cat(self.m_scales, out=self.m_flags)
        _guard_pass(self.kernel, self.args, self.fuse)
        torch._foreach_copy_(self.m_sources, self.m_parts)


def _guard_masked(v_slots: list[Slot], m_slots: list[Slot], count: bool) -> list[Tensor]:
    """The layout-independent path through ``zero_mask``/``zero_elements``; with ``count``, the hazard count per m."""
    v_zero = v_slots[0].zero_mask()
    for v in v_slots[1:]:
        v_zero |= v.zero_mask()
    counts = []
    for m in m_slots:
        hazard = v_zero & ~m.zero_mask()  # an m that already reads as zero keeps its bits
        if count:
            counts.append(torch.count_nonzero(hazard))  # several times faster than a bool sum on CPU
        m.zero_elements(hazard)
    return counts


def guard_underflow(slots: Iterable[Slot], count: bool = False) -> Tensor | None:
    """For each parameter, zero every first moment where its second moment is stored as zero (plans and runs a
    :class:`GuardPlan` once; keep the plan to guard the same slots every step).

    With ``count=True`` it returns the number of elements whose m was non-zero and got zeroed (a 0-d tensor on the
    state's device, no host sync), at the price of extra passes; otherwise None.
    """
    return GuardPlan(slots).run(count)
