"""Slot layouts shared by the built-in adapters, one class per storage: plain float tensors, 8-bit codes into a value
map with per-block scales, two 4-bit codes per byte, and ``float8_e4m3fn`` codes with per-block scales.

A custom adapter reuses whichever matches its optimizer's storage (see ``docs/adapters.md``); each layout knows how to
read its codes, values and grid spacing and, for the underflow guard, how to find and write an exact zero.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_stale._compat import local_tensor
from lightning_stale.adapters.protocol import Slot, take
from lightning_stale.adapters.sampling import Sample
from lightning_stale.formats.base import grid_spacing_table, pack_nibbles, unpack_nibbles
from lightning_stale.formats.fp8 import e4m3_spacing
from lightning_stale.transfers import to_device



def _bit_view(tensor: Tensor) -> Tensor:
    """The raw bits of a float tensor as an integer tensor of the same width (bitwise equality, NaN-safe)."""
    bits = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
    if tensor.dtype in bits:
        return tensor.view(bits[tensor.dtype])
    return tensor


def dtype_ulp(values: Tensor) -> Tensor:
    """Absolute spacing to the next representable value away from zero, in the values' own dtype, as fp32."""
    mag = values.abs()
    return (torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag).float()


FLOAT_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclass(frozen=True)
class ZeroLanes:
    """A slot's stored elements as the underflow guard's one pass (:mod:`lightning_stale.act.guard`) reads and writes
    them: fixed-width bit lanes, in place. A lane reads as an exact zero where ``(lane ^ zero) & care == 0`` or where
    the scale of its block is 0; writing ``zero`` into a lane stores an exact zero."""

    stored: Tensor  # the stored bits, flat and contiguous (the codes, or the float tensor itself)
    bits: int  # bits per element: 4 (two per byte, as the codes are packed), 8, 16 or 32
    zero: int | None  # the lane that stores an exact zero; None where no lane does (a map without zero)
    care: int  # the lane bits the zero test compares: every bit, or every bit but the sign where -0 is a zero too
    scale: Tensor | None = None  # flat per-block scales: every element of a block whose scale is 0 reads as zero
    block: int = 0  # elements per scale


def _without_sign(bits: int) -> int:
    """The ``care`` of a lane whose top bit is a sign: +0 and -0 both read as zero."""
    return (1 << (bits - 1)) - 1


def _or_empty_blocks(zero: Tensor | None, scale: Tensor, block: int, numel: int) -> Tensor:
    """``zero`` (a flat per-element mask, or None for none) or'ed with the elements of blocks whose scale is 0."""
    empty_blocks = scale.reshape(-1) == 0
    if numel == empty_blocks.numel() * block:  # whole blocks: broadcast, no expansion
        empty = empty_blocks.unsqueeze(1)
        if zero is None:
            return empty.expand(-1, block).reshape(-1)
        return zero.view(-1, block).logical_or_(empty).reshape(-1)
    empty = empty_blocks.repeat_interleave(block)[:numel]
    return empty if zero is None else zero.logical_or_(empty)


@dataclass(eq=False, kw_only=True)
class FloatSlot(Slot):
    """A moment stored as a plain float tensor (torch.optim, 32-bit fallbacks): codes are its raw bits."""

    tensor: Tensor

    def codes(self) -> Tensor:
        return _bit_view(self.tensor)

    def value(self) -> Tensor:
        return self.tensor.reshape(-1).float()

    def spacing(self) -> Tensor | None:
        return dtype_ulp(self.tensor.reshape(-1)) if self.tensor.is_floating_point() else None

    def codes_at(self, index: Tensor) -> Tensor:
        return take(_bit_view(self.tensor), index)

    def value_at(self, index: Tensor) -> Tensor:
        return take(self.tensor, index).float()

    def spacing_at(self, index: Tensor) -> Tensor | None:
        return dtype_ulp(take(self.tensor, index)) if self.tensor.is_floating_point() else None

    def zero_mask(self) -> Tensor:
        return (self.tensor == 0).reshape(-1)

    def zero_elements(self, mask: Tensor) -> None:
        self.tensor.masked_fill_(mask.view(self.tensor.shape), 0)

    def zero_view(self) -> tuple[Tensor, int | float] | None:
        return (self.tensor.view(-1), 0) if self.tensor.is_contiguous() else None

    def zero_lanes(self) -> ZeroLanes | None:
        bits = 8 * self.tensor.element_size()
        if not (self.tensor.is_floating_point() and self.tensor.is_contiguous()) or bits > 32:
            return None
        return ZeroLanes(self.tensor.view(-1), bits, 0, _without_sign(bits))  # == 0 holds for -0 as for +0


_MAP_VALUES: dict[tuple[int, str], tuple[weakref.ref, Any]] = {}  # (id(map), what) -> (the map, the value)


def _of_map(qmap: Tensor, what: str, build: Callable[[Tensor], Any]) -> Any:
    """A value derived from a code map, built once per map tensor (the optimizers share one map among all their
    parameters) and dropped with it."""
    key = (id(qmap), what)
    entry = _MAP_VALUES.get(key)
    if entry is None or entry[0]() is not qmap:
        entry = (weakref.ref(qmap), build(qmap))
        _MAP_VALUES[key] = entry
        weakref.finalize(qmap, _MAP_VALUES.pop, key, None)
    return entry[1]


def _host_map(qmap: Tensor) -> Tensor:
    """The map's values on the host: read once per map, when its first slot is made (the step its state appears);
    everything else derived from the map is computed from this copy."""
    return _of_map(qmap, "host", lambda q: q.detach().cpu())


def _value_over_spacing(qmap: Tensor) -> Tensor:
    """``|value| / spacing`` of every code of a map (float64, on its device); 0 where the value is zero or the
    spacing unknown (such elements are left out of the grid estimate)."""

    def build(q: Tensor) -> Tensor:
        host = _host_map(q)
        values, spacing = host.double().abs(), grid_spacing_table(host.float()).double()
        keep = (values > 0) & (spacing > 0) & torch.isfinite(spacing)
        return to_device(torch.where(keep, values / torch.where(keep, spacing, 1.0), 0.0), q.device)

    return _of_map(qmap, "value/spacing", build)


def _spacing_table(qmap: Tensor) -> Tensor:
    """The ulp-convention spacing of every code of a map, on its device."""
    return _of_map(qmap, "spacing", lambda q: to_device(grid_spacing_table(_host_map(q).float()), q.device))


def _zero_entry(qmap: Tensor) -> tuple[int, bool]:
    """(the code of the map entry nearest zero, whether that entry is exactly zero), from the map's host copy, so
    the underflow guard's per-step test and write compare against a Python int."""

    def build(q: Tensor) -> tuple[int, bool]:
        flat = _host_map(q).reshape(-1)
        code = int(torch.argmin(flat.abs()))
        return code, float(flat[code]) == 0.0

    return _of_map(qmap, "zero", build)


def _zero_lane(qmap: Tensor, bits: int) -> tuple[int | None, int | None]:
    """``(zero, care)`` of :class:`ZeroLanes` for ``bits``-wide codes into ``qmap``: (None, every bit) for a map without
    zero, ``care`` None where its zero codes are neither one code nor a +0/-0 pair (the guard then uses masks)."""

    def build(q: Tensor) -> tuple[int | None, int | None]:
        every = (1 << bits) - 1
        zeros = torch.nonzero(_host_map(q).reshape(-1) == 0).reshape(-1).tolist()
        if not zeros:
            return None, every
        if len(zeros) == 1:
            return zeros[0], every
        sign = 1 << (bits - 1)
        if len(zeros) == 2 and zeros[0] ^ zeros[1] == sign:
            return zeros[0], every & ~sign
        return zeros[0], None

    return _of_map(qmap, f"zero lane {bits}", build)


@dataclass(eq=False, kw_only=True)
class BlockQmapSlot(Slot):
    """A moment stored as 8-bit indices into a value map, scaled per block: ``qmap[code] * scale[i // block]``.

    ``stored`` is the uint8 code tensor (any shape), ``scale`` the flat per-block scales, ``qmap`` the shared map.
    """

    stored: Tensor
    scale: Tensor
    qmap: Tensor
    block_size: int

    lane_bits: ClassVar[int] = 8  # bits per stored code (the underflow guard's lanes)

    def __post_init__(self) -> None:
        _host_map(self.qmap)  # its one read, now: the step its state appears

    def state_tensors(self) -> list[Tensor]:
        return [self.stored, self.scale]  # the map is a shared table (adapters may rebuild it for each read)

    def codes(self) -> Tensor:
        return self.stored

    def value(self) -> Tensor:
        codes = self.codes().reshape(-1).long()
        return self.qmap[codes] * self.scale.repeat_interleave(self.block_size)[: codes.numel()]

    def codes_at(self, index: Tensor) -> Tensor:
        return take(self.stored, index)

    def value_at(self, index: Tensor) -> Tensor:
        return take(self.qmap, self.codes_at(index).long()) * take(self.scale, index // self.block_size)

    def spacing(self) -> Tensor | None:
        from lightning_stale.formats.int8_dynamic import spacing_from_codes

        return spacing_from_codes(self.codes().reshape(-1), self.scale.reshape(-1), self.qmap, self.block_size)

    def spacing_at(self, index: Tensor) -> Tensor | None:
        return take(_spacing_table(self.qmap), self.codes_at(index).long()) * take(self.scale,
                                                                                      index // self.block_size)

    def spacing_sums(self, sample: Sample) -> Tensor | None:
        # value / spacing = qmap[code] / table[code]: the block scale cancels, so the codes (a strided view) suffice
        ratio = _of_map(self.qmap, "value/spacing", _value_over_spacing)
        weights = ratio[self.sampled_codes(sample).reshape(-1).long()]
        return torch.stack([weights.sum(), torch.count_nonzero(weights).double()])

    def zero_code(self) -> int | None:
        code, exact = _zero_entry(self.qmap)
        return code if exact else None

    def zero_mask(self) -> Tensor:
        # Codes against the map's zero codes, several times cheaper than dequantizing the whole state every step; an
        # element of a block whose scale is 0 is zero whatever its code.
        codes = self.codes().reshape(-1)
        zero, care = _zero_lane(self.qmap, self.lane_bits)
        if zero is None:
            code_zero = None
        elif care == (1 << self.lane_bits) - 1:
            code_zero = codes == zero
        elif care is not None:
            code_zero = ((codes ^ zero) & care) == 0
        else:
            code_zero = take(self.qmap == 0, codes.long())
        return _or_empty_blocks(code_zero, self.scale, self.block_size, codes.numel())

    def zero_elements(self, mask: Tensor) -> None:
        # The nearest-zero entry is an exact zero in every first-moment map (bitsandbytes, torchao, ours).
        self.stored.masked_fill_(mask.view(self.stored.shape), _zero_entry(self.qmap)[0])

    def zero_view(self) -> tuple[Tensor, int | float] | None:
        code, exact = _zero_entry(self.qmap)
        return (self.stored.view(-1), code) if exact and self.stored.is_contiguous() else None

    def zero_lanes(self) -> ZeroLanes | None:
        zero, care = _zero_lane(self.qmap, self.lane_bits)
        # Not for an odd number of packed codes: the last byte's padding nibble is no element.
        if care is None or not self.stored.is_contiguous() or self.stored.numel() * 8 != self.numel * self.lane_bits:
            return None
        return ZeroLanes(self.stored.view(-1), self.lane_bits, zero, care, self.scale.reshape(-1), self.block_size)


@dataclass(eq=False, kw_only=True)
class Packed4bitSlot(BlockQmapSlot):
    """Like :class:`BlockQmapSlot` with two 4-bit codes per byte (high nibble first), as torchao's 4-bit states."""

    packed: ClassVar[bool] = True
    lane_bits: ClassVar[int] = 4

    @property
    def numel(self) -> int:
        return local_tensor(self.param).numel()  # without unpacking the codes

    def sampled_codes(self, sample: Sample) -> Tensor:
        return sample.byte_view(self.stored)

    def spacing_sums(self, sample: Sample) -> Tensor | None:
        return Slot.spacing_sums(self, sample)  # gathered: the grid estimate samples elements, not element pairs

    def codes(self) -> Tensor:
        return unpack_nibbles(self.stored, self.numel)

    def codes_at(self, index: Tensor) -> Tensor:
        byte = take(self.stored, index // 2)
        return torch.where(index % 2 == 0, byte >> 4, byte & 0b1111)

    def spacing(self) -> Tensor | None:
        codes = self.codes().long()
        return _spacing_table(self.qmap)[codes] * self.scale.repeat_interleave(self.block_size)[: codes.numel()]

    def zero_view(self) -> tuple[Tensor, int | float] | None:
        return None  # two codes per byte: no per-element view

    def zero_elements(self, mask: Tensor) -> None:
        codes = unpack_nibbles(self.stored)  # every nibble, the padding of an odd count included
        codes[: mask.numel()].masked_fill_(mask, _zero_entry(self.qmap)[0])
        self.stored.view(-1).copy_(pack_nibbles(codes))


@dataclass(eq=False, kw_only=True)
class BlockFp8Slot(Slot):
    """A moment stored as ``float8_e4m3fn`` values times a per-block scale (torchao AdamFp8)."""

    stored: Tensor
    scale: Tensor
    block_size: int

    def codes(self) -> Tensor:
        return _bit_view(self.stored)

    def value(self) -> Tensor:
        return self.stored.reshape(-1).float() * self.scale.repeat_interleave(self.block_size)

    def codes_at(self, index: Tensor) -> Tensor:
        return take(_bit_view(self.stored), index)

    def value_at(self, index: Tensor) -> Tensor:
        return take(self.stored, index).float() * take(self.scale, index // self.block_size)

    def spacing(self) -> Tensor | None:
        return e4m3_spacing(self.stored.reshape(-1)) * self.scale.repeat_interleave(self.block_size)

    def spacing_at(self, index: Tensor) -> Tensor | None:
        return e4m3_spacing(take(self.stored, index)) * take(self.scale, index // self.block_size)

    def zero_mask(self) -> Tensor:
        # +0 (0x00) and -0 (0x80) are both zero; so is every element of a block whose scale is 0.
        codes = self.stored.view(torch.uint8).reshape(-1)
        return _or_empty_blocks((codes & 0x7F) == 0, self.scale, self.block_size, codes.numel())

    def zero_elements(self, mask: Tensor) -> None:
        self.stored.view(torch.uint8).masked_fill_(mask.view(self.stored.shape), 0)

    def zero_lanes(self) -> ZeroLanes | None:
        if not self.stored.is_contiguous():
            return None
        return ZeroLanes(self.stored.view(-1), 8, 0, _without_sign(8), self.scale.reshape(-1), self.block_size)
