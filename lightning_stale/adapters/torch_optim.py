"""Adapters for torch.optim's Adam/AdamW/RAdam/NAdam, Adamax, Adafactor, SGD (momentum), RMSprop and Adagrad, with
states in any float dtype.

Moments seen: Adam/AdamW/RAdam/NAdam ``exp_avg`` -> m (beta1) and ``exp_avg_sq`` -> v (beta2); Adamax ``exp_avg``
-> m (beta1) and ``exp_inf`` -> v (a decayed running max of |g|, not an EMA: beta None); Adafactor ``variance``
(vectors) and its factored ``row_var`` and ``col_var`` (matrices) -> v (beta None: its beta2 follows a schedule); SGD
``momentum_buffer`` -> m (not an EMA: beta None); RMSprop ``square_avg`` -> v (beta = alpha); Adagrad ``sum`` -> v (a
running sum: beta None). Codes are the raw bits of the state tensor (a factor's, as each element of its parameter
reads it); the grid is the tensor's own dtype (bf16 parameters give bf16 states). Resets write buffers and the
``step`` tensor in place (fused/foreach/capturable keep their tensors).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from lightning_stale._compat import local_tensor
from lightning_stale.adapters.layouts import FLOAT_FORMATS, FloatSlot, ZeroLanes, dtype_ulp
from lightning_stale.adapters.protocol import Moment, OptimizerAdapter, SharedStepAdapter, Slot, resolve_moments
from lightning_stale.adapters.restart import restarted_v
from lightning_stale.adapters.sampling import Sample
from lightning_stale.formats.floats import round_up_float


def float_slot(param: Tensor, state: dict, key: str, moment: Moment, beta: float | None,
               layout: type[FloatSlot] = FloatSlot) -> FloatSlot:
    """A slot over the plain float tensor ``state[key]`` (this process's shard of a DTensor state under FSDP2)."""
    tensor = local_tensor(state[key])
    return layout(param, moment, beta, FLOAT_FORMATS.get(tensor.dtype, str(tensor.dtype)), key, tensor=tensor)


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """True when weight decay is applied to the parameter, not added to the gradient (AdamW)."""
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def _moment_grad(optimizer: torch.optim.Optimizer, group: dict, p: Tensor) -> Tensor | None:
    """``p.grad`` as the moments see it (fp32, this process's shard): negated under ``maximize``, plus coupled weight
    decay. None when the gradient is gone."""
    grad = local_tensor(p.grad)
    if grad is None:
        return None
    grad = -grad.float() if group.get("maximize", False) else grad.float()
    if group.get("weight_decay", 0) != 0 and not _decoupled(optimizer, group):
        grad = grad + group["weight_decay"] * local_tensor(p).detach().float()
    return grad


class TorchAdamAdapter(SharedStepAdapter):
    """``torch.optim.Adam``, ``AdamW`` (all foreach/fused/capturable/amsgrad variants) and ``RAdam``.

    One ``step`` per parameter serves both moments: a full reset is exact, an m-only reset zeroes m and keeps
    ``step`` (the next updates are smaller, a built-in warm-up), a v-only reset uses :mod:`.restart`. RAdam divides
    the same bias-corrected m by the same ``sqrt(v_hat)``, times its rectification term (at most 1), or does not read v
    at all (its first ~5 steps), so the restart bounds its next update too.
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
        grad = _moment_grad(self.optimizer, group, p)  # computed on this process's shards (DTensors under FSDP2)
        if group.get("capturable") or group.get("fused"):  # ``step`` lives on the device: computed there, unread
            step = local_tensor(state["step"]).double()
            target = restarted_v(self.numerator(group, state, grad, step), grad, step, group["betas"][1])
            target = torch.where(step == 0, 0.0, target)  # no step yet: v restarts from zero
        else:
            step = int(state["step"])
            if step == 0:
                state["exp_avg_sq"].zero_()
                return
            target = restarted_v(self.numerator(group, state, grad, step), grad, step, group["betas"][1])
        for key in ("exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                stored = local_tensor(state[key])
                stored.copy_(round_up_float(target, stored.dtype))

    def numerator(self, group: dict, state: dict, grad: Tensor | None, step: int | Tensor) -> Tensor:
        """The update numerator the restarted v must cover (:func:`.restart.restarted_v`): Adam's bias-corrected
        ``m / (1 - beta1**step)``, whose next value lies between it and the next gradient (``step``: a number, or a
        0-d tensor on the device)."""
        return local_tensor(state["exp_avg"]).float() / (1.0 - group["betas"][0] ** step)


def _nadam_mu(beta1: float, momentum_decay: float, step: int) -> float:
    """NAdam's momentum coefficient at ``step`` (its warm-up schedule)."""
    return beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay))


class TorchNAdamAdapter(TorchAdamAdapter):
    """``torch.optim.NAdam`` (for-loop, foreach, capturable, differentiable, maximize, ``decoupled_weight_decay``).

    Its m is bias-corrected by ``mu_product`` (the product of the momentum schedule so far), a scalar tensor a full
    reset refills with 1.0, a fresh optimizer's value, in place. An m-only reset zeroes m and keeps ``step`` and
    ``mu_product`` (m is then under-corrected: smaller next updates, as for Adam). The next update's numerator is
    ``A + B g'`` with ``A = c_m beta1 m`` and ``B = c_g + c_m (1 - beta1)`` (NAdam's gradient and momentum weights
    ``c_g``, ``c_m`` at the next step); the v-only restart covers ``max(|A|, |A + B g|)`` with ``g`` the last gradient,
    so the next update is at most about lr for every next gradient between 0 and ``g``.
    """

    def reset_all(self, state: dict) -> None:
        super().reset_all(state)
        state["mu_product"].fill_(1.0)

    def numerator(self, group: dict, state: dict, grad: Tensor | None, step: int) -> Tensor:
        beta1, decay = group["betas"][0], group["momentum_decay"]
        mu, mu_next = _nadam_mu(beta1, decay, step + 1), _nadam_mu(beta1, decay, step + 2)
        product = float(state["mu_product"]) * mu
        c_g = (1.0 - mu) / (1.0 - product)
        c_m = mu_next / (1.0 - product * mu_next)
        kept = c_m * beta1 * local_tensor(state["exp_avg"]).float()
        if grad is None:
            return kept.abs()
        return torch.maximum(kept.abs(), (kept + (c_g + c_m * (1.0 - beta1)) * grad.reshape(kept.shape)).abs())


class TorchAdamaxAdapter(SharedStepAdapter):
    """``torch.optim.Adamax`` (for-loop, foreach, capturable, differentiable, maximize).

    ``exp_inf`` is the update's denominator but not an EMA of g**2: ``max(beta2 * exp_inf, |g| + eps)``, a running
    max of |g| decayed by beta2 and never bias-corrected. Its slot is v with beta None, so its stalls are counted but
    the EMA theory, the drift shadow and theory resets leave it alone. Full reset: exact. m-only: zeroes m and keeps
    ``step``; ``exp_inf >= |g|`` bounds the next update by ``lr (1 - beta1) / (1 - beta1**(step + 1))``. v-only: a
    zeroed ``exp_inf`` would give ``lr m_hat / (|g| + eps)``, so ``exp_inf`` restarts at ``max(|m_hat|, |g|) / beta2``
    (rounded up): it decays to ``max(|m_hat|, |g|)`` in the next step, which bounds the next update by lr whatever the
    next gradient (``m_hat_next`` lies between ``m_hat`` and it), and tracks the gradients from there instead of an old
    maximum.
    """

    family = "torch.optim"

    def slots(self) -> list[Slot]:
        out: list[Slot] = []
        for group, p, state in self.stepped():
            out.append(float_slot(p, state, "exp_avg", "m", group["betas"][0]))
            out.append(float_slot(p, state, "exp_inf", "v", None))
        return out

    def reset_all(self, state: dict) -> None:
        for key in ("exp_avg", "exp_inf", "step"):
            state[key].zero_()

    def reset_m(self, state: dict) -> None:
        state["exp_avg"].zero_()

    def restart_v(self, group: dict, p: Tensor, state: dict) -> None:
        step = int(state["step"])
        stored = local_tensor(state["exp_inf"])
        if step == 0:
            stored.zero_()
            return
        beta1, beta2 = group["betas"]
        level = local_tensor(state["exp_avg"]).float().abs() / (1.0 - beta1**step)
        grad = _moment_grad(self.optimizer, group, p)
        if grad is not None:
            level = torch.maximum(level, grad.abs().reshape(level.shape))
        stored.copy_(round_up_float(level / beta2 if beta2 > 0 else level, stored.dtype))


@dataclass(eq=False, kw_only=True)
class FactorSlot(FloatSlot):
    """One factor of Adafactor's factored second moment (``row_var``, one value per row, or ``col_var``, one per
    column), read as each element of the parameter sees it: element (i, j) reads its row's (column's) factor, so its
    stall is that of the factor its estimate ``row_var[i] * col_var[j] / mean(row_var)`` took. No strided view maps
    elements to their row or column, so the sampled codes are gathered (``gathered``: read again at each snapshot)."""

    gathered: ClassVar[bool] = True

    def _broadcast(self, tensor: Tensor) -> Tensor:
        """``tensor`` (the factor's shape) as a view over this process's shard of the parameter."""
        return tensor.expand(local_tensor(self.param).shape)

    def codes(self) -> Tensor:
        return self._broadcast(super().codes())

    def value(self) -> Tensor:
        return self._broadcast(self.tensor).reshape(-1).float()

    def spacing(self) -> Tensor | None:
        return dtype_ulp(self._broadcast(self.tensor).reshape(-1))

    def sampled_codes(self, sample: Sample) -> Tensor:
        codes = self.codes()
        if sample.full:
            return sample.view(codes)
        return torch.take(codes, sample.positions(codes.device)).view(sample.count, sample.run)

    def codes_at(self, index: Tensor) -> Tensor:
        return torch.take(self.codes(), index)

    def value_at(self, index: Tensor) -> Tensor:
        return torch.take(self._broadcast(self.tensor), index).float()

    def spacing_at(self, index: Tensor) -> Tensor | None:
        return dtype_ulp(torch.take(self._broadcast(self.tensor), index))

    def zero_mask(self) -> Tensor:
        return self._broadcast(self.tensor == 0).reshape(-1)

    def zero_elements(self, mask: Tensor) -> None:
        Slot.zero_elements(self, mask)  # a zero written into a factor would zero its whole row or column: refused

    def zero_view(self) -> tuple[Tensor, int | float] | None:
        return None  # one stored value per row or column: no per-element view

    def zero_lanes(self) -> ZeroLanes | None:
        return None


class TorchAdafactorAdapter(OptimizerAdapter):
    """``torch.optim.Adafactor`` (torch >= 2.5; for-loop and foreach): v only, no first moment.

    Vectors keep ``variance`` (one value per element): a v slot. Matrices keep ``row_var`` and ``col_var`` (the last
    two dims factored): two v slots, :class:`FactorSlot`. beta is None: beta2 is ``1 - step**beta2_decay``, a schedule
    (0 at step 1, 0.996 at step 1000, 0.9994 at 10,000 by default), not the constant beta the stall theory and the
    drift shadow assume. That schedule is v's bias correction and ``step`` serves v alone (and the relative step size
    ``min(lr, 1/sqrt(step))``), so a v reset zeroes ``variance`` or both factors, and ``step``, in place: the exact
    fresh state. Its next step (beta2 = 0) writes ``g**2`` (its row and column means) and takes a fresh optimizer's
    first step, which update clipping bounds (RMS at most ``d * lr * max(eps2, RMS(param))``); past step ``1/lr**2``
    the relative step size is then ``lr`` again, up to ``lr * sqrt(step)`` times the one before. A factor whose shard
    does not spread over the parameter's shard is not read, warned once.
    """

    family = "torch.optim"
    exact_moment_reset = True

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._unread: set[tuple[int, str]] = set()  # (parameter, factor) pairs warned about

    def slots(self) -> list[Slot]:
        out: list[Slot] = []
        for _, p, state in self.stepped():
            if "variance" in state:
                out.append(float_slot(p, state, "variance", "v", None))
            for key in ("row_var", "col_var"):
                if key in state:
                    out.extend(self._factor_slot(p, state, key))
        return out

    def _factor_slot(self, p: Tensor, state: dict, key: str) -> list[Slot]:
        """``state[key]`` as a :class:`FactorSlot`, or none (warned once) where its shard does not spread over the
        parameter's (each dim 1 or the parameter's)."""
        slot = float_slot(p, state, key, "v", None, FactorSlot)
        shard = local_tensor(p).shape
        if slot.tensor.dim() == len(shard) and all(f in (1, n) for f, n in zip(slot.tensor.shape, shard)):
            return [slot]
        if (id(p), key) not in self._unread:
            self._unread.add((id(p), key))
            index = next(i for i, q in enumerate(q for g in self.optimizer.param_groups for q in g["params"]) if q is p)
            warnings.warn(f"Adafactor: parameter {index} (shape {tuple(shard)}): its {key} here has shape "
                          f"{tuple(slot.tensor.shape)}, which does not spread over the parameter's shard; it is not "
                          "measured on this process", stacklevel=3)
        return []

    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        if "v" not in resolve_moments(moments):
            return
        for _, _, state in self.stepped(params):
            for key in ("row_var", "col_var", "variance", "step"):
                if key in state:
                    state[key].zero_()


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
    torch.optim.RAdam: TorchAdamAdapter,
    torch.optim.NAdam: TorchNAdamAdapter,
    torch.optim.Adamax: TorchAdamaxAdapter,
    torch.optim.SGD: TorchSGDAdapter,
    torch.optim.RMSprop: TorchRMSpropAdapter,
    torch.optim.Adagrad: TorchAdagradAdapter,
}
if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
    ADAPTERS[torch.optim.Adafactor] = TorchAdafactorAdapter
