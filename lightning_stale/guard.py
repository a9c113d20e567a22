"""The underflow guard: zero the first moment of elements whose stored second moment is exactly zero.

The hazard: when an element's v rounds to zero in storage while its m does not, a later zero (or tiny) gradient gives
the update ``lr * m / eps`` (tests/test_underflow_guard.py reproduces it with torchao's and ``QuantizedAdamW``'s
8-bit states). After each real optimizer step the guard writes
the zero code into m wherever v is stored as zero, so the element holds a fresh state (m = v = 0). Its next update
is then 0 for a zero gradient and ``lr * (1 - b1) * g / sqrt((1 - b2) * g**2)`` for any other gradient
(bias-corrected, at most about ``3.2 * lr`` at the default betas): the size of a first Adam step, never ``m / eps``.

Why reset m rather than clamp the update: a clamp must see the update, i.e. keep a copy of every parameter before
each step (memory as large as the model) or change the optimizer's own arithmetic; zeroing m works on the stored
state alone, in place, for every optimizer whose slots can write a zero code. What it loses is the momentum of
elements so small against their block that their v already reads as zero.

Cost: one pass that reads v's codes and rewrites m's where v's are the zero code. Where both layouts offer a
per-element view (:meth:`Slot.zero_view`: plain float states, 8-bit block-wise maps), a large tensor's pass is one
fused kernel (``torch.compile``) and small tensors of one layout are guarded together in five tensor ops however
many there are (:class:`GuardPlan`); other layouts (packed 4-bit, fp8 blocks) take a few eager mask operations each. The one-pass test leaves out elements of
a block whose scale is 0 under a non-zero code: such a block's v is zero because every squared gradient in it
underflowed (|g| below about 1e-22), so its m is as small and its update negligible.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale.adapters.protocol import Slot

FUSED_MIN_NUMEL = 1 << 16  # smaller tensors: the eager ops cost less than a compiled call's dispatch
_fused_failed = False  # set when torch.compile failed here once; the eager ops are used from then on


def _zero_where_zero(target: Tensor, codes: Tensor, zero: int | float, target_zero: int | float) -> None:
    """Write ``target_zero`` into ``target`` wherever ``codes == zero`` (both flat, same length)."""
    target.masked_fill_(codes == zero, target_zero)


@lru_cache(maxsize=1)
def _fused() -> object:
    """:func:`_zero_where_zero` compiled once with dynamic shapes (one loop: read v codes, rewrite m codes)."""
    return torch.compile(_zero_where_zero, dynamic=True)


def _fusable(tensor: Tensor) -> bool:
    if _fused_failed or tensor.numel() < FUSED_MIN_NUMEL:
        return False
    return tensor.device.type != "cpu" or _compat.compiler_available()


class GuardPlan:
    """The guard for a fixed set of slots, planned once (the monitor keeps one per slot set and rebuilds it when the
    optimizer state is replaced): per step it runs one fused pass per large (v, m) pair, five tensor ops per group
    of small pairs that share a layout (concatenate into buffers kept by the plan, one pass over the buffers, copy m
    back in place with one foreach copy), and the mask-based path for the layouts without a zero view."""

    def __init__(self, slots: Iterable[Slot]) -> None:
        by_param: dict[int, list[Slot]] = {}
        for slot in slots:
            by_param.setdefault(id(slot.param), []).append(slot)
        self.pairs: list[tuple[list[Slot], list[Slot]]] = []  # (v slots, m slots) per parameter
        for group in by_param.values():
            v_slots = [s for s in group if s.moment == "v"]
            m_slots = [s for s in group if s.moment == "m"]
            if v_slots and m_slots:
                for m in m_slots:
                    if m.numel != v_slots[0].numel:
                        raise ValueError(f"slot {m.key!r} has {m.numel} elements but its second moment has "
                                         f"{v_slots[0].numel}")
                self.pairs.append((v_slots, m_slots))
        self._large: list[tuple[Tensor, int | float, Tensor, int | float]] = []
        self._masked: list[tuple[list[Slot], list[Slot]]] = []
        small: dict[tuple, list[tuple[Tensor, Tensor]]] = {}
        for v_slots, m_slots in self.pairs:
            for m in m_slots:
                v_view, m_view = v_slots[0].zero_view() if len(v_slots) == 1 else None, m.zero_view()
                if v_view is None or m_view is None or m_view[0].numel() != v_view[0].numel():
                    self._masked.append((v_slots, [m]))
                elif v_view[0].numel() >= FUSED_MIN_NUMEL:
                    self._large.append((*v_view, *m_view))
                else:
                    layout = (v_view[0].device, v_view[0].dtype, v_view[1], m_view[0].dtype, m_view[1])
                    small.setdefault(layout, []).append((v_view[0], m_view[0]))
        self._small = [_SmallGroup(pairs, zero, target_zero) for (_, _, zero, _, target_zero), pairs in small.items()]

    def run(self, count: bool = False) -> Tensor | None:
        """Guard once. With ``count=True`` every pair takes the mask-based path and the number of elements whose m
        was non-zero and got zeroed is returned (a 0-d tensor on the state's device, no host sync)."""
        if count:
            counts = [n for v_slots, m_slots in self.pairs for n in _guard_masked(v_slots, m_slots, count=True)]
            return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
        for codes, zero, target, target_zero in self._large:
            _guard_pass(codes, zero, target, target_zero)
        for group in self._small:
            group.run()
        for v_slots, m_slots in self._masked:
            _guard_masked(v_slots, m_slots, count=False)
        return None


    def tensors(self) -> list[Tensor]:
        """The buffers the plan keeps between steps (its views of the state excluded)."""
        return [t for group in self._small for t in (group.codes_buffer, group.target_buffer)]


class _SmallGroup:
    """Small (v codes, m codes) pairs of one layout with their concatenation buffers."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]], zero: int | float, target_zero: int | float) -> None:
        self.codes, self.targets = [c for c, _ in pairs], [t for _, t in pairs]
        self.zero, self.target_zero = zero, target_zero
        self.codes_buffer = torch.empty(sum(c.numel() for c in self.codes), dtype=self.codes[0].dtype,
                                        device=self.codes[0].device)
        self.target_buffer = torch.empty_like(self.codes_buffer, dtype=self.targets[0].dtype)
        self.target_parts = self.target_buffer.split([t.numel() for t in self.targets])

    def run(self) -> None:
        torch.cat(self.codes, out=self.codes_buffer)
        torch.cat(self.targets, out=self.target_buffer)
        _guard_pass(self.codes_buffer, self.zero, self.target_buffer, self.target_zero)
        torch._foreach_copy_(self.targets, self.target_parts)


def _guard_pass(codes: Tensor, zero: int | float, target: Tensor, target_zero: int | float) -> None:
    """One pass over flat v codes and m codes: the fused kernel where it works (large tensors: several times faster
    than the eager compare and masked fill on CPU), else the same in eager ops."""
    global _fused_failed
    if _fusable(codes):
        try:
            _fused()(target, codes, zero, target_zero)
            return
        except Exception as error:  # no working compiler here: the eager ops do the same, slower
            _fused_failed = True
            _compat.log.info("[lightning_stale] the fused underflow guard is unavailable (%s); using eager ops", error)
    _zero_where_zero(target, codes, zero, target_zero)


def _guard_masked(v_slots: list[Slot], m_slots: list[Slot], count: bool) -> list[Tensor]:
    """The layout-independent path through ``zero_mask``/``zero_elements``; with ``count``, the hazard count per m."""
    v_zero = v_slots[0].zero_mask()
    for v in v_slots[1:]:
        v_zero |= v.zero_mask()
    counts = []
    for m in m_slots:
        if count:
            hazard = v_zero & ~m.zero_mask()
            counts.append(torch.count_nonzero(hazard))  # several times faster than a bool sum on CPU
            m.zero_elements(hazard)
        else:
            m.zero_elements(v_zero)  # where m is already zero this writes the same zero
    return counts


def guard_underflow(slots: Iterable[Slot], count: bool = False) -> Tensor | None:
    """For each parameter, zero every first moment where its second moment is stored as zero (plans and runs a
    :class:`GuardPlan` once; keep the plan to guard the same slots every step).

    With ``count=True`` it returns the number of elements whose m was non-zero and got zeroed (a 0-d tensor on the
    state's device, no host sync), at the price of extra passes; otherwise None.
    """
    return GuardPlan(slots).run(count)
