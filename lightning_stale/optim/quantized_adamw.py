"""``QuantizedAdamW``: AdamW whose moments are stored in any :mod:`lightning_stale.formats` format.

Each step follows the paper's Algorithm 1: dequantize both moments, update them in fp32, update the parameter from
the unrounded fp32 moments (decoupled weight decay, as ``torch.optim.AdamW``), then write the moments back in their
format. Each moment keeps its own bias-correction age (``step_m``, ``step_v``) so one moment can be reset alone, and
the step counts how many stored codes it left unchanged (the stall counts the callback reads).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, Callable, Literal

import torch
from torch import Tensor

from lightning_stale.formats import (
    FORMAT_NAMES,
    QuantizedState,
    StateFormat,
    check_format_name,
    check_rounding,
    get_format,
)

Moment = Literal["m", "v"]
MOMENTS: tuple[Moment, ...] = ("m", "v")
_KEYS = {"m": ("exp_avg", "exp_avg_scale", "step_m"), "v": ("exp_avg_sq", "exp_avg_sq_scale", "step_v")}
_GENERATOR_KEY = "generator_state"


def _format_names(state_format: object) -> dict[str, str]:
    """``{"m": name, "v": name}`` from one name or a mapping; ValueError/TypeError naming the allowed values."""
    if isinstance(state_format, str):
        names = {"m": state_format, "v": state_format}
    elif isinstance(state_format, Mapping):
        if set(state_format) != {"m", "v"}:
            raise ValueError(f"state_format mapping must have exactly the keys 'm' and 'v', got {sorted(state_format)}")
        names = {"m": state_format["m"], "v": state_format["v"]}
    else:
        raise TypeError(f"state_format must be a name from {FORMAT_NAMES} or a mapping {{'m': name, 'v': name}}")
    for moment, name in names.items():
        check_format_name(name, f"state_format[{moment!r}]")
    return names


class QuantizedAdamW(torch.optim.Optimizer):
    """AdamW with low-precision moment storage, per-moment bias-correction ages and built-in stall counting.

    Args:
        params: parameters or param groups; groups may override ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``state_format``, ``rounding`` and ``min_quantized_size``.
        state_format: a name from ``FORMAT_NAMES`` for both moments, or ``{"m": name, "v": name}``.
        rounding: ``"nearest"`` or ``"stochastic"`` (the write-back rounding of the stored moments).
        min_quantized_size: parameters with fewer elements keep fp32 moments.
        seed: seed of the optimizer's own generator for stochastic rounding (the global RNG is never used).
        count_stalls: count unchanged codes per parameter and moment during each step.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_format: str | Mapping[str, str] = "int8_dynamic",
        rounding: str = "nearest",
        min_quantized_size: int = 4096,
        seed: int = 0,
        count_stalls: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            state_format=state_format,
            rounding=rounding,
            min_quantized_size=min_quantized_size,
        )
        self.count_stalls = bool(count_stalls)
        self._generator = torch.Generator()
        self._generator.manual_seed(int(seed))
        self._stall_counts: dict[int, dict[str, tuple[Tensor, Tensor]]] = {}
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------------------------------------
    # Construction and validation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._validate_group(self.param_groups[-1])

    @staticmethod
    def _validate_group(group: dict[str, Any]) -> None:
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        if not isinstance(lr, (int, float)) or lr < 0:
            raise ValueError(f"lr must be a non-negative number, got {lr!r}")
        if not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise ValueError(f"weight_decay must be a non-negative number, got {weight_decay!r}")
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2) with each in [0, 1), got {betas!r}")
        for i, beta in enumerate(betas):
            if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta!r}")
        group["state_format"] = _format_names(group["state_format"])
        check_rounding(group["rounding"])
        size = group["min_quantized_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"min_quantized_size must be a non-negative int, got {size!r}")

    # ----------------------------------------------------------------------------------------------------------------
    # State access

    def _group_of(self, param: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise ValueError("param is not managed by this optimizer")

    @staticmethod
    def _format_in_group(group: dict[str, Any], param: Tensor, moment: Moment) -> StateFormat:
        name = group["state_format"][moment] if param.numel() >= group["min_quantized_size"] else "fp32"
        return get_format(name, signed=(moment == "m"))

    def moment_format(self, param: Tensor, moment: Moment) -> StateFormat:
        """The format ``param``'s moment ``"m"`` or ``"v"`` is stored in."""
        _check_moment(moment)
        return self._format_in_group(self._group_of(param), param, moment)

    def moment_state(self, param: Tensor, moment: Moment) -> QuantizedState:
        """The stored moment of ``param`` as a :class:`QuantizedState` whose tensors are the optimizer's own (views,
        so in-place edits change the optimizer). Creates the fresh state if the parameter has not stepped yet."""
        _check_moment(moment)
        return _stored(self._state_for(param, self._group_of(param)), param, moment)

    def _state_for(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The param's state, created fresh (both moments empty, ages 0) on first use."""
        state = self.state[param]
        if not state:
            for moment in MOMENTS:
                codes_key, scale_key, age_key = _KEYS[moment]
                fresh = self._format_in_group(group, param, moment).empty(param.shape)
                state[codes_key] = fresh.codes.to(param.device)
                if fresh.scale is not None:
                    state[scale_key] = fresh.scale.to(param.device)
                state[age_key] = torch.zeros((), dtype=torch.float32)
        return state

    def last_stall_counts(self) -> dict[int, dict[str, tuple[Tensor, Tensor]]]:
        """Per ``id(param)`` and moment: ``(stalled, counted)`` 0-d int64 tensors from the most recent step.

        ``counted`` is the number of elements whose gradient was non-zero and finite; ``stalled`` the number of those
        whose stored code the step left unchanged. Empty when ``count_stalls`` is False.
        """
        return self._stall_counts

    @torch.no_grad()
    def reset_moments(self, moments: Sequence[Moment] = MOMENTS, params: Iterable[Tensor] | None = None) -> None:
        """The paper's reset, in place: each chosen moment back to its fresh (zero) value and its own age to 0."""
        moments = tuple(moments)
        for moment in moments:
            _check_moment(moment)
        chosen = None if params is None else {id(p) for p in params}
        for group in self.param_groups:
            for param in group["params"]:
                if (chosen is not None and id(param) not in chosen) or not self.state[param]:
                    continue
                state = self.state[param]
                for moment in moments:
                    codes_key, scale_key, age_key = _KEYS[moment]
                    fresh = self._format_in_group(group, param, moment).empty(param.shape)
                    state[codes_key].copy_(fresh.codes)
                    if fresh.scale is not None:
                        state[scale_key].copy_(fresh.scale)
                    state[age_key].zero_()

    # ----------------------------------------------------------------------------------------------------------------
    # The step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stall_counts = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("QuantizedAdamW does not support sparse gradients")
                self._step_param(param, group)
        return loss

    def _step_param(self, param: Tensor, group: dict[str, Any]) -> None:
        state = self._state_for(param, group)
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay, rounding = group["lr"], group["eps"], group["weight_decay"], group["rounding"]
        grad = param.grad.to(torch.float32)
        formats = {moment: self._format_in_group(group, param, moment) for moment in MOMENTS}
        stored = {moment: _stored(state, param, moment) for moment in MOMENTS}

        m = formats["m"].dequantize(stored["m"])
        v = formats["v"].dequantize(stored["v"])
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["step_m"] += 1
        state["step_v"] += 1

        # Write the moments back (from the unrounded values) and count the codes the write left unchanged.
        counts = {}
        counted_mask = counted = None
        if self.count_stalls:  # counted: 0 < |g| < inf (NaN compares false); cheaper than isfinite & ne
            magnitude = grad.abs().reshape(-1)
            counted_mask = (magnitude > 0).logical_and_(magnitude < math.inf)
            counted = torch.count_nonzero(counted_mask)
        for moment, value in (("m", m), ("v", v)):
            new = formats[moment].quantize(value, rounding, self._generator)
            if counted_mask is not None:
                unchanged = formats[moment].element_codes(new) == formats[moment].element_codes(stored[moment])
                counts[moment] = (torch.count_nonzero(unchanged.logical_and_(counted_mask)), counted)
            stored[moment].codes.copy_(new.codes)
            if new.scale is not None:
                stored[moment].scale.copy_(new.scale)
        if counts:
            self._stall_counts[id(param)] = counts

        # Parameter update from the unrounded fp32 moments, exactly as torch.optim.AdamW.
        bias_correction1 = 1 - beta1 ** state["step_m"].item()
        bias_correction2 = 1 - beta2 ** state["step_v"].item()
        target = param if param.dtype == torch.float32 else param.float()
        target.mul_(1 - lr * weight_decay)
        denom = v.sqrt_().div_(math.sqrt(bias_correction2)).add_(eps)
        target.addcdiv_(m, denom, value=-lr / bias_correction1)
        if target is not param:
            param.copy_(target)

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The usual optimizer state dict plus the stochastic-rounding generator state (plain tensors only)."""
        state_dict = super().state_dict()
        state_dict[_GENERATOR_KEY] = self._generator.get_state()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; stored codes keep their dtypes (torch would cast them to the parameter dtype)."""
        state_dict = dict(state_dict)
        generator_state = state_dict.pop(_GENERATOR_KEY, None)
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, param in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            for key, value in saved.items():
                if isinstance(value, Tensor):
                    self.state[param][key] = value.to(device=param.device, copy=True)
        for group in self.param_groups:
            self._validate_group(group)
        if generator_state is not None:
            self._generator.set_state(generator_state)


def _stored(state: dict[str, Any], param: Tensor, moment: Moment) -> QuantizedState:
    codes_key, scale_key, _ = _KEYS[moment]
    return QuantizedState(state[codes_key], state.get(scale_key), param.shape)


def _check_moment(moment: str) -> None:
    if moment not in MOMENTS:
        raise ValueError(f"moment must be one of {MOMENTS}, got {moment!r}")
