"""What the engine tracks of one optimizer: a :class:`TrackedParam` per parameter with state, an :class:`Entry` per
slot, and the one rule that picks the slot driving a parameter's decisions."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_stale._compat import local_tensor
from lightning_stale.adapters.layouts import FLOAT_FORMATS, FloatSlot
from lightning_stale.adapters.protocol import Slot
from lightning_stale.adapters.sampling import Sample
from lightning_stale.vocab import WEIGHT

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)  # weights whose writes can round an update away
WEIGHT_KEY = "weight"  # the slot key of a measured weight (per-parameter logs: <prefix>/<param>/weight/frac)


@dataclass(eq=False)
class TrackedParam:
    """A parameter with optimizer state, as the engine measures it: its slots share one sample and are reset
    together."""

    key: str  # <prefix>.<index of the parameter in the optimizer's param groups>
    position: int  # its place in the engine's list of tracked parameters, and its row in the ledger's arrays
    param: Tensor
    sample: Sample
    numel: int  # elements of this process's shard (all of the parameter unless it is a DTensor)
    entries: list[Entry] = field(default_factory=list)

    @property
    def slots(self) -> list[Slot]:
        return [e.slot for e in self.entries]

    def grad_view(self, sample: Sample, placeholders: dict) -> Tensor:
        """The gradient at ``sample`` (a view of this process's shard), or NaN (never counted) when the step had no
        dense gradient."""
        grad = local_tensor(self.param.grad)
        if grad is None or grad.is_sparse or grad.numel() != self.numel:
            key = (sample, self.param.device)
            if key not in placeholders:
                shape = sample.view(torch.empty(self.numel, device="meta")).shape
                placeholders[key] = torch.full(shape, math.nan, dtype=torch.float32, device=self.param.device)
            return placeholders[key]
        return sample.view(grad)


@dataclass(eq=False)
class Entry:
    """A tracked slot: its row in the engine's per-slot arrays and its parameter."""

    key: str
    row: int
    unit: TrackedParam
    slot: Slot

    @property
    def moment(self) -> str:
        return self.slot.moment


def weight_slot(param: Tensor) -> Slot | None:
    """The parameter's stored weight as a slot (its codes are the raw bits of this process's shard) where it is stored
    below fp32; None for fp32 weights, which are not measured."""
    shard = local_tensor(param)
    if shard.dtype not in LOW_PRECISION_DTYPES:
        return None
    return FloatSlot(param, WEIGHT, None, FLOAT_FORMATS[shard.dtype], WEIGHT_KEY, tensor=shard)  # type: ignore[arg-type]


def driver_slot(slots: Iterable[Slot]) -> Slot | None:
    """The slot whose staleness drives a parameter's decisions: its second moment when it has one, else its first."""
    by_moment = {s.moment: s for s in slots}
    return by_moment.get("v") or by_moment.get("m")


def driver_group(unit: TrackedParam) -> tuple[str, str, float | None]:
    """(moment, format, beta) of a parameter's driver slot: parameters of one group share a drift reading, measured on
    the panel parameters of that group."""
    slot = driver_slot(unit.slots)
    return slot.moment, slot.format, slot.beta
