"""torch.optim.Adam and AdamW (for-loop, foreach and fused; no amsgrad, capturable or differentiable).

torch keeps a bf16 parameter's moments in bf16 (``exp_avg``, ``exp_avg_sq``) and its step counter ``step``. The
write-back computes the whole step in fp32 from them and the gradient, as torch's fused kernel does (its for-loop and
foreach forms round each op to bf16 instead), and stores the moments to nearest or stochastically: one multi-tensor
pass per bucket reads w, its residual, g, m and v once and writes w, the residual, m and v once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_stale._compat import local_tensor
from lightning_stale.act.writeback.family import Columns, Family, Member, Write, member_columns
from lightning_stale.act.writeback.kernels import (
    MultiTensor,
    noise,
    noise_keys,
    sqrt,
    weight_target,
    write_moments,
    write_weight,
)
from lightning_stale.act.writeback.triton_pass import TritonPass


def adam(w: Tensor, c: Tensor | None, g: Tensor, m: Tensor, v: Tensor, scalars: Tensor, keys: Tensor,
         weights: str, moments: str, gradient_as_is: bool) -> None:
    """One parameter's Adam/AdamW step in fp32, in place. ``scalars``: fp32 (1 - beta1, beta2, 1 - beta2, gradient
    sign, coupled weight decay, decoupled decay factor, step size (negative), eps), the step size and eps both
    multiplied by the square root of v's bias correction: one division per element where torch divides twice (the
    same update to an ulp of it). ``gradient_as_is``: no group maximizes or couples its weight decay (AdamW's
    case), so the sign and coupled decay are left out of the loop."""
    one_minus_beta1, beta2, one_minus_beta2, sign, l2, decay, step_size, eps = scalars.unbind()
    target = weight_target(w, c)
    g = g.float() if gradient_as_is else g.float() * sign + target * l2
    mf = m.float()
    mf = mf + (g - mf) * one_minus_beta1
    vf = v.float() * beta2 + (g * g) * one_minus_beta2
    new = target * decay + step_size * (mf / (sqrt(vf) + eps))
    stochastic = weights == "stochastic"
    write_weight(w, c, new, weights, noise(w, keys) if stochastic else None)
    write_moments((m, v), (mf, vf), moments, noise(w, keys, second=stochastic) if moments == "stochastic" else None)


ADAM = MultiTensor(adam, TritonPass("adam"))


class TorchAdam(Family):
    """torch.optim Adam/AdamW (see the module)."""

    moment_roundings = ("nearest", "stochastic")

    def refusal(self) -> str | None:
        for group in self.optimizer.param_groups:
            for flag in ("amsgrad", "capturable", "differentiable"):
                if group.get(flag):
                    return f"{flag}=True is not supported"
            if any(isinstance(beta, Tensor) for beta in group["betas"]):
                return "tensor betas are not supported"
        return None

    def ready(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        return "exp_avg" in state

    def prepare(self, members: list[Member]) -> Columns:
        columns = member_columns(members)
        states = [self.optimizer.state[m.param] for m in members]
        for key, name in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            columns.lists[name] = [columns.view(local_tensor(state[key])) for state in states]
        columns.lists["step"] = [state["step"] for state in states]
        return columns

    def scalars(self, members: list[Member], columns: Columns) -> Tensor:
        """The step counters advanced (one multi-tensor op), then :func:`adam`'s scalars per member where they are
        kept on the host (non-capturable torch: computed there, fp32), else each member's group row (fp64, finished
        on the device in :meth:`update`, where the counters are)."""
        steps = columns.lists["step"]
        torch._foreach_add_(steps, 1)
        rows = self._group_rows()[columns.tensors["group"]]
        return rows if steps[0].device == columns.lists["w"][0].device else _finish(rows, steps)

    def update(self, members: list[Member], columns: Columns, grads: list[Tensor], write: Write) -> None:
        steps, scalars = columns.lists["step"], write.scalars
        if scalars.dtype == torch.float64:  # the group rows: the step-dependent part on the counters' device
            scalars = _finish(scalars, steps)
        keys = noise_keys(write.key, columns.tensors["noise"])
        ADAM([columns.lists[name] for name in ("w", "c")] + [grads] + [columns.lists[name] for name in ("m", "v")],
             [scalars, keys], (write.weights, write.moments, self._gradient_as_is), columns.compiled, columns.flat,
             columns.cache)

    def _group_rows(self) -> Tensor:
        """Per param group, fp64 on the host: (beta1, beta2, -lr, eps) and what depends on the group only (1 - beta1,
        beta2, 1 - beta2, gradient sign, coupled weight decay, decoupled decay factor); sets ``gradient_as_is``:
        no group maximizes or couples its weight decay (AdamW's case)."""
        rows, self._gradient_as_is = [], True
        for group in self.optimizer.param_groups:
            lr, (beta1, beta2), wd = float(group["lr"]), group["betas"], group["weight_decay"]
            decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
            sign, l2 = -1.0 if group.get("maximize", False) else 1.0, 0.0 if decoupled else wd
            self._gradient_as_is &= sign == 1.0 and l2 == 0.0
            rows.append((beta1, beta2, -lr, group["eps"], 1.0 - beta1, beta2, 1.0 - beta2, sign, l2,
                         1.0 - lr * wd if decoupled and wd != 0 else 1.0))
        return torch.tensor(rows, dtype=torch.float64)


def _finish(rows: Tensor, steps: list[Tensor]) -> Tensor:
    """:func:`adam`'s scalars per member (fp32) from its group row (:meth:`TorchAdam._group_rows`) and its step
    counter (already advanced), in fp64 on the rows' device: the step size and eps scaled by the bias corrections
    (a dozen tensor ops, no host read of a counter)."""
    step = torch.stack(steps).to(torch.float64).reshape(-1, 1)
    corrections = 1.0 - rows[:, :2] ** step  # 1 - beta1^t, 1 - beta2^t
    scaled = rows[:, 2:4] * corrections[:, 1:].sqrt()  # -lr and eps times sqrt(1 - beta2^t)
    return torch.cat([rows[:, 4:], scaled[:, :1] / corrections[:, :1], scaled[:, 1:]], dim=1).float()


FAMILIES = {torch.optim.Adam: TorchAdam, torch.optim.AdamW: TorchAdam}
