"""Plain floating-point state formats: fp32 (the reference, no rounding), bf16 and fp16 (no scale)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_stale.formats.base import QuantizedState, StateFormat
from lightning_stale.formats.noise import NOISE_BITS


def float_ulp(a: Tensor, mantissa_bits: int, min_exponent: int) -> Tensor:
    """Spacing of a binary float grid at magnitudes ``a`` (fp32, >= 0): 2^(max(e, emin) - p) where a = m * 2^e, m in
    [1, 2). This is the distance to the next larger magnitude (and, below the top binade boundary, to the next
    smaller one); at 0 it is the smallest subnormal. Built from the exponent bits (integer ops vectorize on CPU)."""
    exponent = (a.view(torch.int32) >> 23).sub_(127).clamp_(min=min_exponent)  # fp32 zero/subnormal -> clamped
    biased = exponent.sub_(mantissa_bits - 127)  # biased fp32 exponent of the spacing
    normal = (biased.clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(biased) << (biased + 22).clamp_(min=0, max=22)).view(torch.float32)
    return torch.where(biased >= 1, normal, subnormal)


def stochastic_round_float(
    x: Tensor, mantissa_bits: int, min_exponent: int, max_value: float, noise: Tensor
) -> Tensor:
    """Round fp32 ``x`` to a float grid (p mantissa bits, min normal exponent, saturating at ``max_value``) with
    stochastic rounding driven by ``noise`` (int32 in [0, 2^NOISE_BITS)): away from zero with probability
    (|x| - lower) / ulp. Returns fp32 values on the grid.

    Adds the noise below the kept mantissa bits of the fp32 pattern and truncates them. Subnormals of the target
    grid (|x| < 2^emin, spacing 2^(emin - p)) are shifted by 2^emin into the lowest normal binade, which has the same
    spacing, rounded there and shifted back (exact up to the fp32 rounding of the shift, 2^-24 relative)."""
    dropped = 23 - mantissa_bits
    shift = dropped - NOISE_BITS
    offset = 2.0**min_exponent
    a = x.abs().clamp_(max=max_value)
    small = a < offset
    shifted = torch.where(small, a + offset, a)
    bits = noise.reshape(x.shape) << shift if shift >= 0 else noise.reshape(x.shape) >> -shift
    rounded = (shifted.view(torch.int32) + bits).bitwise_and_(-(1 << dropped)).view(torch.float32)
    return torch.copysign(torch.where(small, rounded - offset, rounded), x)


def nearest_on_grid(x: Tensor, dtype: torch.dtype) -> Tensor:
    """fp32 ``x`` rounded to the nearest value of ``dtype`` (bf16 or fp16; ties to even), still in fp32: the bits of
    ``x.to(dtype).float()`` for every input (subnormals, overflow to inf, inf, NaN), computed with integer ops on the
    fp32 bit pattern, so a compiler cannot fold the round trip away (Inductor drops an fp32 -> bf16/fp16 -> fp32 cast
    pair unless told to emulate casts, which slows every kernel, and some versions drop it for fp16 even then)."""
    bits = x.view(torch.int32)
    if dtype == torch.bfloat16:
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).view(torch.float32)
        # a NaN stays one (adding to its bits could make it inf); x != x vectorizes where Inductor scalarizes isnan
        return torch.where(x != x, x, rounded)  # noqa: PLR0124 - the NaN test
    return _nearest_fp16(bits)


def _nearest_fp16(bits: Tensor) -> Tensor:
    """The fp32 bit patterns ``bits`` (int32) rounded to the nearest fp16 value (ties to even), as fp32 values: what
    torch's cast pair gives; a NaN stays a NaN (quieted, its low 13 payload bits dropped, as the cast's vector code
    does)."""
    magnitude = bits & 0x7FFFFFFF
    sign = bits & -0x80000000
    # normal fp16 range: keep 10 mantissa bits, round the 13 dropped ones to nearest even (a carry moves the exponent)
    normal = (magnitude + (0xFFF + ((magnitude >> 13) & 1))) & -8192
    # subnormal fp16 range (|x| < 2^-14): the multiple q of 2^-24 nearest to the 24-bit significand times 2^(e - 126),
    # with the shift clamped (every element computes both ranges; smaller values all round to 0, 2^-25 a tie to 0)
    shift = (126 - (magnitude >> 23)).clamp_(14, 25)
    significand = (magnitude & 0x7FFFFF) | 0x800000
    q = (significand + ((1 << (shift - 1)) - 1) + ((significand >> shift) & 1)) >> shift
    subnormal = (q.to(torch.float32) * 2.0**-24).view(torch.int32)  # exact: q <= 1024
    finite = torch.where(magnitude < 0x38800000, subnormal, torch.where(magnitude < 0x477FF000, normal, 0x7F800000))
    nan = (magnitude | 0x400000) & -8192  # as the cast quiets a NaN: top 10 payload bits kept
    return (torch.where(magnitude > 0x7F800000, nan, finite) | sign).view(torch.float32)


def on_grid(x: Tensor, dtype: torch.dtype, noise: Tensor) -> Tensor:
    """fp32 ``x`` stochastically rounded onto the grid of ``dtype`` (bf16 or fp16), still in fp32 (the caller's copy
    into ``dtype`` is then exact), saturating at its largest finite value; ``noise``: int32 in [0, 2^NOISE_BITS)
    shaped like ``x``. bf16 adds the noise below its mantissa in the fp32 bit pattern and truncates (torchao's
    ``_fp32_to_bf16_sr``); fp16 goes through :func:`stochastic_round_float` for its subnormals."""
    # the largest finite value, read here: torch.compile folds it, where a module-level float becomes a graph input
    top = torch.finfo(dtype).max
    if dtype == torch.bfloat16:
        # bf16 drops 16 bits, NOISE_BITS of noise: shift only where they differ (a shift by 0 is an op per element)
        bits = x.clamp(-top, top).view(torch.int32) + (noise if NOISE_BITS == 16 else noise >> (NOISE_BITS - 16))
        return (bits & -65536).view(torch.float32)
    return stochastic_round_float(x, 10, -14, top, noise)


def round_up_float(target: Tensor, dtype: torch.dtype) -> Tensor:
    """``target`` (non-negative fp32) cast to ``dtype``, bumped one ulp where the cast rounded down."""
    cast = target.to(dtype)
    low = cast.float() < target
    return torch.where(low, torch.nextafter(cast, torch.full_like(cast, float("inf"))), cast)


class FloatFormat(StateFormat):
    """A native torch float dtype used as storage, saturating at its largest finite value."""

    dtype: torch.dtype
    mantissa_bits: int
    min_exponent: int

    def __init__(self, signed: bool) -> None:
        super().__init__(signed)
        self.max_value = float(torch.finfo(self.dtype).max)

    def quantize_with_noise(self, x: Tensor, noise: Tensor | None) -> QuantizedState:
        return QuantizedState(self._round(x, noise), None, x.shape)

    def _round(self, x: Tensor, noise: Tensor | None) -> Tensor:
        if noise is None:
            return x.clamp(-self.max_value, self.max_value).to(self.dtype)
        rounded = stochastic_round_float(x, self.mantissa_bits, self.min_exponent, self.max_value, noise)
        return rounded.to(self.dtype)

    def dequantize(self, q: QuantizedState) -> Tensor:
        return q.codes.to(torch.float32, copy=True).reshape(q.shape)

    def spacing(self, q: QuantizedState) -> Tensor:
        return float_ulp(self.dequantize(q).abs(), self.mantissa_bits, self.min_exponent)

    def empty(self, shape: torch.Size | tuple[int, ...]) -> QuantizedState:
        return QuantizedState(torch.zeros(shape, dtype=self.dtype), None, torch.Size(shape))

    def bytes_per_element(self, numel: int) -> float:
        return float(self.bits // 8)

    def element_codes(self, q: QuantizedState) -> Tensor:
        """The stored bit patterns as integers, one per element (equal iff the stored value is unchanged)."""
        int_dtype = {32: torch.int32, 16: torch.int16, 8: torch.uint8}[self.bits]
        return q.codes.view(int_dtype).reshape(-1)

    def round_up_into(self, q: QuantizedState, target: Tensor) -> None:
        q.codes.view(-1).copy_(round_up_float(target, q.codes.dtype))


class Fp32Format(FloatFormat):
    """fp32 storage: the reference, stores values unchanged."""

    name = "fp32"
    bits = 32
    dtype = torch.float32
    mantissa_bits = 23
    min_exponent = -126

    def _round(self, x: Tensor, noise: Tensor | None) -> Tensor:
        return x.clone()


class Bf16Format(FloatFormat):
    """bfloat16 storage (8 exponent bits, 7 mantissa bits, same range as fp32)."""

    name = "bf16"
    bits = 16
    theory_name = "bf16"
    dtype = torch.bfloat16
    mantissa_bits = 7
    min_exponent = -126

    def _round(self, x: Tensor, noise: Tensor | None) -> Tensor:
        if noise is None:
            return x.to(torch.bfloat16)
        return on_grid(x, torch.bfloat16, noise.reshape(x.shape)).to(torch.bfloat16)


class Fp16Format(FloatFormat):
    """IEEE half storage (5 exponent bits, 10 mantissa bits, max 65504; saturates instead of overflowing)."""

    name = "fp16"
    bits = 16
    theory_name = "fp16"
    dtype = torch.float16
    mantissa_bits = 10
    min_exponent = -14

