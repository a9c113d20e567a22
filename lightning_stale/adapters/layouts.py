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
from lightning_stale.formats.base import grid_spacing_table, pack_nibbles, unpack_nibbles
from lightning_stale.formats.fp8 import e4m3_spacing
from lightning_stale.sampling import Sample



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


def _spacing_table(qmap: Tensor) -> Tensor:
    """The ulp-convention spacing of every code of a map, on its device."""
    return _of_map(qmap, "spacing", lambda q: grid_spacing_table(q.detach().float().cpu()).to(q.device))


def _zero_entry(qmap: Tensor) -> tuple[int, bool]:
    """(the code of the map entry nearest zero, whether that entry is exactly zero): one host read per map, so the
    underflow guard's per-step test and write compare against a Python int."""

    def build(q: Tensor) -> tuple[int, bool]:
        flat = q.detach().reshape(-1)
        code = int(torch.argmin(flat.abs()))
        return code, float(flat[code]) == 0.0

    return _of_map(qmap, "zero", build)


@dataclass(eq=False, kw_only=True)
class BlockQmapSlot(Slot):
    """A moment stored as 8-bit indices into a value map, scaled per block: ``qmap[code] * scale[i // block]``.

    ``stored`` is the uint8 code tensor (any shape), ``scale`` the flat per-block scales, ``qmap`` the shared map.
    """

    stored: Tensor
    scale: Tensor
    qmap: Tensor
    block_size: int

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

    def zero_code(self) -> int | None:
        code, exact = _zero_entry(self.qmap)
        return code if exact else None

    def zero_mask(self) -> Tensor:
        # Codes against the zero code, several times cheaper than dequantizing the whole state every step; an element
        # of a block whose scale is 0 is zero whatever its code.
        codes, empty_blocks = self.codes().reshape(-1), self.scale.reshape(-1) == 0
        code, exact = _zero_entry(self.qmap)
        if codes.numel() == empty_blocks.numel() * self.block_size:  # whole blocks: broadcast, no expansion
            empty = empty_blocks.unsqueeze(1)
            blocks = codes.view(-1, self.block_size)
            return ((blocks == code).logical_or_(empty) if exact else empty.expand_as(blocks)).reshape(-1)
        empty = empty_blocks.repeat_interleave(self.block_size)[: codes.numel()]
        return (codes == code).logical_or_(empty) if exact else empty

    def zero_elements(self, mask: Tensor) -> None:
        # The nearest-zero entry is an exact zero in every first-moment map (bitsandbytes, torchao, ours).
        self.stored.masked_fill_(mask.view(self.stored.shape), _zero_entry(self.qmap)[0])

    def zero_view(self) -> tuple[Tensor, int | float] | None:
        code, exact = _zero_entry(self.qmap)
        return (self.stored.view(-1), code) if exact and self.stored.is_contiguous() else None


@dataclass(eq=False, kw_only=True)
class Packed4bitSlot(BlockQmapSlot):
    """Like :class:`BlockQmapSlot` with two 4-bit codes per byte (high nibble first), as torchao's 4-bit states."""

    packed: ClassVar[bool] = True

    @property
    def numel(self) -> int:
        return local_tensor(self.param).numel()  # without unpacking the codes

    def sampled_codes(self, sample: Sample) -> Tensor:
        return sample.byte_view(self.stored)

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

    def zero_elements(self, mask: Tensor) -> None:
        self.stored.view(torch.uint8).masked_fill_(mask.view(self.stored.shape), 0)
