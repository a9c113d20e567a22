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
from lightning_stale.formats.noise import as_int32, counter_bits, counter_mix, keyed_hash
from lightning_stale.transfers import to_device
from lightning_stale.vocab import MOMENTS, Moment, check_choice, check_moments

_KEYS = {"m": ("exp_avg", "exp_avg_scale", "step_m"), "v": ("exp_avg_sq", "exp_avg_sq_scale", "step_v")}
_GENERATOR_KEY = "generator_state"
_SECOND_KEY = 0x6B657973  # the second hash stream of a parameter's position (its noise key, beside its start)


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
        self._step_key: tuple[int, int] | None = None  # the noise key pair of the step in progress
        self._in_step = False
        self._position_of: dict[int, int] | None = None  # id(param) -> its position among the optimizer's
        self._base_tables: dict[torch.device, Tensor] = {}  # per device: :meth:`_bases`
        self._eager_on: set[str] = set()  # device types where the compiled step failed: eager from then on
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
        """The param's state, created fresh (both moments empty, ages 0) on first use, on the param's device (the
        ages too, as torch's fused and capturable optimizers keep ``step``: the bias corrections are computed there,
        and nothing is read back)."""
        state = self.state[param]
        if not state:
            for moment in MOMENTS:
                codes_key, scale_key, age_key = _KEYS[moment]
                state_format = self._format_in_group(group, param, moment)  # built (once) on the host
                with torch.device(param.device):  # the format's factories make the state there: nothing to upload
                    fresh = state_format.empty(param.shape)
                state[codes_key] = fresh.codes
                if fresh.scale is not None:
                    state[scale_key] = fresh.scale
                state[age_key] = torch.zeros((), dtype=torch.float32, device=param.device)
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
                    state_format = self._format_in_group(group, param, moment)
                    with torch.device(state[codes_key].device):  # made where it is copied to: no upload
                        fresh = state_format.empty(param.shape)
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
        self._step_key = None  # this step's noise key, drawn at its first use (inside the closure or below)
        self._in_step = True
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            work = []
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if param.grad.is_sparse:
                        raise RuntimeError("QuantizedAdamW does not support sparse gradients")
                    work.append((param, group))
            self.step_parameters(work)
        finally:
            self._in_step = False
        return loss

    @torch.no_grad()
    def step_parameter(self, param: Tensor, group: dict[str, Any], weight: Tensor | None = None) -> None:
        """One parameter's step, as :meth:`step` takes it (its gradient must exist). With ``weight`` (fp32, shaped like
        ``param``), the update is applied to ``weight`` in place instead of to the parameter: the caller writes the
        parameter (the weight write-back's rounding)."""
        self.step_parameters([(param, group)], [weight])

    @torch.no_grad()
    def step_parameters(self, work: Sequence[tuple[Tensor, dict[str, Any]]],
                        weights: Sequence[Tensor | None] | None = None) -> None:
        """The step of each (parameter, its group) of ``work`` (:meth:`step_parameter`, ``weights`` aligned with them):
        their ages advanced and their per-step numbers (bias corrections, hyper-parameters, stochastic-rounding
        keys) computed together on their devices, with nothing read back or uploaded, then each one's update."""
        if not work:
            return
        states = [self._state_for(param, group) for param, group in work]
        torch._foreach_add_([s[key] for s in states for key in ("step_m", "step_v")], 1)
        hyper = self._hyper(work, states)
        keys = self._keys(work)
        for i, ((param, group), state) in enumerate(zip(work, states)):
            self._update_one(param, group, state, hyper[i], None if keys is None else keys[i],
                             None if weights is None else weights[i])

    def _hyper(self, work: Sequence[tuple[Tensor, dict[str, Any]]], states: list[dict[str, Any]]) -> list[Tensor]:
        """Each parameter's :func:`_update` scalars (fp32, on its device): per group and device, a dozen tensor ops on
        the ages (fp64), with the group's hyper-parameters as Python numbers."""
        sets: dict[tuple[int, torch.device], list[int]] = {}
        for i, (param, group) in enumerate(work):
            sets.setdefault((id(group), param.device), []).append(i)
        rows: list[Tensor] = [None] * len(work)  # type: ignore[list-item]
        for chosen in sets.values():
            group = work[chosen[0]][1]
            (beta1, beta2), lr, eps, weight_decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            ages = torch.stack([torch.stack([states[i]["step_m"], states[i]["step_v"]]) for i in chosen]).double()
            corrections = 1.0 - torch.stack([beta1 ** ages[:, 0], beta2 ** ages[:, 1]], dim=1)  # 1 - beta^age
            ones = torch.ones_like(corrections[:, 0])
            table = torch.stack([ones * (1 - beta1), ones * beta2, ones * (1 - beta2), ones * (1 - lr * weight_decay),
                                 corrections[:, 1].sqrt(), ones * eps, -lr / corrections[:, 0]], dim=1).float()
            for j, i in enumerate(chosen):
                rows[i] = table[j]
        return rows

    def _keys(self, work: Sequence[tuple[Tensor, dict[str, Any]]]) -> list[Tensor | None] | None:
        """Each stochastically rounded parameter's two 32-bit hash keys of this step (int32, on its device), None for
        the others; None when none rounds stochastically. One key pair per step comes from the optimizer's own
        generator (on the host: nothing is read back); each parameter's are its hashes under them of its position
        among the optimizer's parameters (a table made on each device once)."""
        if not any(group["rounding"] == "stochastic" for _, group in work):
            return None
        if not self._in_step or self._step_key is None:
            drawn = torch.randint(0, 1 << 32, (2,), generator=self._generator, dtype=torch.int64).tolist()
            self._step_key = tuple(as_int32(k) for k in drawn)
        start, key = self._step_key
        position = self._positions(work)
        keys: list[Tensor | None] = []
        tables: dict[torch.device, Tensor] = {}
        for param, group in work:
            if group["rounding"] != "stochastic":
                keys.append(None)
                continue
            if param.device not in tables:
                base = self._bases(param.device)
                tables[param.device] = torch.stack([keyed_hash(base[:, 0], start), keyed_hash(base[:, 1], key)], 1)
            keys.append(tables[param.device][position[id(param)]])
        return keys

    def _positions(self, work: Sequence[tuple[Tensor, dict[str, Any]]]) -> dict[int, int]:
        """Each parameter's position among the optimizer's (the noise keys' counter), made again when a parameter of
        ``work`` is not in it (a param group added)."""
        if self._position_of is None or any(id(param) not in self._position_of for param, _ in work):
            params = [p for group in self.param_groups for p in group["params"]]
            self._position_of, self._base_tables = {id(p): i for i, p in enumerate(params)}, {}
        return self._position_of

    def _bases(self, device: torch.device) -> Tensor:
        """The key-independent round of the hash of every parameter's position and of its second stream, (n, 2)
        int32 on ``device`` (made once per device: one pinned upload)."""
        if device not in self._base_tables:
            positions = torch.arange(len(self._position_of), dtype=torch.int32)
            base = torch.stack([counter_mix(positions), counter_mix(positions ^ _SECOND_KEY)], dim=1)
            self._base_tables[device] = to_device(base, device)
        return self._base_tables[device]

    def _update_one(self, param: Tensor, group: dict[str, Any], state: dict[str, Any], hyper: Tensor,
                    keys: Tensor | None, weight: Tensor | None) -> None:
        """One parameter's update (:func:`_update`, compiled where :meth:`_compiles` says so and the compile works) and
        the copy of its new moments into its state."""
        m_codes, m_scale, _ = (state.get(key) for key in _KEYS["m"])
        v_codes, v_scale, _ = (state.get(key) for key in _KEYS["v"])
        formats = (self._format_in_group(group, param, "m"), self._format_in_group(group, param, "v"))
        result = None
        if self._compiles(param, formats, group["rounding"]):
            # Flat views of the same storage: one symbolic size per compiled step, whatever the parameter's shape.
            # detach(): dynamo specializes the shapes of parameters, not of plain tensors; the scalars are a copy of
            # their table's row (not a view with an offset).
            flat = [t if t is None or t.dim() == 1 else t.view(-1) for t in (m_codes, v_codes)]
            try:
                result = _compiled_update()(
                    param.detach().view(-1), param.grad.view(-1), flat[0], m_scale, flat[1], v_scale, hyper.clone(),
                    None if keys is None else keys.clone(), *formats, self.count_stalls,
                    None if weight is None else weight.view(-1))
            except Exception as error:  # noqa: BLE001 - no working compiler for this device: the eager step
                self._eager_on.add(param.device.type)
                _compat.log.info("[lightning_stale] QuantizedAdamW: the compiled step is unavailable on %s (%s: %s); "
                                 "using eager ops", param.device.type, type(error).__name__, error)
        if result is None:
            result = _update(param, param.grad, m_codes, m_scale, v_codes, v_scale, hyper, keys, *formats,
                             self.count_stalls, weight)
        new_m, new_v, counts = result
        for codes, scale, new in ((m_codes, m_scale, new_m), (v_codes, v_scale, new_v)):
            codes.copy_(new.codes.view(codes.shape))
            if scale is not None:
                scale.copy_(new.scale)
        if counts is not None:
            stalled_m, stalled_v, counted = counts
            self._stall_counts[id(param)] = {"m": (stalled_m, counted), "v": (stalled_v, counted)}

    def _compiles(self, param: Tensor, formats: tuple[StateFormat, StateFormat], rounding: str) -> bool:
        """Whether ``param``'s step, with its (m, v) ``formats`` and ``rounding``, runs compiled (see ``compile``)."""
        if not (param.is_contiguous() and param.grad.is_contiguous()) or param.device.type in self._eager_on:
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
