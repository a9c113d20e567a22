"""The bitsandbytes slot layout, read by the live adapter and the saved-state reader alike (no bitsandbytes import).

Flat keys of ``optimizer.state[p]``: ``state1``/``state2`` (uint8 codes, or float32 for parameters below
``min_8bit_size`` or with an ``optim_bits=32`` override), ``absmax1``/``absmax2`` (one scale per block),
``qmap1``/``qmap2`` (the value maps). AdEMAMix stacks its fast and slow EMA in ``state1`` (and ``absmax1``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_stale.adapters.layouts import BlockQmapSlot, FloatSlot
from lightning_stale.adapters.protocol import Moment, Slot

BLOCK = 256  # elements per absmax of the live optimizers

# kernel name -> ((state key, index into state1 or None, moment, betas index or None), ...)
LAYOUTS: dict[str, tuple[tuple[str, int | None, Moment, int | None], ...]] = {
    "adam": (("state1", None, "m", 0), ("state2", None, "v", 1)),
    "lamb": (("state1", None, "m", 0), ("state2", None, "v", 1)),
    "ademamix": (("state1", 0, "m", 0), ("state1", 1, "m", 2), ("state2", None, "v", 1)),
    "lion": (("state1", None, "m", 1),),
    "momentum": (("state1", None, "m", None),),
    "lars": (("state1", None, "m", None),),
    "rmsprop": (("state1", None, "v", 0),),
    "adagrad": (("state1", None, "v", None),),
}


def two_state_layout(state1: Tensor, state2: Tensor) -> tuple[tuple[str, int | None, Moment, int | None], ...]:
    """The layout of a two-state optimizer from its tensors alone (a saved state does not name its kernel): AdEMAMix
    where ``state1`` holds two EMAs, else Adam's (AdamW and LAMB store the same)."""
    return LAYOUTS["ademamix"] if state1.numel() == 2 * state2.numel() else LAYOUTS["adam"]


def slot(param: Tensor, state: dict, key: str, half: int | None, moment: Moment, beta: float | None,
         block_size: int | Callable[[int, int], int] = BLOCK) -> Slot:
    """The slot over ``state[key]`` (its row ``half`` for AdEMAMix's stacked ``state1``): 8-bit codes into the map
    with one scale per ``block_size`` elements (or a function of (code count, scale count) where the state does not
    say), or float32 values."""
    stored = state[key] if half is None else state[key][half]
    name = key if half is None else f"{key}[{half}]"
    if stored.dtype != torch.uint8:
        return FloatSlot(param, moment, beta, "fp32", name, tensor=stored)
    n = key[-1]
    scale = state[f"absmax{n}"] if half is None else state[f"absmax{n}"][half]
    if callable(block_size):
        scale = scale.reshape(-1)
        block_size = block_size(stored.numel(), scale.numel())
    return BlockQmapSlot(param, moment, beta, "int8_dynamic", name, stored=stored, scale=scale,
                         qmap=state[f"qmap{n}"], block_size=block_size)
