"""Adapter for bitsandbytes (>= 0.50) optimizers: 8-bit block-wise states and their 32-bit fallbacks.

Layout (``optimizer.state[p]``, flat keys; the slots in :mod:`.bnb_layout`): ``step`` (Python int),
``state1``/``state2`` (uint8 codes, or float32 for parameters below ``min_8bit_size`` or with an ``optim_bits=32``
override), ``absmax1``/``absmax2`` (per block of 256), ``qmap1``/``qmap2`` (maps shared by every parameter: never
written here). ``unorm_vec`` for LAMB/LARS.

Moments seen, by kernel: adam/lamb ``state1`` -> m (beta1), ``state2`` -> v (beta2); ademamix ``state1[0]`` -> m
(fast EMA, beta1), ``state1[1]`` -> m (slow EMA, beta3), ``state2`` -> v; lion ``state1`` -> m (beta2, the EMA it
stores); momentum/lars ``state1`` -> m (not an EMA); rmsprop ``state1`` -> v (beta = alpha); adagrad ``state1`` ->
v (a sum).
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from torch import Tensor

from lightning_stale.adapters import bnb_layout
from lightning_stale.adapters.bnb_layout import BLOCK, LAYOUTS
from lightning_stale.adapters.protocol import Moment, SharedStepAdapter, Slot
from lightning_stale.adapters.restart import restarted_v
from lightning_stale.formats.base import round_up_blockwise
from lightning_stale.formats.floats import round_up_float


class BitsAndBytesAdapter(SharedStepAdapter):
    """All ``bitsandbytes.optim`` optimizers (``Optimizer1State``/``Optimizer2State``, 8-bit, paged and 32-bit).

    A full reset zeroes codes, absmax, ``unorm_vec`` and sets ``step = 0``: exactly what ``init_state`` creates.
    Two-state optimizers share ``step``, so an m-only reset zeroes m and keeps ``step``, and a v-only reset writes
    the safe restart of :mod:`.restart` (rounded up onto the grid). One-state optimizers reset exactly.
    """

    family = "bitsandbytes"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.optimizer_name not in LAYOUTS:
            raise TypeError(f"bitsandbytes optimizer kernel {optimizer.optimizer_name!r} is not supported; "
                            f"supported: {sorted(LAYOUTS)}")
        super().__init__(optimizer)
        self.layout = LAYOUTS[optimizer.optimizer_name]

    def _config(self, group: dict, p: Tensor) -> dict:
        """The per-parameter config (``GlobalOptimManager`` overrides merged), as bitsandbytes' own step reads it."""
        gindex = next(i for i, g in enumerate(self.optimizer.param_groups) if g is group)
        pindex = next(i for i, q in enumerate(group["params"]) if q is p)
        return self.optimizer.get_config(gindex, pindex, group)

    def slots(self) -> list[Slot]:
        out: list[Slot] = []
        for group, p, state in self.stepped():
            betas = self._config(group, p)["betas"]
            for key, half, moment, beta_index in self.layout:
                beta = None if beta_index is None else betas[beta_index]
                out.append(bnb_layout.slot(p, state, key, half, moment, beta))
        return out

    def present_moments(self) -> frozenset[Moment]:
        return frozenset(moment for _, _, moment, _ in self.layout)

    def reset_all(self, state: dict) -> None:
        for key in ("state1", "state2", "absmax1", "absmax2", "unorm_vec"):
            if key in state:
                state[key].zero_()
        state["step"] = 0

    def reset_m(self, state: dict) -> None:
        state["state1"].zero_()
        if "absmax1" in state:
            state["absmax1"].zero_()

    def restart_v(self, group: dict, p: Tensor, state: dict) -> None:
        """Safe v-only restart for two-state kernels (see :mod:`lightning_stale.adapters.restart`)."""
        step = state["step"]
        if step == 0:
            state["state2"].zero_()
            if "absmax2" in state:
                state["absmax2"].zero_()
            return
        config = self._config(group, p)
        betas = config["betas"]
        by_key = {s.key: s for s in (bnb_layout.slot(p, state, k, h, m, None) for k, h, m, _ in self.layout)}
        numerator = by_key["state1" if "state1" in by_key else "state1[0]"].value() / (1.0 - betas[0] ** step)
        if "state1[1]" in by_key:
            # AdEMAMix's numerator is m1_hat + alpha * m2. The slow m2 decays by beta3 > beta1, so it is weighted
            # by beta3 / (beta1 * c1(t) / c1(t+1)): then |next numerator| <= s * (1 + alpha * (1 - beta3)) with the
            # same next gradient, the size of a first AdEMAMix step.
            beta1, beta3 = betas[0], betas[2]
            decay1 = beta1 * (1.0 - beta1**step) / (1.0 - beta1 ** (step + 1))
            slow = by_key["state1[1]"].value().abs() * (config["alpha"] * beta3 / decay1)
            numerator = numerator.abs() + slow
        target = restarted_v(numerator, p.grad, step, betas[1])
        if state["state2"].dtype == torch.uint8:
            codes, absmax = round_up_blockwise(target, state["qmap2"], BLOCK)
            state["state2"].view(-1).copy_(codes)
            state["absmax2"].copy_(absmax)
        else:
            state["state2"].view(-1).copy_(round_up_float(target, state["state2"].dtype))


ADAPTERS = {bnb.optim.optimizer.Optimizer8bit: BitsAndBytesAdapter}
