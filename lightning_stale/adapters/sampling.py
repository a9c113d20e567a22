"""Fixed element samples of flat state tensors, read as strided views: no index tensor, no gather kernel.

A :class:`Sample` is either the whole tensor or ``count`` *runs* of ``RUN`` consecutive elements spaced ``stride``
apart. Runs keep the reads cache-friendly (one or two cache lines per run instead of one per element) and give every
sample of a batch the same 2-D shape ``(count, RUN)``, so the samples of many tensors concatenate in one op. The
stride is chosen coprime with the tensor's last dimension where possible, so runs walk across the columns of a weight
matrix; the offset comes from a hash of the parameter's key and a seed, so the sample is identical on every rank with
the same seed and after a resume. Layouts with two codes per byte are sampled in element *pairs* (``pairs=True``:
offsets, strides and runs count pairs, i.e. bytes of the packed codes).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

RUN = 32  # consecutive elements per run


@dataclass(frozen=True)
class Sample:
    """``count`` runs of ``run`` units at ``offset + k * stride``; ``run == 0`` means every unit (``count`` of them).
    A unit is an element, or with ``pairs`` the two elements ``(2 j, 2 j + 1)`` of one packed byte."""

    offset: int
    stride: int
    count: int
    run: int
    pairs: bool = False

    @property
    def full(self) -> bool:
        return self.run == 0

    @property
    def numel(self) -> int:
        """Sampled elements."""
        units = self.count if self.full else self.count * self.run
        return 2 * units if self.pairs else units

    def _strided(self, flat: Tensor, scale: int) -> Tensor:
        if self.full:
            return flat[: self.count * scale]
        return torch.as_strided(flat, (self.count, self.run * scale), (self.stride * scale, 1),
                                flat.storage_offset() + self.offset * scale)

    def view(self, tensor: Tensor) -> Tensor:
        """The sampled elements of ``tensor`` (any shape, read flat): 1-D for a full sample, else ``(count, run)``
        elements (``(count, 2 run)`` with pairs). A view of contiguous tensors."""
        if not self.full and tensor.is_contiguous():  # the hot path: no intermediate flat view
            scale = 2 if self.pairs else 1
            return torch.as_strided(tensor, (self.count, self.run * scale), (self.stride * scale, 1),
                                    tensor.storage_offset() + self.offset * scale)
        return self._strided(tensor.reshape(-1), 2 if self.pairs else 1)

    def byte_view(self, packed: Tensor) -> Tensor:
        """The sampled bytes of a two-codes-per-byte tensor (one byte per sampled pair)."""
        return self._strided(packed.reshape(-1), 1)

    def positions(self, device: torch.device | str | None = None) -> Tensor:
        """Flat int64 indices of the sampled elements, in view order (materialized only off the hot path)."""
        scale = 2 if self.pairs else 1
        if self.full:
            return torch.arange(self.count * scale, device=device)
        starts = torch.arange(self.count, device=device).mul_(self.stride * scale).add_(self.offset * scale)
        return (starts.unsqueeze(1) + torch.arange(self.run * scale, device=device)).reshape(-1)

    def prefix(self, elements: int) -> Sample:
        """The first runs (or elements) of this sample holding about ``elements`` elements."""
        scale = 2 if self.pairs else 1
        if self.full:
            return Sample(0, 1, min(self.count, max(1, elements // scale)), 0, self.pairs)
        return Sample(self.offset, self.stride, min(self.count, max(1, elements // (self.run * scale))), self.run,
                      self.pairs)


def choose_sample(key: str, shape: torch.Size, size: int | None, seed: int, pairs: bool = False) -> Sample:
    """A sample of about ``size`` elements of a tensor of ``shape``, in runs; every element when ``size`` is None or
    the tensor holds less than one run. A tensor of at most ``size`` elements is sampled in full runs from its start
    (a tail shorter than one run is left out, so every sample of a batch has the same 2-D shape)."""
    numel = math.prod(shape)
    scale = 2 if pairs else 1
    units = numel // scale
    if size is None or numel < RUN:
        return Sample(0, 1, units, 0, pairs)
    run = RUN // scale
    count = max(1, min(size // RUN, units // run))
    stride = units // count
    row = max(1, (shape[-1] if len(shape) else 1) // scale)
    while stride > run and math.gcd(stride, row) > 1:  # walk across columns; shrinking keeps the runs in bounds
        stride -= 1
    offset = zlib.crc32(f"{seed}:{key}".encode()) % (stride - run + 1)
    return Sample(offset, stride, count, run, pairs)
