"""Fixed element samples of flat state tensors, taken as strided views: no index tensor, no gather kernel.

A :class:`Sample` is a systematic (lattice) sample ``offset + k * stride``. The stride is coprime with twice the
tensor's last dimension, so the sample walks through every column of a weight matrix and every position inside the
256- or 128-element blocks of 8-bit/4-bit states; the offset comes from a hash of the parameter's key and a seed, so
the sample is identical on every rank with the same seed and after a resume. Layouts that pack two codes per byte are
sampled by element *pairs* (the two elements of one byte).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sample:
    """Elements ``offset + k * stride`` for ``k < count`` of a flat tensor; with ``pairs`` the element pairs
    ``(2 j, 2 j + 1)`` for ``j = offset + k * stride``."""

    offset: int
    stride: int
    count: int
    pairs: bool = False

    @property
    def numel(self) -> int:
        """Sampled elements."""
        return 2 * self.count if self.pairs else self.count

    def _slice(self) -> slice:
        return slice(self.offset, self.offset + self.stride * (self.count - 1) + 1, self.stride)

    def view(self, tensor: Tensor) -> Tensor:
        """The sampled elements of ``tensor`` (any shape, read flat), 1-D: a view where the layout allows."""
        flat = tensor.reshape(-1)
        if not self.pairs:
            return flat[self._slice()]
        return flat[: 2 * (flat.numel() // 2)].view(-1, 2)[self._slice()].reshape(-1)

    def byte_view(self, packed: Tensor) -> Tensor:
        """The sampled bytes of a two-codes-per-byte tensor (one byte per sampled pair)."""
        return packed.reshape(-1)[self._slice()]

    def positions(self, device: torch.device | str | None = None) -> Tensor:
        """Flat int64 indices of the sampled elements (materialized only off the hot path)."""
        starts = torch.arange(self.count, device=device, dtype=torch.int64).mul_(self.stride).add_(self.offset)
        if not self.pairs:
            return starts
        return torch.stack([2 * starts, 2 * starts + 1], dim=1).reshape(-1)

    def prefix(self, count: int) -> Sample:
        """The first ``count`` units of this sample (the drift shadows use a prefix of the stall sample)."""
        return Sample(self.offset, self.stride, min(count, self.count), self.pairs)


def choose_sample(key: str, shape: torch.Size, size: int | None, seed: int, pairs: bool = False) -> Sample:
    """A sample of about ``size`` units (elements, or pairs when ``pairs``) of a tensor of ``shape``; every unit when
    ``size`` is None or the tensor is not larger."""
    numel = math.prod(shape)
    units = numel // 2 if pairs else numel
    if size is None or units <= size:
        return Sample(0, 1, units, pairs)
    last = (shape[-1] // 2 if pairs else shape[-1]) if len(shape) else 1
    stride = -(-units // size)
    while math.gcd(stride, 2 * max(1, last)) != 1:
        stride += 1
    offset = zlib.crc32(f"{seed}:{key}".encode()) % stride
    return Sample(offset, stride, -(-(units - offset) // stride), pairs)
