"""torch AdamW's math in fp32 with a chosen storage for weights and moments: the controls that split what bf16 costs.

A ``bf16-true`` model computes its forward and backward in bf16 and normally stores its weights and Adam moments in
bf16 too. :class:`MasterWeightAdamW` runs torch's own AdamW math in fp32 on every step and stores each part either
exactly in fp32 (weights as an fp32 master copy written to the bf16 parameter by nearest rounding, moments as fp32
tensors) or in bf16 with stochastic rounding (the weight in the parameter itself, the moments as bf16 tensors). All
fp32: what separates its loss from fp32's is the bf16 compute alone, the floor under any remedy that rewrites weights
and states; one part stochastic: what that part's rounding noise costs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim.adamw import adamw

from lightning_stale.act.writeback.kernels import noise, noise_base, noise_keys, step_key
from lightning_stale.formats.floats import on_grid
from lightning_stale.formats.noise import NOISE_MASK

STORAGES = ("fp32", "stochastic")  # fp32: exact; stochastic: the parameter's dtype, rounded stochastically


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay, no amsgrad) computed in fp32, with ``weights`` and ``moments`` each stored in
    fp32 or stochastically rounded to the parameter's dtype (``STORAGES``).

    The parameter groups hold the model's own parameters, so gradient clipping, lr schedulers and loggers see them as
    with torch AdamW; each parameter's state holds ``exp_avg``, ``exp_avg_sq``, ``step`` and, with fp32 weights,
    ``master`` (its fp32 copy). Gradients are widened to fp32 before the update. The rounding noise is keyed by
    (``seed``, step, parameter, part), as the weight write-back's is.
    """

    def __init__(self, params, weights: str = "fp32", moments: str = "fp32", seed: int = 0,  # noqa: ANN001
                 **kwargs) -> None:
        for name, value in (("weights", weights), ("moments", moments)):
            if value not in STORAGES:
                raise ValueError(f"{name} must be one of {STORAGES}, got {value!r}")
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise ValueError("MasterWeightAdamW supports amsgrad=False and maximize=False only")
        super().__init__(params, foreach=False, **kwargs)
        self.weights, self.moments, self.seed = weights, moments, seed

    def _round(self, x: torch.Tensor, dtype: torch.dtype, step: int, index: int) -> torch.Tensor:
        where = torch.tensor([index], dtype=torch.int32, device=x.device)
        keys = noise_keys(step_key(self.seed, step), noise_base(where, torch.zeros_like(where)))[0]
        return on_grid(x.float(), dtype, noise(x, keys) & NOISE_MASK).to(dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                kept = torch.float32 if self.moments == "fp32" else p.dtype
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p, dtype=kept),
                                 exp_avg_sq=torch.zeros_like(p, dtype=kept))
                    if self.weights == "fp32":
                        state["master"] = p.detach().to(torch.float32, copy=True)
                w = state["master"] if self.weights == "fp32" else p.detach().float()
                m, v = (state[k] if kept == torch.float32 else state[k].float() for k in ("exp_avg", "exp_avg_sq"))
                beta1, beta2 = group["betas"]
                adamw([w], [p.grad.float()], [m], [v], [], [state["step"]], foreach=False, amsgrad=False, beta1=beta1,
                      beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                step = int(state["step"])
                if kept != torch.float32:
                    state["exp_avg"].copy_(self._round(m, kept, step, 3 * index + 1))
                    state["exp_avg_sq"].copy_(self._round(v, kept, step, 3 * index + 2))
                p.copy_(w if self.weights == "fp32" else self._round(w, p.dtype, step, 3 * index))
        return loss


__all__ = ["STORAGES", "MasterWeightAdamW"]
