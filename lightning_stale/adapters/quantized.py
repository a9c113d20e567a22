"""Adapter for :class:`lightning_stale.optim.QuantizedAdamW`: per-moment ages (exact asymmetric resets).

Moments: ``exp_avg`` -> m (beta1), ``exp_avg_sq`` -> v (beta2), each in the format the optimizer reports
(``moment_format``); the slots read the optimizer's own tensors (``moment_state``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_stale.adapters.base import (
    MOMENTS,
    BlockFp8Slot,
    BlockQmapSlot,
    FloatSlot,
    Moment,
    OptimizerAdapter,
    Packed4bitSlot,
    Slot,
    resolve_moments,
)
from lightning_stale.formats import QuantizedState, StateFormat
from lightning_stale.formats.fp4 import pack
from lightning_stale.formats.int8_dynamic import BLOCK_SIZE as INT8_BLOCK
from lightning_stale.formats.int8_dynamic import dynamic_map
from lightning_stale.optim import QuantizedAdamW

KEYS = {"m": "exp_avg", "v": "exp_avg_sq"}
FP4_BLOCK = 128


def fp4_values(fmt: StateFormat) -> Tensor:
    """The 16 values of the format's 4-bit codes (scale 1), by code."""
    codes = torch.arange(16, dtype=torch.uint8)
    return fmt.dequantize(QuantizedState(pack(codes), torch.ones(1), torch.Size([16])))


def format_slot(p: Tensor, moment: Moment, beta: float, fmt: StateFormat, q: QuantizedState) -> Slot:
    """A slot over one stored moment, using the slot layout that matches the format's storage."""
    common = dict(signal="g" if moment == "m" else "g2")
    key = KEYS[moment]
    if fmt.name == "int8_dynamic":
        return BlockQmapSlot(p, moment, beta, fmt.name, key, stored=q.codes, scale=q.scale,
                             qmap=dynamic_map(fmt.signed), block_size=INT8_BLOCK, **common)
    if fmt.name == "fp4":
        return Packed4bitSlot(p, moment, beta, fmt.name, key, stored=q.codes, scale=q.scale, qmap=fp4_values(fmt),
                              block_size=FP4_BLOCK, **common)
    if fmt.name == "fp8_e4m3":  # one scale for the whole tensor
        return BlockFp8Slot(p, moment, beta, fmt.name, key, stored=q.codes, scale=q.scale,
                            block_size=q.codes.numel(), **common)
    if q.scale is None:
        return FloatSlot(p, moment, beta, fmt.name, key, tensor=q.codes, **common)
    raise TypeError(f"QuantizedAdamW adapter: no slot layout for state format {fmt.name!r}")


class QuantizedAdamWAdapter(OptimizerAdapter):
    """Exact per-moment resets through ``reset_moments``."""

    family = "lightning_stale"
    exact_moment_reset = True

    def slots(self) -> list[Slot]:
        out: list[Slot] = []
        for group, p, _ in self.stepped():
            for moment, beta in zip(MOMENTS, group["betas"]):
                fmt = self.optimizer.moment_format(p, moment)
                out.append(format_slot(p, moment, beta, fmt, self.optimizer.moment_state(p, moment)))
        return out

    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        chosen = resolve_moments(moments)
        self.optimizer.reset_moments(tuple(m for m in MOMENTS if m in chosen), params)


ADAPTERS = {QuantizedAdamW: QuantizedAdamWAdapter}
