"""Host-to-device copies that do not make the host wait: from pinned memory, non-blocking, and several small tables
bound for one device in one copy (the per-step tables of the weight write-back, the measurement plans)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """The host tensor ``host`` on ``device`` without waiting for it: a plain host-to-device copy blocks the host until
    the device's queue has drained, one from pinned memory does not (the caching host allocator keeps the pinned block
    until the copy is done)."""
    if device.type == "cpu":
        return host
    try:
        return host.pin_memory().to(device, non_blocking=True)
    except RuntimeError:  # no pinned memory for this device's backend: the blocking copy
        return host.to(device)


def to_devices(tables: Sequence[Tensor | None], devices: Sequence[torch.device]) -> list[Tensor | None]:
    """Each of ``tables`` on its device in ``devices``: the host tables bound for one device go there together, in one
    :func:`to_device` copy (as float64, exact for the float32 and integer tables it carries, and back); tables already
    there, and None, as they are."""
    out = list(tables)
    bound: dict[torch.device, list[int]] = {}
    for i, (table, device) in enumerate(zip(tables, devices)):
        if table is not None and table.device != device:
            bound.setdefault(device, []).append(i)
    for device, chosen in bound.items():
        flat = torch.cat([tables[i].reshape(-1).double() for i in chosen])
        pieces = to_device(flat, device).split([tables[i].numel() for i in chosen])
        for i, piece in zip(chosen, pieces):
            out[i] = piece.view(tables[i].shape).to(tables[i].dtype)
    return out
