"""``QuantizedAdamW``: AdamW whose moments are stored in any :mod:`lightning_stale.formats` format.

Each step follows the paper's Algorithm 1: dequantize both moments, update them in fp32, update the parameter from
the unrounded fp32 moments (decoupled weight decay, as ``torch.optim.AdamW``), then write the moments back in their
format. Each moment keeps its own bias-correction age (``step_m``, ``step_v``) so one moment can be reset alone, and
with ``count_stalls=True`` the step counts how many stored codes it left unchanged (an exact count for diagnostics;
the monitor samples the stored codes itself).

One function, :func:`_update`, does all of this for one parameter. It runs eagerly for small parameters and, where a
C++ compiler is available, fused by ``torch.compile`` (one Inductor kernel instead of 30-40 elementwise passes) for
large ones; both give the same stored codes, scales, stall counts and stochastic-rounding stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import chain
from typing import Any, Callable

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale.formats import (
    FORMATS,
    QuantizedState,
    StateFormat,
    check_format_name,
    check_rounding,
    get_format,
)
from lightning_stale.formats.noise import counter_bits
from lightning_stale.vocab import MOMENTS, Moment, check_choice, check_moments

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
        raise TypeError(f"state_format must be a name from {tuple(FORMATS)} or a mapping {{'m': name, 'v': name}}")
    for moment, name in names.items():
        check_format_name(name, f"state_format[{moment!r}]")
    return names


class QuantizedAdamW(torch.optim.Optimizer):
    """AdamW with low-precision moment storage, per-moment bias-correction ages and built-in stall counting.

    Args:
        params: parameters or param groups; groups may override ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``state_format``, ``rounding`` and ``min_quantized_size``.
        state_format: a registered format name (``FORMATS``) for both moments, or ``{"m": name, "v": name}``.
        rounding: ``"nearest"`` or ``"stochastic"`` (the write-back rounding of the stored moments).
        min_quantized_size: parameters with fewer elements keep fp32 moments.
        seed: seed of the optimizer's own generator for stochastic rounding (the global RNG is never used).
        count_stalls: count unchanged codes per parameter and moment during each step (exact counts for your own
            analysis; off by default, and not needed by the monitor, which samples the stored codes itself).
        compile: fuse each parameter's step with ``torch.compile`` (Inductor CPU/GPU kernels, a one-off compile of
            ~10-20 s per format pair and rounding); None compiles parameters with at least ``_compat.COMPILE_MIN_NUMEL``
            elements when a C++ compiler is on PATH, except table-rounded formats (``StateFormat.table_rounded``:
            int8_dynamic, fp4) with nearest rounding on CPU, whose eager step is faster. Compiled and eager steps
            give the same codes and the same stochastic-rounding stream (noise hashed from per-step keys drawn from
            ``seed``'s generator).
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
        count_stalls: bool = False,
        compile: bool | None = None,
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
        if compile not in (None, True, False):
            raise ValueError(f"compile must be None, True or False, got {compile!r}")
        self.count_stalls = bool(count_stalls)
        self.compile = compile
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
        check_choice("moment", moment, MOMENTS)
        return self._format_in_group(self._group_of(param), param, moment)

    def moment_state(self, param: Tensor, moment: Moment) -> QuantizedState:
        """The stored moment of ``param`` as a :class:`QuantizedState` whose tensors are the optimizer's own (views,
        so in-place edits change the optimizer). Creates the fresh state if the parameter has not stepped yet."""
        check_choice("moment", moment, MOMENTS)
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
                # On the host, like torch.optim's non-capturable ``step``: the bias corrections read it without a sync.
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
        moments = check_moments(moments)
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
        self._stall_counts = {}  # before the closure: a step written inside it (the weight write-back) counts too
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("QuantizedAdamW does not support sparse gradients")
                self.step_parameter(param, group)
        return loss

    @torch.no_grad()
    def step_parameter(self, param: Tensor, group: dict[str, Any], weight: Tensor | None = None) -> None:
        """One parameter's step, as :meth:`step` takes it (its gradient must exist). With ``weight`` (fp32, shaped like
        ``param``), the update is applied to ``weight`` in place instead of to the parameter: the caller writes the
        parameter (the weight write-back's rounding)."""
        state = self._state_for(param, group)
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        state["step_m"] += 1
        state["step_v"] += 1
        bias_correction1 = 1 - beta1 ** state["step_m"].item()
        bias_correction2 = 1 - beta2 ** state["step_v"].item()
        hyper = torch.tensor(  # a tensor, so the compiled step is not specialized to these values
            [1 - beta1, beta2, 1 - beta2, 1 - lr * weight_decay, math.sqrt(bias_correction2), eps,
             -lr / bias_correction1],
            device=param.device,
        )
        keys = None
        if group["rounding"] == "stochastic":  # two 32-bit hash keys per step from the optimizer's own generator
            keys = torch.randint(0, 1 << 32, (2,), generator=self._generator, dtype=torch.int64).to(param.device)
        m_codes, m_scale, _ = (state.get(key) for key in _KEYS["m"])
        v_codes, v_scale, _ = (state.get(key) for key in _KEYS["v"])
        formats = (self._format_in_group(group, param, "m"), self._format_in_group(group, param, "v"))
        if self._compiles(param, formats, group["rounding"]):
            # Flat views of the same storage: one symbolic size per compiled step, whatever the parameter's shape.
            # detach(): dynamo specializes the shapes of parameters, not of plain tensors.
            flat = [t if t is None or t.dim() == 1 else t.view(-1) for t in (m_codes, v_codes)]
            new_m, new_v, counts = _compiled_update()(
                param.detach().view(-1), param.grad.view(-1), flat[0], m_scale, flat[1], v_scale, hyper, keys,
                *formats, self.count_stalls, None if weight is None else weight.view(-1))
        else:
            new_m, new_v, counts = _update(
                param, param.grad, m_codes, m_scale, v_codes, v_scale, hyper, keys, *formats, self.count_stalls,
                weight)
        for codes, scale, new in ((m_codes, m_scale, new_m), (v_codes, v_scale, new_v)):
            codes.copy_(new.codes.view(codes.shape))
            if scale is not None:
                scale.copy_(new.scale)
        if counts is not None:
            stalled_m, stalled_v, counted = counts
            self._stall_counts[id(param)] = {"m": (stalled_m, counted), "v": (stalled_v, counted)}

    def _compiles(self, param: Tensor, formats: tuple[StateFormat, StateFormat], rounding: str) -> bool:
        """Whether ``param``'s step, with its (m, v) ``formats`` and ``rounding``, runs compiled (see ``compile``)."""
        if not (param.is_contiguous() and param.grad.is_contiguous()):
            return False
        if self.compile is None:
            # Table-rounded formats stay eager on CPU with nearest rounding: the eager step (index_select) measured
            # faster (BENCHMARKS.md, optimizer step time); with stochastic rounding the eager noise hash costs more
            # and the compiled step wins.
            table_on_cpu = (param.device.type == "cpu" and rounding == "nearest"
                            and any(f.table_rounded for f in formats))
            return not table_on_cpu and _compat.compiles(param.numel(), param.device)
        return self.compile

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


def _update(
    param: Tensor,
    grad: Tensor,
    m_codes: Tensor,
    m_scale: Tensor | None,
    v_codes: Tensor,
    v_scale: Tensor | None,
    hyper: Tensor,
    keys: Tensor | None,
    m_format: StateFormat,
    v_format: StateFormat,
    count_stalls: bool,
    weight: Tensor | None = None,
) -> tuple[QuantizedState, QuantizedState, tuple[Tensor, Tensor, Tensor] | None]:
    """One parameter's step: dequantize both moments, update them in fp32, requantize them (stochastic rounding when
    ``keys`` is given), count unchanged codes, update the parameter in place from the unrounded moments exactly as
    ``torch.optim.AdamW``. Pure tensor ops, run as is or fused by torch.compile. The caller copies the new moments
    into the state: Inductor then reads each old code once, in the same loop that counts and writes.

    ``hyper``: fp32 (1 - beta1, beta2, 1 - beta2, 1 - lr * weight_decay, sqrt(bias_correction2), eps, -lr /
    bias_correction1). ``weight``: an fp32 tensor updated in place instead of the parameter (the caller writes it).
    Returns the new m and v and (stalled m, stalled v, counted) when ``count_stalls``, else None.
    """
    lerp_weight, beta2, one_minus_beta2, decay, sqrt_bias_correction2, eps, step_size = hyper.unbind()
    grad = grad.to(torch.float32)
    old_m = QuantizedState(m_codes, m_scale, param.shape)
    old_v = QuantizedState(v_codes, v_scale, param.shape)
    # Written out as separate multiplies and adds: eager lerp_/addcmul_/addcdiv_ use fused multiply-adds that
    # Inductor does not, and these forms give bit-identical results eager and compiled.
    m = m_format.dequantize(old_m)
    m.add_((grad - m).mul_(lerp_weight))
    v = v_format.dequantize(old_v).mul_(beta2).add_((one_minus_beta2 * grad).mul_(grad))

    m_noise = v_noise = None
    if keys is not None:
        m_noise, v_noise = (noise.view(param.shape) for noise in counter_bits(keys, param.numel()))
    new_m = m_format.quantize_with_noise(m, m_noise)
    new_v = v_format.quantize_with_noise(v, v_noise)
    counts = None
    if count_stalls:  # counted: 0 < |g| < inf (NaN compares false); cheaper than isfinite & ne
        magnitude = grad.abs().reshape(-1)
        counted_mask = (magnitude > 0).logical_and_(magnitude < math.inf)
        stalled = [
            (_comparable_codes(fmt, new) == _comparable_codes(fmt, old)).logical_and_(counted_mask).sum()
            for fmt, new, old in ((m_format, new_m, old_m), (v_format, new_v, old_v))
        ]
        counts = (stalled[0], stalled[1], counted_mask.sum())
    target = weight if weight is not None else param if param.dtype == torch.float32 else param.float()
    target.mul_(decay)
    denom = v.sqrt_().div_(sqrt_bias_correction2).add_(eps)
    target.add_(m.mul_(step_size).div_(denom))
    if weight is None and target is not param:
        param.copy_(target)
    return new_m, new_v, counts


def _comparable_codes(state_format: StateFormat, q: QuantizedState) -> Tensor:
    """int32 per element, equal iff :meth:`StateFormat.element_codes` are equal. 16-bit floats are widened to their
    fp32 bit patterns (exact) because Inductor does not vectorize int16 bitcasts; a sum over an unvectorized compare
    would cost a scalar pass over the whole fused step."""
    if q.codes.dtype in (torch.bfloat16, torch.float16):
        return q.codes.float().view(torch.int32).reshape(-1)
    return state_format.element_codes(q).int()


@lru_cache(maxsize=1)
def _compiled_update() -> Callable[..., tuple[QuantizedState, QuantizedState, tuple[Tensor, Tensor, Tensor] | None]]:
    """:func:`_update` compiled once with dynamic shapes (Inductor fuses it into a few loops per parameter); dynamo
    specializes it per format pair, rounding and ``count_stalls``."""
    return torch.compile(_update, dynamic=True)


def _stored(state: dict[str, Any], param: Tensor, moment: Moment) -> QuantizedState:
    codes_key, scale_key, _ = _KEYS[moment]
    return QuantizedState(state[codes_key], state.get(scale_key), param.shape)
