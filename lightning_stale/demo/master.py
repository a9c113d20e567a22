"""torch AdamW over fp32 master copies of a low-precision model: the control that isolates what bf16 compute costs.

A ``bf16-true`` model computes its forward and backward in bf16 and normally stores its weights and Adam moments in
bf16 too. :class:`MasterWeightAdamW` keeps an fp32 copy of each weight and fp32 moments (the classic master-weight
recipe), steps the copy with torch's own AdamW math and writes it to the bf16 parameter by nearest rounding, so
nothing is lost to the rounding of weights or states: what separates its loss from fp32's is the bf16 compute
(activations, gradients, their clipping) alone, the floor under any remedy that rewrites only weights and states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim.adam import adam


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay, no amsgrad) whose update runs on fp32 copies of the parameters.

    The parameter groups hold the model's own (bf16) parameters, so gradient clipping, lr schedulers and loggers see
    them as with torch AdamW; each parameter's state holds ``master`` (its fp32 copy) beside fp32 ``exp_avg`` and
    ``exp_avg_sq`` and ``step``. Gradients are widened to fp32 before the update.
    """

    def __init__(self, params, **kwargs) -> None:  # noqa: ANN001 (torch's ParamsT)
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise ValueError("MasterWeightAdamW supports amsgrad=False and maximize=False only")
        super().__init__(params, foreach=False, **kwargs)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            owned = [p for p in group["params"] if p.grad is not None]
            for p in owned:
                state = self.state[p]
                if not state:
                    master = p.detach().to(torch.float32, copy=True)
                    state.update(step=torch.tensor(0.0), master=master, exp_avg=torch.zeros_like(master),
                                 exp_avg_sq=torch.zeros_like(master))
            states = [self.state[p] for p in owned]
            beta1, beta2 = group["betas"]
            adam([s["master"] for s in states], [p.grad.float() for p in owned], [s["exp_avg"] for s in states],
                 [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=False,
                 decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            for p, s in zip(owned, states):
                p.copy_(s["master"])
        return loss


__all__ = ["MasterWeightAdamW"]
