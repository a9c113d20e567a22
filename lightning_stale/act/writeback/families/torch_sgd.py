"""torch.optim.SGD, with or without momentum, Nesterov, dampening and weight decay (for-loop, foreach, fused).

torch keeps a bf16 parameter's momentum buffer (``momentum_buffer``) in bf16, from its first step on, and nothing
without momentum. The write-back computes the step in fp32 (torch's for-loop and foreach forms round each op to bf16)
and stores the buffer to nearest or stochastically, in one multi-tensor pass per bucket. A weight whose update
``lr * buffer`` is under half its grid gap does not move under nearest rounding: compensated summation keeps it.
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
    weight_target,
    write_moments,
    write_weight,
)
from lightning_stale.act.writeback.triton_pass import TritonPass


def sgd(w: Tensor, c: Tensor | None, g: Tensor, buf: Tensor | None, scalars: Tensor, keys: Tensor, weights: str,
        moments: str, nesterov: bool) -> None:
    """One parameter's SGD step in fp32, in place. ``scalars``: fp32 (-lr, momentum, 1 - dampening, gradient sign,
    weight decay); ``buf``: the momentum buffer (None without momentum)."""
    step_size, momentum, one_minus_dampening, sign, wd = scalars.unbind()
    target = weight_target(w, c)
    g = g.float() * sign + target * wd
    direction = g
    if buf is not None:
        b = buf.float() * momentum + g * one_minus_dampening
        direction = g + b * momentum if nesterov else b
    stochastic = weights == "stochastic"
    write_weight(w, c, target + step_size * direction, weights, noise(w, keys) if stochastic else None)
    if buf is not None:
        write_moments((buf,), (b,), moments, noise(w, keys, second=stochastic) if moments == "stochastic" else None)


SGD = MultiTensor(sgd, TritonPass("sgd"))


class TorchSGD(Family):
    """torch.optim.SGD (see the module)."""

    moment_roundings = ("nearest", "stochastic")

    def refusal(self) -> str | None:
        if any(group.get("differentiable") for group in self.optimizer.param_groups):
            return "differentiable=True is not supported"
        return None

    def ready(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        return group["momentum"] == 0 or state.get("momentum_buffer") is not None

    def bucket_key(self, member: Member) -> tuple[Any, ...]:
        group = member.group
        return (*super().bucket_key(member), group["momentum"] != 0, bool(group.get("nesterov", False)))

    def prepare(self, members: list[Member]) -> Columns:
        columns = member_columns(members)
        momentum = members[0].group["momentum"] != 0
        columns.lists["buf"] = [columns.view(local_tensor(self.optimizer.state[m.param]["momentum_buffer"]))
                                if momentum else None for m in members]
        return columns

    def scalars(self, members: list[Member], columns: Columns) -> Tensor:
        """:func:`sgd`'s scalars per member (fp32 on the host), from its group's hyper-parameters."""
        rows = [(-float(g["lr"]), g["momentum"], 1.0 - g["dampening"], -1.0 if g.get("maximize", False) else 1.0,
                 g["weight_decay"]) for g in self.optimizer.param_groups]
        return torch.tensor(rows, dtype=torch.float32)[columns.tensors["group"]]

    def update(self, members: list[Member], columns: Columns, grads: list[Tensor], write: Write) -> None:
        keys = noise_keys(write.key, columns.tensors["noise"])
        nesterov = bool(members[0].group.get("nesterov", False))
        SGD([columns.lists["w"], columns.lists["c"], grads, columns.lists["buf"]], [write.scalars, keys],
            (write.weights, write.moments, nesterov), columns.compiled, columns.flat, columns.cache)


FAMILIES = {torch.optim.SGD: TorchSGD}
