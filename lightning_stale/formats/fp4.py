"""4-bit float states with block-wise absmax scaling (block 128), two codes packed per byte (the paper's FP4).

- signed (first moment): E2M1, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} / 6, code = sign bit (8) | magnitude index;
  an exact zero is always stored as code 0 (never -0).
- unsigned (second moment): E2M2 without a zero point (Li et al. 2023): all four exponent fields are normal, values
  {1, 1.25, ..., 1.75} * 2^e for e = 0..3, i.e. {1 ... 14} / 14, code = index in that sorted list. The relative gap is
  2^-2 to 2^-3 everywhere; values below 1/14 of the block max round up to the smallest code.
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
    pack_nibbles,
    unpack_nibbles,
)

BLOCK_SIZE = 128
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M2_NO_ZERO = tuple((1 + f / 4) * 2**e for e in range(4) for f in range(4))  # 1 ... 14


@lru_cache(maxsize=2)
def _tables(signed: bool) -> tuple[GridRounder, Tensor, Tensor]:
    """(rounder onto the magnitude grid, code -> normalized value, code -> normalized spacing)."""
    if signed:
        grid = torch.tensor(E2M1_MAGNITUDES) / 6.0
        values = torch.cat([grid, -grid])
    else:
        grid = torch.tensor(E2M2_NO_ZERO) / 14.0
        values = grid.clone()
    return GridRounder(grid), values, grid_spacing_table(values)


class Fp4Format(StateFormat):
    """E2M1 (signed) or zero-free E2M2 (unsigned) codes, one fp32 absmax per block of 128."""

    name = "fp4"
    bits = 4
    block_size = BLOCK_SIZE
    table_rounded = True

    def __init__(self, signed: bool) -> None:
        super().__init__(signed)
        # Built here, not on first use: a table built inside a torch.compile'd step would be traced into it.
        self._rounder, self._values, self._spacings = _tables(self.signed)
        self.theory_name = "fp4_e2m1" if self.signed else "fp4_e2m2"

    def quantize_with_noise(self, x: Tensor, noise: Tensor | None) -> QuantizedState:
        rounder = self._rounder
        if noise is not None:
            noise = as_blocks(noise.reshape(-1), BLOCK_SIZE)
        blocks = as_blocks(x.reshape(-1), BLOCK_SIZE)
        scale = blocks.abs().amax(dim=1).clamp_(min=1e-12)
        normalized = blocks / scale.view(-1, 1)
        if self.signed:
            codes = rounder(normalized.abs(), noise)
            codes = codes | ((normalized < 0) & (codes > 0)).to(torch.uint8) << 3
        else:
            codes = rounder(normalized, noise)
        packed = pack_nibbles(codes.view(-1))
        return QuantizedState(packed[: (x.numel() + 1) // 2].clone(), scale, x.shape)

    def element_codes(self, q: QuantizedState) -> Tensor:
        """The 4-bit codes unpacked, one uint8 per element, flat."""
        return unpack_nibbles(q.codes, q.shape.numel())

    def pack_codes(self, codes: Tensor) -> Tensor:
        """Two codes per byte (an odd count padded with a zero code)."""
        return pack_nibbles(torch.cat([codes, codes.new_zeros(codes.numel() % 2)]))

    def grid(self) -> Tensor:
        """The 16 values of the codes, by code (sign bit 8 for the signed variant)."""
        return self._values

    def _per_code(self, q: QuantizedState, table: Tensor) -> Tensor:
        numel = q.shape.numel()
        normalized = lookup(table, self.element_codes(q).int())
        return (as_blocks(normalized, BLOCK_SIZE) * q.scale.view(-1, 1)).view(-1)[:numel].view(q.shape)

    def dequantize(self, q: QuantizedState) -> Tensor:
        return self._per_code(q, self._values)

    def spacing(self, q: QuantizedState) -> Tensor:
        return self._per_code(q, self._spacings)

    def empty(self, shape: torch.Size | tuple[int, ...]) -> QuantizedState:
        shape = torch.Size(shape)
        packed = torch.zeros((shape.numel() + 1) // 2, dtype=torch.uint8)
        return QuantizedState(packed, torch.zeros(num_blocks(shape.numel(), BLOCK_SIZE), dtype=torch.float32), shape)

    def bytes_per_element(self, numel: int) -> float:
        return ((numel + 1) // 2 + 4.0 * num_blocks(numel, BLOCK_SIZE)) / max(numel, 1)

    def zero_code(self) -> int | None:
        return 0 if self.signed else None
