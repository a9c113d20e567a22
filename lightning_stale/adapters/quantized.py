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
from lightning_stale.adapters.restart import restarted_v
from lightning_stale.formats import QuantizedState, StateFormat
from lightning_stale.formats.base import on_device
from lightning_stale.optim import QuantizedAdamW
from lightning_stale.vocab import Rounding

KEYS = {"m": "exp_avg", "v": "exp_avg_sq"}
CODE_LAYOUTS = {8: BlockQmapSlot, 4: Packed4bitSlot}  # codes into a table of values, by bits per code


def format_slot(p: Tensor, moment: Moment, beta: float, fmt: StateFormat, q: QuantizedState) -> Slot:
    """A slot over one stored moment, in the layout that the format's description calls for: codes into its grid
    (scaled per block, or per tensor), a plain float tensor, or float8 codes times a scale."""
    key = KEYS[moment]
    block_size = fmt.block_size or q.shape.numel()  # elements per scale
    grid = fmt.grid()  # the format's shared table, on the host: read on the codes' device
    grid = None if grid is None else on_device(grid, q.codes.device)
    if grid is not None and fmt.bits in CODE_LAYOUTS:
        return CODE_LAYOUTS[fmt.bits](p, moment, beta, fmt.name, key, stored=q.codes, scale=q.scale, qmap=grid,
                                      block_size=block_size)
    if grid is None and q.scale is None:
        return FloatSlot(p, moment, beta, fmt.name, key, tensor=q.codes)
    if grid is None and q.codes.dtype == torch.float8_e4m3fn:
        return BlockFp8Slot(p, moment, beta, fmt.name, key, stored=q.codes, scale=q.scale, block_size=block_size)
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

    def step_counter(self, param: Tensor) -> Tensor | None:
        return self.optimizer.state.get(param, {}).get("step_v")

    def reset_exact(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        """The paper's per-moment reset, v-only included (unbounded first update: see the module docstring)."""
        chosen = resolve_moments(moments)
        self.optimizer.reset_moments(tuple(m for m in MOMENTS if m in chosen), params)

    @torch.no_grad()
    def restart_v(self, group: dict, p: Tensor, state: dict) -> None:
        """Keep m and both ages; write v so that the next update is bounded (see :mod:`.restart`), or zero it and its
        age where a moment has no age yet. The ages stay on their device: computed there, nothing read back."""
        step_m, step_v = state["step_m"].double(), state["step_v"].double()
        beta1, beta2 = group["betas"]
        m_format = self.optimizer.moment_format(p, "m")
        m_hat = m_format.dequantize(self.optimizer.moment_state(p, "m")).reshape(-1) / (1.0 - beta1**step_m)
        target = restarted_v(m_hat, None if p.grad is None else p.grad.reshape(-1), step_v, beta2)
        unaged = (step_m == 0) | (step_v == 0)  # a moment without an age: v restarts from zero, its age too
        self.optimizer.moment_format(p, "v").round_up_into(self.optimizer.moment_state(p, "v"),
                                                             torch.where(unaged, 0.0, target))
        state["step_v"].masked_fill_(unaged, 0)


ADAPTERS = {QuantizedAdamW: QuantizedAdamWAdapter}
