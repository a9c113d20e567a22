"""The state-format protocol: how one low-precision format stores an fp32 tensor and how coarse its grid is.

A format turns an fp32 tensor into a :class:`QuantizedState` (codes plus optional scales), turns it back, and reports
the absolute grid spacing at each stored value, which the stalling theory divides by the value to get the relative gap.
It also describes its storage (bits, block size, code table), which is all the adapters need to read it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_stale.formats.noise import NOISE_BITS
from lightning_stale.transfers import to_device
from lightning_stale.vocab import check_rounding


@dataclass(eq=False)
class QuantizedState:
    """Stored representation of one tensor: ``codes`` (format dtype), per-block or per-tensor ``scale`` (fp32) or
    ``None``, and the original ``shape``."""

    codes: Tensor
    scale: Tensor | None
    shape: torch.Size


def random_bits(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Uniform int32 noise in [0, 2^NOISE_BITS) shaped like ``like``, on its device, drawn from ``generator`` (a
    private one on that device if None), never from the global RNG. A generator draws on its own device (a CPU one
    for a CUDA tensor: drawn on the host, then copied)."""
    generator = generator or private_generator(like.device)
    bits = torch.randint(0, 1 << NOISE_BITS, like.shape, generator=generator, device=generator.device,
                         dtype=torch.int32)
    return bits.to(like.device)


def uniform_from_bits(bits: Tensor) -> Tensor:
    """The fp32 fractions ``bits / 2^NOISE_BITS`` in [0, 1) (exact)."""
    return bits.to(torch.float32).mul_(2.0**-NOISE_BITS)


def private_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator on ``device`` (on the CPU where that device has none) seeded from the OS, for callers that
    pass no generator (keeps the global RNG untouched)."""
    try:
        generator = torch.Generator(device=device)
    except RuntimeError:  # a device without generators (meta)
        generator = torch.Generator()
    generator.seed()
    return generator


class StateFormat(ABC):
    """One storage format for an optimizer moment: its description and its rounding, so that the optimizer and the
    adapters that read it never ask for a format by name.

    Attributes:
        name: the name it is registered under (:func:`lightning_stale.formats.register_format`); the slots, the
            fit-start report and ``inspect`` show it.
        signed: True for first moments (signed values), False for second moments (non-negative values).
        bits: bits of storage per element, scales excluded; 4-bit codes are packed two per byte into a flat tensor.
        block_size: elements sharing one scale, or None (no scale or a single per-tensor scale).
        theory_name: the float format the stalling theory models (``"bf16"``, ``"fp4_e2m2"`` ...), None for grids
            the theory does not cover (fp32, int8_dynamic).
        table_rounded: nearest rounding is a lookup in 65,536-entry tables (:class:`GridRounder`), which Inductor does
            not vectorize, so ``QuantizedAdamW(compile=None)`` keeps it eager on CPU.
    """

    name: str
    signed: bool
    bits: int
    block_size: int | None = None
    theory_name: str | None = None
    table_rounded: bool = False

    def __init__(self, signed: bool) -> None:
        self.signed = bool(signed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, signed={self.signed})"

    def quantize(
        self, x: Tensor, rounding: str = "nearest", generator: torch.Generator | None = None
    ) -> QuantizedState:
        """Store the fp32 tensor ``x`` (any shape) in this format."""
        check_rounding(rounding)
        x = x.detach().to(torch.float32)
        noise = random_bits(x, generator) if rounding == "stochastic" else None
        return self.quantize_with_noise(x, noise)

    @abstractmethod
    def quantize_with_noise(self, x: Tensor, noise: Tensor | None) -> QuantizedState:
        """Store the fp32 tensor ``x``: nearest rounding when ``noise`` is None, else stochastic rounding driven by
        ``noise`` (int32 in [0, 2^NOISE_BITS), shaped like ``x``). Pure tensor ops, so torch.compile can fuse it."""

    def quantize_into(
        self, q: QuantizedState, x: Tensor, rounding: str = "nearest", generator: torch.Generator | None = None
    ) -> None:
        """Store ``x`` into the existing buffers of ``q`` in place (optimizer state must keep its tensors)."""
        new = self.quantize(x, rounding, generator)
        q.codes.copy_(new.codes)
        if q.scale is not None:
            q.scale.copy_(new.scale)

    @abstractmethod
    def dequantize(self, q: QuantizedState) -> Tensor:
        """The fp32 values stored in ``q``, in the original shape."""

    @abstractmethod
    def spacing(self, q: QuantizedState) -> Tensor:
        """Absolute grid spacing at each stored value (fp32, original shape): the distance from ``|value|`` to the next
        larger representable magnitude, or to the next smaller one at the top of the range."""

    @abstractmethod
    def empty(self, shape: torch.Size | tuple[int, ...]) -> QuantizedState:
        """A state that dequantizes to exactly zero (what a fresh optimizer stores)."""

    @abstractmethod
    def bytes_per_element(self, numel: int) -> float:
        """Storage bytes per element of a tensor with ``numel`` elements, scales included."""

    @abstractmethod
    def element_codes(self, q: QuantizedState) -> Tensor:
        """One integer code per element, flat (packed fp4 unpacked, floats as bit patterns): equal codes mean the
        stored value did not move, which is how stalls are counted."""

    def zero_code(self) -> int | None:
        """The per-element code value that stores an exact zero whatever the scale, or None if the grid has no zero."""
        return 0

    def grid(self) -> Tensor | None:
        """The fp32 value of every code at scale 1, by code, for formats whose codes index a table of values (a shared
        tensor: do not modify it); None where the codes are float bit patterns."""
        return None

    def pack_codes(self, codes: Tensor) -> Tensor:
        """The stored form of flat per-element codes, the inverse of :meth:`element_codes`: the codes themselves
        here, packed where a format stores several per byte."""
        return codes

    def round_up_into(self, q: QuantizedState, target: Tensor) -> None:
        """Store the non-negative fp32 ``target`` into ``q`` in place, every value rounded up onto the grid (so
        quantization cannot undo a bound, and no positive value becomes zero). This default serves formats with a
        :meth:`grid` scaled per block or per tensor; float formats override it."""
        grid = self.grid()
        if grid is None or q.scale is None:
            raise TypeError(f"state format {self.name!r} has no rounded-up write")
        codes, absmax = round_up_blockwise(target, on_device(grid, target.device),
                                           self.block_size or max(target.numel(), 1))
        q.scale.copy_(absmax.clamp_min(1e-12))
        q.codes.view(-1).copy_(self.pack_codes(codes))


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks needed for ``numel`` elements (the last one may be partial; an empty tensor still gets one)."""
    return max(1, (numel + block_size - 1) // block_size)  # integer ops: symbolic sizes under torch.compile stay so


def as_blocks(flat: Tensor, block_size: int) -> Tensor:
    """``flat`` as a (num_blocks, block_size) tensor: a view when the blocks are full, else a zero-padded copy."""
    n = flat.numel()
    blocks = num_blocks(n, block_size)
    if n == blocks * block_size:
        return flat.view(blocks, block_size)
    padded = flat.new_zeros(blocks * block_size)
    padded[:n] = flat
    return padded.view(blocks, block_size)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers for formats whose values lie on a small sorted grid (scaled per block): int8_dynamic and fp4.


def nearest_thresholds(grid: Tensor) -> Tensor:
    """For a sorted fp32 ``grid``, the smallest fp32 x of each gap that rounds up to the upper neighbour.

    The rule is torchao's: round up iff ``x - lo >= (hi - lo) * 0.5`` evaluated in fp32. Precomputing the exact fp32
    thresholds turns nearest rounding into one ``bucketize`` while reproducing torchao's codes bit for bit.
    """
    grid = grid.to(torch.float32)
    lo, hi = grid[:-1], grid[1:]
    half = (hi - lo) * 0.5
    t = lo + half  # a first guess, then walk to the exact boundary of the fp32 predicate
    inf = torch.tensor(float("inf"))
    for _ in range(8):
        up = (t - lo) >= half
        below = torch.nextafter(t, -inf)
        below_up = (below - lo) >= half
        t = torch.where(up & below_up, below, torch.where(up, t, torch.nextafter(t, inf)))
    if not (((t - lo) >= half).all() and ((torch.nextafter(t, -inf) - lo) < half).all()):
        raise AssertionError("nearest_thresholds did not converge")
    return t


def pack_nibbles(codes: Tensor) -> Tensor:
    """Pack 4-bit codes (uint8, flat, even length) two per byte, the first element in the high nibble: the layout of
    our fp4 format and of torchao's 4-bit states."""
    pairs = codes.view(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


def unpack_nibbles(packed: Tensor, numel: int | None = None) -> Tensor:
    """Inverse of :func:`pack_nibbles`: the first ``numel`` codes (all ``2 * packed.numel()`` by default), flat."""
    flat = packed.reshape(-1)
    codes = torch.stack((flat >> 4, flat & 15), dim=1).view(-1)
    return codes if numel is None else codes[:numel]


_DEVICE_TABLES: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}


def on_device(table: Tensor, device: torch.device) -> Tensor:
    """``table`` on ``device``: the formats' lookup tables are built once on the CPU and meet codes on any device, so
    each (table, device) pair is copied once and kept (with the original, so its id is never reused)."""
    if table.device == device:
        return table
    key = (id(table), device)
    if key not in _DEVICE_TABLES:
        _DEVICE_TABLES[key] = (table, to_device(table, device))
    return _DEVICE_TABLES[key][1]


def lookup(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for a small 1-D table and an int32/int64 index of any shape, on the index's device
    (index_select: much faster on CPU than advanced indexing)."""
    return torch.index_select(on_device(table, index.device), 0, index.reshape(-1)).view(index.shape)


def high_half(x: Tensor) -> Tensor:
    """The top 16 bits of each fp32 pattern of the contiguous ``x`` as int32 in [0, 65535] (a bf16-sized bucket)."""
    return (x.view(torch.int32) >> 16).bitwise_and_(0xFFFF)


class GridRounder:
    """Rounds fp32 values to a sorted grid with two small lookup tables instead of a binary search.

    Values are bucketed by the top 16 bits of their fp32 pattern (a bf16-sized bucket, relative width <= 2^-7). The
    grids used here are coarser than that, so a bucket holds at most one rounding boundary: the result is the code at
    the bucket's low end, plus one when x reaches the boundary inside it. This is exact (the boundaries are the exact
    fp32 thresholds) and runs as two table gathers and a compare.
    """

    def __init__(self, grid: Tensor) -> None:
        self.grid = grid.to(torch.float32)
        self.gaps = self.grid[1:] - self.grid[:-1]
        self.low, self.high = float(self.grid[0]), float(self.grid[-1])
        self.thresholds = nearest_thresholds(self.grid)
        self.nearest_base, self.nearest_step = self._tables(self.thresholds)
        self.floor_base, self.floor_step = self._tables(self.grid[1:-1])  # floor index in [0, len - 2]

    @staticmethod
    def _tables(boundaries: Tensor) -> tuple[Tensor, Tensor]:
        """Per bucket: the number of boundaries <= the bucket's smallest value, and the one boundary inside (or inf)."""
        patterns = torch.arange(1 << 16, dtype=torch.int32) << 16
        first = patterns.view(torch.float32)  # value of the bucket's pattern with low bits 0
        last = (patterns | 0xFFFF).view(torch.float32)  # ... with low bits 1
        low = torch.minimum(first, last)  # the smallest value in the bucket (negative buckets run backwards)
        high = torch.maximum(first, last)
        base = torch.bucketize(low, boundaries, right=True)
        inside = torch.bucketize(high, boundaries, right=True) - base
        finite = torch.isfinite(low) & torch.isfinite(high)
        if (inside[finite] > 1).any() or boundaries.numel() > 255:
            raise ValueError("grid too fine for 16-bit bucket tables, or more than 256 codes")
        nxt = boundaries[base.clamp(max=boundaries.numel() - 1)]
        step = torch.where(inside >= 1, nxt, torch.full_like(nxt, float("inf")))
        return base.to(torch.uint8), step

    @staticmethod
    def _lookup(x: Tensor, base: Tensor, step: Tensor) -> Tensor:
        bucket = high_half(x)
        return lookup(base, bucket).add_(x >= lookup(step, bucket))

    def __call__(self, x: Tensor, noise: Tensor | None) -> Tensor:
        """Grid index (uint8) of each element of the contiguous fp32 ``x``. Nearest (``noise`` None): torchao's rule.
        Stochastic: the upper neighbour with probability (x - lo) / (hi - lo), drawn from ``noise`` (see
        :meth:`StateFormat.quantize_with_noise`), unbiased for x inside [grid[0], grid[-1]] (values outside are
        clamped to the ends)."""
        x = x.contiguous()
        if noise is None:
            return self._lookup(x, self.nearest_base, self.nearest_step)
        x = x.clamp(self.low, self.high)
        lo = self._lookup(x, self.floor_base, self.floor_step)
        lo_index = lo.int()
        frac = x - lookup(self.grid, lo_index)
        return lo.add_(frac > uniform_from_bits(noise.reshape(x.shape)).mul_(lookup(self.gaps, lo_index)))


def round_up_blockwise(target: Tensor, qmap: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Block-wise codes into a sorted ``qmap`` (flat, one per element) and per-block absmax, with
    ``qmap[code] * absmax >= target`` for non-negative ``target`` (the smallest map entry at or above each value)."""
    flat = target.reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // block_size)
    padded = F.pad(flat, (0, blocks * block_size - n)).view(blocks, block_size)
    absmax = padded.abs().amax(dim=1)
    normalized = padded / torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)
    codes = torch.searchsorted(qmap.contiguous(), normalized.reshape(-1)).clamp_max(qmap.numel() - 1)
    return codes[:n].to(torch.uint8), absmax


def grid_spacing_table(values: Tensor) -> Tensor:
    """Ulp-convention spacing of every code of a code->value table (1-D): distance from |value| to the next larger
    representable magnitude, or to the next smaller one at the top of the range; at zero, the smallest magnitude."""
    values = values.to(torch.float64)
    magnitude = values.abs()
    mags = torch.unique(magnitude)  # sorted ascending
    upper = torch.searchsorted(mags, magnitude, right=True)
    top = upper == mags.numel()
    larger = mags[upper.clamp(max=mags.numel() - 1)] - magnitude
    smaller = magnitude - mags[(upper - 2).clamp(min=0)]
    table = torch.where(top, smaller, larger)
    return table.to(torch.float32)
