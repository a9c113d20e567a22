"""The opt-in v-underflow guard: zero the first moment of elements whose stored second moment is exactly zero.

The hazard: when an element's v rounds to zero in storage while its m does not, a later zero (or tiny) gradient gives
the update ``lr * m / eps`` (weights moved by 20-30 in one step at lr 1e-3 in our reproductions with torchao's and
``QuantizedAdamW``'s 8-bit states, see tests/test_underflow_guard.py). After each real optimizer step the guard writes
the zero code into m wherever v is stored as zero and m is not, so the element holds a fresh state (m = v = 0). Its
next update is then 0 for a zero gradient and ``lr * (1 - b1) * g / sqrt((1 - b2) * g**2)`` for any other gradient
(bias-corrected, at most about ``3.2 * lr`` at the default betas): the size of a first Adam step, never ``m / eps``.

Why reset m rather than clamp the update: a clamp must see the update, i.e. keep a copy of every parameter before
each step (memory as large as the model) or change the optimizer's own arithmetic; zeroing m works on the stored
state alone, in place, for every optimizer whose slots can write a zero code. What it loses is the momentum of
elements so small against their block that their v already reads as zero.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_stale.adapters.base import BlockFp8Slot, BlockQmapSlot, FloatSlot, Packed4bitSlot, Slot
from lightning_stale.formats.base import pack_nibbles


def stored_zero_mask(slot: Slot) -> Tensor:
    """Flat bool mask of the elements whose stored value is exactly zero.

    Plain float and 8-bit map layouts compare their codes directly (several times cheaper than dequantizing the
    whole state every step); other slots compare their dequantized values.
    """
    if isinstance(slot, FloatSlot):
        return (slot.tensor == 0).reshape(-1)
    if isinstance(slot, BlockQmapSlot) and not isinstance(slot, Packed4bitSlot):
        codes, scale = slot.codes().reshape(-1), slot.scale.reshape(-1)
        if codes.numel() == scale.numel() * slot.block_size:  # whole blocks: broadcast the scale, no expansion
            blocks = codes.view(-1, slot.block_size)
            return ((blocks == _map_zero_code(slot)) | (scale == 0).unsqueeze(1)).view(-1)
        return (codes == _map_zero_code(slot)) | (scale == 0).repeat_interleave(slot.block_size)[: codes.numel()]
    return slot.value() == 0


def zero_elements(slot: Slot, mask: Tensor) -> None:
    """Store an exact zero in the elements of ``slot`` selected by the flat bool ``mask``, in place.

    Slots that define their own ``zero_elements(mask)`` method are asked to do it; the built-in layouts of
    :mod:`lightning_stale.adapters.base` write their zero code directly (scales are left alone).
    """
    own = getattr(slot, "zero_elements", None)
    if callable(own):
        own(mask)
    elif isinstance(slot, FloatSlot):
        slot.tensor.masked_fill_(mask.view(slot.tensor.shape), 0)
    elif isinstance(slot, Packed4bitSlot):
        codes = slot.codes().masked_fill(mask, _map_zero_code(slot))  # unpacked; repacked high nibble first
        slot.stored.view(-1).copy_(pack_nibbles(codes))
    elif isinstance(slot, BlockQmapSlot):
        slot.stored.masked_fill_(mask.view(slot.stored.shape), _map_zero_code(slot))
    elif isinstance(slot, BlockFp8Slot):
        slot.stored.view(torch.uint8).masked_fill_(mask.view(slot.stored.shape), 0)
    else:
        raise TypeError(
            f"underflow_guard cannot write zeros into slot {slot.key!r} ({type(slot).__name__}): give the slot class "
            "a zero_elements(mask) method, or construct StaleStateCallback(underflow_guard=False)"
        )


def _map_zero_code(slot: BlockQmapSlot) -> Tensor:
    """The code of the map entry nearest zero (an exact zero in every map bitsandbytes, torchao and
    ``lightning_stale.formats`` use for a first moment), as a 0-d tensor on the map's device: no host sync."""
    return torch.argmin(slot.qmap.reshape(-1).abs()).to(torch.uint8)


def guard_underflow(slots: Iterable[Slot]) -> Tensor:
    """For each parameter, zero every first moment where its second moment is stored as zero and m is not.

    Returns the number of elements whose m was zeroed (a 0-d tensor on the state's device; no host sync).
    """
    by_param: dict[int, list[Slot]] = {}
    for slot in slots:
        by_param.setdefault(id(slot.param), []).append(slot)
    counts: list[Tensor] = []
    for group in by_param.values():
        v_slots = [s for s in group if s.moment == "v"]
        m_slots = [s for s in group if s.moment == "m"]
        if not v_slots or not m_slots:
            continue
        v_zero = stored_zero_mask(v_slots[0])
        for v in v_slots[1:]:
            v_zero |= stored_zero_mask(v)
        for m in m_slots:
            if m.numel != v_zero.numel():
                raise ValueError(f"slot {m.key!r} has {m.numel} elements but its second moment has {v_zero.numel()}")
            hazard = v_zero & ~stored_zero_mask(m)
            zero_elements(m, hazard)  # unconditionally: checking for hits first would sync with the device
            counts.append(hazard.sum())
    return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
