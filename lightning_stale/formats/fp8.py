"""FP8 E4M3 storage with one fp32 scale per tensor (the paper's FP8): codes = x / scale with scale = max|x| / 448."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_stale.formats.base import QuantizedState, StateFormat, lookup
from lightning_stale.formats.floats import float_ulp, stochastic_round_float

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_MANTISSA_BITS = 3
FP8_MIN_EXPONENT = -6
# Every code's fp32 value: a table gather is several times faster than torch's float8 -> fp32 cast on CPU.
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(torch.float32)


def fp8_to_float(codes: Tensor) -> Tensor:
    """fp32 values of float8_e4m3fn ``codes`` (same shape). Exact either way: the table in eager mode on the CPU, the
    cast on other devices and inside torch.compile (vectorized by Inductor, where a table gather is not)."""
    if torch.compiler.is_compiling() or codes.device.type != "cpu":
        return codes.to(torch.float32)
    return lookup(FP8_VALUES, codes.view(torch.uint8).int())


def e4m3_spacing(codes: Tensor) -> Tensor:
    """Ulp-convention spacing of unscaled float8_e4m3fn ``codes`` as fp32 (same shape); 448, the largest finite value,
    gets the gap below it."""
    return float_ulp(fp8_to_float(codes).abs(), FP8_MANTISSA_BITS, FP8_MIN_EXPONENT)


def round_up_fp8_blockwise(target: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """torchao's FP8 block layout (``e4m3fn`` codes, scale = block max / 448), rounding codes up."""
    blocks = target.reshape(-1, block_size).float()
    scale = blocks.abs().amax(dim=1).clip(1e-12) / FP8_MAX
    normalized = blocks / scale.unsqueeze(1)
    codes = normalized.to(FP8_DTYPE)
    bits = codes.view(torch.uint8)
    top = 0x7E  # 448, the largest finite e4m3fn value; the block maximum may exceed it by rounding, never bump past
    bumped = torch.where((codes.float() < normalized) & (bits < top), bits + 1, bits)
    return bumped.view(FP8_DTYPE).reshape(target.shape), scale


class Fp8E4M3Format(StateFormat):
    """``float8_e4m3fn`` codes scaled so the tensor's largest magnitude maps to 448."""

    name = "fp8_e4m3"
    bits = 8
    theory_name = "fp8_e4m3"

    def quantize_with_noise(self, x: Tensor, noise: Tensor | None) -> QuantizedState:
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
        # The quotient in fp64, then rounded to fp32: the correctly rounded fp32 quotient whether it is computed as a
        # division (eager on CPU) or as a product by the reciprocal (torch.compile on GPUs and on torch 2.6's CPU,
        # CUDA's eager division by a number), so compiled and eager steps store the same scale. An fp32 product is an
        # ulp off in about half the cases; the fp64 one is within 2^-28 ulp of the quotient, which lies at least 1/14
        # ulp from a rounding boundary (a 24-bit significand divided by 7).
        scale = (amax.double() / FP8_MAX).float().clamp(min=1e-12).reshape(1)
        scaled = (x / scale).clamp_(-FP8_MAX, FP8_MAX)
        if noise is not None:
            scaled = stochastic_round_float(scaled, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_MAX, noise)
        return QuantizedState(scaled.to(FP8_DTYPE), scale, x.shape)

    def dequantize(self, q: QuantizedState) -> Tensor:
        return (fp8_to_float(q.codes) * q.scale).reshape(q.shape)

    def spacing(self, q: QuantizedState) -> Tensor:
        return (e4m3_spacing(q.codes) * q.scale).reshape(q.shape)

    def empty(self, shape: torch.Size | tuple[int, ...]) -> QuantizedState:
        return QuantizedState(torch.zeros(shape, dtype=FP8_DTYPE), torch.zeros(1), torch.Size(shape))

    def bytes_per_element(self, numel: int) -> float:
        return 1.0 + 4.0 / max(numel, 1)

    def element_codes(self, q: QuantizedState) -> Tensor:
        """The stored bytes, one per element (equal iff the stored code is unchanged)."""
        return q.codes.view(torch.uint8).reshape(-1)

    def round_up_into(self, q: QuantizedState, target: Tensor) -> None:
        codes, scale = round_up_fp8_blockwise(target.reshape(-1), target.numel())
        q.codes.view(-1).copy_(codes.reshape(-1))
        q.scale.copy_(scale.reshape(q.scale.shape))
