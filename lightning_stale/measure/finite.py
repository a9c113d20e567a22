"""Non-finite weights: whether the sampled weights of each tracked parameter hold NaN/Inf, read on logging steps only
(a weight gone NaN/Inf stays so under every optimizer step, so the check at the end of a window sees what went wrong
in it, and the steps between logging steps do no work for it). A run whose weights went NaN/Inf has stall metrics
that mean nothing."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from lightning_stale._compat import local_tensor
from lightning_stale.measure.units import TrackedParam

CHECKED = 4096  # sampled elements checked per parameter at most (the whole sample in sample mode)


@torch.no_grad()
def nonfinite(units: list[TrackedParam]) -> np.ndarray:
    """Per parameter, whether its sampled weights hold NaN or Inf (bool, host): per device, two multi-tensor passes
    (times zero, which is NaN exactly where a value is not finite, then one norm per parameter) and one host read."""
    out = np.zeros(len(units), dtype=bool)
    by_device: dict[torch.device, list[TrackedParam]] = defaultdict(list)
    for unit in units:
        if unit.sample.count:
            by_device[unit.param.device].append(unit)
    for group in by_device.values():
        views = [u.sample.prefix(CHECKED).view(local_tensor(u.param).detach()) for u in group]
        norms = torch._foreach_norm(torch._foreach_mul(views, 0.0))
        bad = torch.stack(norms).isnan().cpu().numpy()
        out[[u.position for u in group]] = bad
    return out
