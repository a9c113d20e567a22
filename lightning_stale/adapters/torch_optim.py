"""Adapters for torch.optim's Adam/AdamW, SGD (momentum), RMSprop and Adagrad, with states in any float dtype.

Moments seen: Adam/AdamW ``exp_avg`` -> m (beta1) and ``exp_avg_sq`` -> v (beta2); SGD ``momentum_buffer`` -> m
(not an EMA: beta None); RMSprop ``square_avg`` -> v (beta = alpha); Adagrad ``sum`` -> v (a running sum:
beta None). Codes are the raw bits of the state tensor; the grid is the tensor's own dtype (bf16 parameters give
bf16 states). Resets zero buffers and the ``step`` tensor in place (fused/foreach/capturable keep their tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_stale._compat import local_tensor
from lightning_stale.adapters.layouts import FLOAT_FORMATS, FloatSlot
from lightning_stale.adapters.protocol import Moment, OptimizerAdapter, SharedStepAdapter, Slot, resolve_moments
from lightning_stale.adapters.restart import restarted_v, round_up_float


def float_slot(param: Tensor, state: dict, key: str, moment: Moment, beta: float | None) -> FloatSlot:
    """A slot over the plain float tensor ``state[key]`` (this process's shard of a DTensor state under FSDP2)."""
    tensor = local_tensor(state[key])
    return FloatSlot(param, moment, beta, FLOAT_FORMATS.get(tensor.dtype, str(tensor.dtype)), key, tensor=tensor)


class TorchAdamAdapter(SharedStepAdapter):
    """``torch.optim.Adam`` and ``AdamW`` (all foreach/fused/capturable/amsgrad variants).

    One ``step`` per parameter serves both moments: a full reset is exact, an m-only reset zeroes m and keeps
    ``step`` (the next updates are smaller, a built-in warm-up), a v-only reset uses :mod:`.restart`.
    """

    family = "torch.optim"

    def slots(self) -> list[Slot]:
        out: list[Slot] = []
        for group, p, state in self.stepped():
            beta1, beta2 = group["betas"]
            out.append(float_slot(p, state, "exp_avg", "m", beta1))
            out.append(float_slot(p, state, "exp_avg_sq", "v", beta2))
        return out

    def reset_all(self, state: dict) -> None:
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                state[key].zero_()
        state["step"].zero_()

    def reset_m(self, state: dict) -> None:
        state["exp_avg"].zero_()

    def restart_v(self, group: dict, p: Tensor, state: dict) -> None:
        step = int(state["step"])
        if step == 0:
            state["exp_avg_sq"].zero_()
            return
        beta1, beta2 = group["betas"]  # computed on this process's shards (DTensors under FSDP2)
        m_hat = local_tensor(state["exp_avg"]).float() / (1.0 - beta1**step)
        grad = local_tensor(p.grad)
        if grad is not None and group["weight_decay"] != 0 and not _decoupled(self.optimizer, group):
            grad = grad.float() + group["weight_decay"] * local_tensor(p).detach().float()
        target = restarted_v(m_hat, grad, step, beta2)
        for key in ("exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                stored = local_tensor(state[key])
                stored.copy_(round_up_float(target, stored.dtype))


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """True when weight decay is applied to the parameter, not added to the gradient (AdamW)."""
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


class TorchSGDAdapter(OptimizerAdapter):
    """``torch.optim.SGD`` with momentum: one buffer, m (beta None). Its reset is exact: the buffer is zeroed in place
    (with dampening 0 the next step then stores exactly the gradient, as a fresh optimizer does); with dampening != 0
    it is removed so that SGD recreates it from the gradient (the only bit-exact fresh state)."""

    family = "torch.optim"
    exact_moment_reset = True

    def slots(self) -> list[Slot]:
        return [float_slot(p, state, "momentum_buffer", "m", None)
                for _, p, state in self.stepped() if state.get("momentum_buffer") is not None]

    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        if "m" not in resolve_moments(moments):
            return
        for group, _, state in self.stepped(params):
            if state.get("momentum_buffer") is None:
                continue
            if group["dampening"] == 0:
                state["momentum_buffer"].zero_()
            else:
                del state["momentum_buffer"]


class TorchRMSpropAdapter(OptimizerAdapter):
    """``torch.optim.RMSprop``: ``square_avg`` is v (beta = alpha). Resetting v resets the whole state (momentum and
    centered buffers and ``step`` too): exact."""

    family = "torch.optim"
    exact_moment_reset = True

    def slots(self) -> list[Slot]:
        return [float_slot(p, state, "square_avg", "v", group["alpha"]) for group, p, state in self.stepped()]

    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        if "v" not in resolve_moments(moments):
            return
        for _, _, state in self.stepped(params):
            for key in ("square_avg", "momentum_buffer", "grad_avg", "step"):
                if key in state:
                    state[key].zero_()


class TorchAdagradAdapter(OptimizerAdapter):
    """``torch.optim.Adagrad``: ``sum`` is v (a running sum, beta None). Reset refills it with the group's
    ``initial_accumulator_value`` and zeroes ``step``: exact."""

    family = "torch.optim"
    exact_moment_reset = True

    def slots(self) -> list[Slot]:
        return [float_slot(p, state, "sum", "v", None) for _, p, state in self.stepped()]

    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        if "v" not in resolve_moments(moments):
            return
        for group, _, state in self.stepped(params):
            state["sum"].fill_(group["initial_accumulator_value"])
            state["step"].zero_()


ADAPTERS: dict[type, type[OptimizerAdapter]] = {
    torch.optim.Adam: TorchAdamAdapter,
    torch.optim.AdamW: TorchAdamAdapter,
    torch.optim.SGD: TorchSGDAdapter,
    torch.optim.RMSprop: TorchRMSpropAdapter,
    torch.optim.Adagrad: TorchAdagradAdapter,
}
