"""The 8-bit dynamic-exponent map of bitsandbytes and torchao, block-wise absmax scaling (block 256).

Codes index a 256-entry map (signed for m, unsigned for v); the value is ``map[code] * absmax[block]``. Nearest
rounding reproduces torchao's quantizer (and bitsandbytes' CUDA kernel) exactly.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from lightning_stale.formats.base import (
    GridRounder,
    QuantizedState,
    StateFormat,
    as_blocks,
    lookup,
    grid_spacing_table,
    num_blocks,
)

BLOCK_SIZE = 256


@lru_cache(maxsize=2)
def _dynamic_map(signed: bool) -> Tensor:
    # Same arithmetic as bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8).
    data: list[float] = []
    max_exponent_bits, non_sign_bits = 7, 7
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def dynamic_map(signed: bool) -> Tensor:
    """The 256 fp32 map values, sorted (bitsandbytes ``create_dynamic_map(signed)``); a fresh copy."""
    return _dynamic_map(bool(signed)).clone()


@lru_cache(maxsize=2)
def _rounder(signed: bool) -> GridRounder:
    return GridRounder(_dynamic_map(signed))


def spacing_from_codes(codes: Tensor, absmax: Tensor, qmap: Tensor, block_size: int = BLOCK_SIZE) -> Tensor:
    """Absolute ulp-convention spacing of stored 8-bit codes (any layout: bitsandbytes ``state1``/``absmax1``, torchao
    ``codes``/``scale``), fp32 with the codes' shape; no re-quantization."""
    table = grid_spacing_table(qmap.detach().float().cpu()).to(codes.device)
    flat = codes.reshape(-1).long()
    spacing = as_blocks(table[flat], block_size) * absmax.reshape(-1, 1).float()
    return spacing.reshape(-1)[: flat.numel()].reshape(codes.shape)


class Int8DynamicFormat(StateFormat):
    """uint8 codes into the dynamic map, one fp32 absmax per block of 256."""

    name = "int8_dynamic"
    bits = 8
    block_size = BLOCK_SIZE
    table_rounded = True

    def __init__(self, signed: bool) -> None:
        super().__init__(signed)
        # Built here, not on first use: a table built inside a torch.compile'd step would be traced into it.
        self._map = _dynamic_map(self.signed)
        self._rounder = _rounder(self.signed)

    def quantize_with_noise(self, x: Tensor, noise: Tensor | None) -> QuantizedState:
        blocks = as_blocks(x.reshape(-1), BLOCK_SIZE)
        scale = blocks.abs().amax(dim=1).clamp_(min=1e-12)  # torchao's scale
        normalized = blocks / scale.view(-1, 1)
        if noise is not None:
            noise = as_blocks(noise.reshape(-1), BLOCK_SIZE)
        codes = self._rounder(normalized, noise)
        return QuantizedState(codes.view(-1)[: x.numel()].view(x.shape), scale, x.shape)

    def dequantize(self, q: QuantizedState) -> Tensor:
        qmap = self._map
        values = as_blocks(lookup(qmap, q.codes.reshape(-1).int()), BLOCK_SIZE) * q.scale.view(-1, 1)
        return values.view(-1)[: q.codes.numel()].view(q.shape)

    def spacing(self, q: QuantizedState) -> Tensor:
        return spacing_from_codes(q.codes, q.scale, self._map, BLOCK_SIZE).reshape(q.shape)

    def empty(self, shape: torch.Size | tuple[int, ...]) -> QuantizedState:
        shape = torch.Size(shape)
        codes = torch.full(shape, self.zero_code(), dtype=torch.uint8)
        return QuantizedState(codes, torch.zeros(num_blocks(shape.numel(), BLOCK_SIZE), dtype=torch.float32), shape)

    def bytes_per_element(self, numel: int) -> float:
        return 1.0 + 4.0 * num_blocks(numel, BLOCK_SIZE) / max(numel, 1)

    def zero_code(self) -> int:
        return 127 if self.signed else 0

    def element_codes(self, q: QuantizedState) -> Tensor:
        """The uint8 codes, flat."""
        return q.codes.reshape(-1)

    def grid(self) -> Tensor:
        """The 256 map values (:func:`dynamic_map`), shared."""
        return self._map
