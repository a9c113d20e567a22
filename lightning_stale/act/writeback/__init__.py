"""The weight write-back: the step of bf16/fp16 parameters computed in fp32 and their weights written exactly.

:class:`WeightWriteBack` (the hooks, the choice, the buffers, the checkpoints) runs one :class:`Family` per optimizer
family (``families/``, one file each, found by :func:`family_for`) over the shared kernels of :mod:`.kernels`.
:func:`writeback_for` turns the monitors' ``weights`` option and the automatic remedy into a write-back.
"""

from __future__ import annotations

import torch

from lightning_stale.act.writeback.family import Columns, Family, Member, Write, family_for, register_family, supported
from lightning_stale.act.writeback.writeback import LOW_PRECISION, WeightWriteBack
from lightning_stale.adapters import inner_optimizer

__all__ = ["Columns", "Family", "LOW_PRECISION", "Member", "WeightWriteBack", "Write", "family_for",
           "register_family", "supported", "writeback_for"]


def writeback_for(optimizer: torch.optim.Optimizer, weights: str | None, auto: bool) -> WeightWriteBack | None:
    """The write-back a monitor attaches for its ``weights`` option: that rounding on every parameter stored below
    fp32 (``"<rounding>+moments"``: with the moments it writes in the parameter's dtype rounded stochastically too);
    with the automatic remedy and no choice (``None``), compensated summation on no parameter yet (the remedy chooses),
    with stochastic rounding of such moments. None where no parameter is stored below fp32, where ``weights="off"``,
    and where the automatic remedy meets an optimizer the write-back does not support (a ``weights`` choice there is
    a configuration error)."""
    optimizer = inner_optimizer(optimizer)  # type: ignore[assignment]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if weights == "off" or not any(p.dtype in LOW_PRECISION for p in params):
        return None
    if weights is not None:
        rounding, _, moments = weights.partition("+")
        try:
            return WeightWriteBack(optimizer, rounding, moments="stochastic" if moments else "nearest")
        except ValueError as error:
            raise ValueError(f"`weights`={weights!r}: {error}") from error
    family = family_for(optimizer)
    if not auto or family is None or family.refusal() is not None:
        return None
    moments = "stochastic" if "stochastic" in family.moment_roundings else "nearest"
    return WeightWriteBack(optimizer, "compensated", params=(), moments=moments)
