"""Adapter for :class:`lightning_stale.optim.QuantizedAdamW`: per-moment ages.

Moments: ``exp_avg`` -> m (beta1), ``exp_avg_sq`` -> v (beta2), each in the format the optimizer reports
(``moment_format``); the slots read the optimizer's own tensors (``moment_state``).

Resets: both moments (and both ages) restart exactly; m alone restarts exactly with its own age. v alone uses the
bounded restart of :mod:`.restart` by default, like the shared-step adapters: the paper's exact asymmetric reset (v
and its age from zero, m kept) makes the next update ``lr * m_hat / |g|`` per element, unbounded where the new
gradient is small (BENCHMARKS.md, reset safety), so it runs only through :meth:`reset_exact`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_stale.adapters.layouts import BlockFp8Slot, BlockQmapSlot, FloatSlot, Packed4bitSlot
from lightning_stale.adapters.protocol import MOMENTS, Moment, OptimizerAdapter, Slot, resolve_moments
from lightning_stale.adapters.restart import restarted_v, round_up_blockwise, round_up_float, round_up_fp8_blockwise
from lightning_stale.formats import QuantizedState, StateFormat
from lightning_stale.formats.base import pack_nibbles
from lightning_stale.formats.int8_dynamic import BLOCK_SIZE as INT8_BLOCK
from lightning_stale.formats.int8_dynamic import dynamic_map
from lightning_stale.optim import QuantizedAdamW
from lightning_stale.vocab import Rounding

KEYS = {"m": "exp_avg", "v": "exp_avg_sq"}
FP4_BLOCK = 128


def fp4_values(fmt: StateFormat) -> Tensor:
    """The 16 values of the format's 4-bit codes (scale 1), by code."""
    codes = torch.arange(16, dtype=torch.uint8)
    return fmt.dequantize(QuantizedState(pack_nibbles(codes), torch.ones(1), torch.Size([16])))


def format_slot(p: Tensor, moment: Moment, beta: float, fmt: StateFormat, q: QuantizedState) -> Slot:
    """A slot over one stored moment, using the slot layout that matches the format's storage."""
    key = KEYS[moment]
    if fmt.name == "int8_dynamic":
        return BlockQmapSlot(p, moment, beta, fmt.name, key, stored=q.codes, scale=q.scale,
                             qmap=dynamic_map(fmt.signed), block_size=INT8_BLOCK)
    if fmt.name == "fp4":
        return Packed4bitSlot(p, moment, beta, fmt.name, key, stored=q.codes, scale=q.scale, qmap=fp4_values(fmt),
                              block_size=FP4_BLOCK)
    if fmt.name == "fp8_e4m3":  # one scale for the whole tensor
        return BlockFp8Slot(p, moment, beta, fmt.name, key, stored=q.codes, scale=q.scale,
                            block_size=q.codes.numel())
    if q.scale is None:
        return FloatSlot(p, moment, beta, fmt.name, key, tensor=q.codes)
    raise TypeError(f"QuantizedAdamW adapter: no slot layout for state format {fmt.name!r}")


class QuantizedAdamWAdapter(OptimizerAdapter):
    """Exact resets of both moments or of m (``reset_moments``); a bounded v-only restart (``reset_exact``: the
    paper's unbounded one)."""

    family = "lightning_stale"
    exact_moment_reset = True

    def slots(self) -> list[Slot]:
        out: list[Slot] = []
        for group, p, _ in self.stepped():
            for moment, beta in zip(MOMENTS, group["betas"]):
                fmt = self.optimizer.moment_format(p, moment)
                out.append(format_slot(p, moment, beta, fmt, self.optimizer.moment_state(p, moment)))
        return out

    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        chosen = resolve_moments(moments)
        if chosen != {"v"}:
            self.reset_exact(moments, params)
            return
        for group, p, state in self.stepped(params):
            self.restart_v(group, p, state)

    def roundings(self, params: Iterable[Tensor]) -> list[Rounding]:
        rounding = {id(p): group["rounding"] for group in self.optimizer.param_groups for p in group["params"]}
        return [rounding[id(p)] for p in params]

    def use_stochastic_rounding(self, params: Iterable[Tensor]) -> bool:
        """Every param group holding one of ``params`` rounds stochastically from the next step on."""
        chosen = {id(p) for p in params}
        for group in self.optimizer.param_groups:
            if any(id(p) in chosen for p in group["params"]):
                group["rounding"] = "stochastic"
        return True

    def steps_taken(self, param: Tensor) -> int | None:
        step = self.optimizer.state.get(param, {}).get("step_v")
        return None if step is None else int(step)

    def reset_exact(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        """The paper's per-moment reset, v-only included (unbounded first update: see the module docstring)."""
        chosen = resolve_moments(moments)
        self.optimizer.reset_moments(tuple(m for m in MOMENTS if m in chosen), params)

    @torch.no_grad()
    def restart_v(self, group: dict, p: Tensor, state: dict) -> None:
        """Keep m and both ages; write v so that the next update is bounded (see :mod:`.restart`)."""
        step_m, step_v = int(state["step_m"]), int(state["step_v"])
        if step_v == 0 or step_m == 0:
            self.optimizer.reset_moments(("v",), [p])
            return
        beta1, beta2 = group["betas"]
        m_format = self.optimizer.moment_format(p, "m")
        m_hat = m_format.dequantize(self.optimizer.moment_state(p, "m")).reshape(-1) / (1.0 - beta1**step_m)
        target = restarted_v(m_hat, None if p.grad is None else p.grad.reshape(-1), step_v, beta2)
        write_rounded_up(self.optimizer.moment_format(p, "v"), self.optimizer.moment_state(p, "v"), target)


def write_rounded_up(fmt: StateFormat, q: QuantizedState, target: Tensor) -> None:
    """Store the non-negative fp32 ``target`` into ``q`` in place, every value rounded up onto the format's grid
    (so quantization cannot undo a bound, and no positive value becomes zero)."""
    if q.scale is None:
        q.codes.view(-1).copy_(round_up_float(target, q.codes.dtype))
    elif fmt.name == "fp8_e4m3":
        codes, scale = round_up_fp8_blockwise(target.reshape(-1), target.numel())
        q.codes.view(-1).copy_(codes.reshape(-1))
        q.scale.copy_(scale.reshape(q.scale.shape))
    elif fmt.name in ("int8_dynamic", "fp4"):
        grid = dynamic_map(False) if fmt.name == "int8_dynamic" else fp4_values(fmt)
        block = INT8_BLOCK if fmt.name == "int8_dynamic" else FP4_BLOCK
        codes, absmax = round_up_blockwise(target, grid.to(target.device), block)
        q.scale.copy_(absmax.clamp_min(1e-12))
        if fmt.name == "int8_dynamic":
            q.codes.view(-1).copy_(codes)
        else:
            padded = torch.cat([codes, codes.new_zeros(codes.numel() % 2)])
            q.codes.copy_(pack_nibbles(padded))
    else:
        raise TypeError(f"QuantizedAdamW adapter: no rounded-up writer for state format {fmt.name!r}")


ADAPTERS = {QuantizedAdamW: QuantizedAdamWAdapter}
