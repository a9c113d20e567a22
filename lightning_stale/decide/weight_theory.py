"""The theory of stale weights: a weight stored below fp32 keeps its value when its update is under half its grid gap
(about |w| / 256 for bf16). Adam's update is about lr per element (``|m_hat| / (sqrt(v_hat) + eps) <~ 1``), so at
learning rate lr the weights whose half gap exceeds lr stall, and as lr decays the threshold sweeps over more of them.

Everything here reads a parameter's sampled elements (its weight slot and, for the predicted stall, its moment slots)
and returns device-resident sums; the caller reads them back on the steps that report (fit start, logging steps).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_stale.adapters.protocol import Slot
from lightning_stale.adapters.sampling import Sample


@torch.no_grad()
def _sampled(slot: Slot, sample: Sample) -> tuple[Tensor, Tensor]:
    """The sampled stored weights (fp32) and their grid gaps."""
    index = sample.positions(slot.param.device)
    return slot.value_at(index), slot.spacing_at(index)


def threshold(slot: Slot, sample: Sample, lr: float) -> Tensor:
    """(elements whose half grid gap exceeds ``lr``, elements, the median half gap) of the sampled weights, a
    float64 3-vector on the device: the first two give the share whose Adam update of about lr rounds away with
    nearest rounding, the last the lr below which the median weight stops moving (nan for an empty shard)."""
    _, gap = _sampled(slot, sample)
    half = gap.double() / 2
    stop = half.median() if half.numel() else torch.tensor(float("nan"), dtype=torch.float64, device=half.device)
    return torch.stack([(half > lr).sum().double(), half.new_tensor(float(half.numel())), stop])


@torch.no_grad()
def predicted_stall(weight: Slot, m: Slot, v: Slot, sample: Sample, group: dict[str, Any], step: Tensor | int,
                    decoupled: bool, stochastic: bool) -> Tensor:
    """(predicted stalls, elements) of the sampled weights at this state, a float64 2-vector: the Adam update
    ``lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)`` from the optimizer's own moments and group, against half the grid
    gap (nearest rounding: the weight keeps its value below it) or, with ``stochastic`` rounding or compensated
    summation, the chance ``1 - |update| / gap`` that it keeps its value this step. Elements whose m is zero (no
    gradient yet) are left out, as the measured stall leaves out zero gradients. ``step``: the optimizer's step
    counter as it keeps it (a tensor on the device is used there, not read)."""
    index = sample.positions(weight.param.device)
    w, gap = weight.value_at(index), weight.spacing_at(index)
    m_values, v_values = m.value_at(index), v.value_at(index)
    lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], float(group["eps"])
    step = step.double().clamp(min=1) if isinstance(step, Tensor) else max(step, 1)
    update = (m_values / (1 - beta1**step)) / ((v_values / (1 - beta2**step)).sqrt() + eps)
    if decoupled and group.get("weight_decay", 0.0):
        update = update + float(group["weight_decay"]) * w
    update = update.abs_().mul_(lr)
    keep = m_values != 0
    if stochastic:
        stalls = (1 - update / gap).clamp_(min=0.0)
    else:
        stalls = (update < gap / 2).double()
    return torch.stack([torch.where(keep, stalls, 0.0).sum().double(), keep.sum().double()])


__all__ = ["predicted_stall", "threshold"]
