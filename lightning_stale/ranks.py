"""Sums across processes: what every rank must agree on (reset decisions, grid estimates, the logged row), added up
with one all-reduce, or passed through on one process.

Every rank must sum at the same steps with a vector of the same length; the monitor builds those vectors from what is
the same on every rank (parameters, not shards), so the calls always match.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

Reduce = Callable[[Tensor], Tensor]  # sums a host float64 tensor across processes (on the collective's device)


def summed(values: np.ndarray | Tensor, reduce: Reduce | None) -> np.ndarray:
    """``values`` summed across ranks with ``reduce`` (as they are without one: a single process), as a float64 host
    array of the same shape."""
    tensor = values if isinstance(values, Tensor) else torch.from_numpy(np.asarray(values, dtype=np.float64))
    tensor = tensor.to(torch.float64)
    if reduce is not None:
        tensor = reduce(tensor.reshape(-1)).to(torch.float64).cpu().view(tensor.shape)
    return tensor.numpy()


def world_size() -> int:
    """Processes in the initialized ``torch.distributed`` group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def default_reduce() -> Reduce | None:
    """``torch.distributed.all_reduce`` (sum) when a multi-process group is up, on the backend's device."""
    import torch.distributed as dist

    if world_size() <= 1:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def reduce(tensor: Tensor) -> Tensor:
        tensor = tensor.to(device)
        dist.all_reduce(tensor)
        return tensor

    return reduce
