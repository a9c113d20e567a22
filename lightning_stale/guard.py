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

from lightning_stale.adapters.base import Slot


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
        v_zero = v_slots[0].zero_mask()
        for v in v_slots[1:]:
            v_zero |= v.zero_mask()
        for m in m_slots:
            if m.numel != v_zero.numel():
                raise ValueError(f"slot {m.key!r} has {m.numel} elements but its second moment has {v_zero.numel()}")
            hazard = v_zero & ~m.zero_mask()
            m.zero_elements(hazard)  # unconditionally: checking for hits first would sync with the device
            counts.append(torch.count_nonzero(hazard))  # several times faster than a bool sum on CPU
    return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
