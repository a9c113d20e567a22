"""StaleStateCallback: per-step stall tracking, logging and resets of low-precision optimizer states.

Data flow: optimizer state -> adapter (read codes, reset) -> tracker (stall counts) -> policy (decide) -> this
callback (Lightning hooks, logging, checkpointing).

Tracking runs in torch's optimizer step pre/post hooks on the raw optimizers, so only steps that really ran are
counted (a GradScaler-skipped step never calls ``step()``; fused optimizers that skip internally are recognised by
the ``found_inf`` flag GradScaler sets on them). Reset decisions are made right after the step that completes a
period and are identical on every rank: periodic and theory periods depend only on step counts, measurement-driven
decisions are reduced across ranks ("any rank").
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.hooks import RemovableHandle

from lightning_stale import guard, predict, theory
import lightning_stale.adapters as adapters
from lightning_stale.adapters.base import MOMENTS, Moment, OptimizerAdapter, Slot
from lightning_stale.policies import ResetPolicy, ResetUnit, check_moments, make_policy
from lightning_stale.tracker import (
    COUNTED,
    MEASURED,
    STALLED,
    UNDERFLOW,
    UNDERFLOW_COUNTED,
    StallTotals,
    StallTracker,
)

# Layout of the per-log-step vector reduced across ranks: for each moment, the five tracker sums, then weighted
# sums of drift and prediction (value * weight, weight).
_PER_MOMENT = 9
_DRIFT, _DRIFT_W, _PRED, _PRED_W = 5, 6, 7, 8

ResetListener = Callable[[torch.optim.Optimizer, list[Slot]], None]


@dataclass(eq=False)
class _Tracked:
    """What the callback keeps per optimizer."""

    source: torch.optim.Optimizer  # as the trainer holds it; the raw optimizer (hooked) is adapter.optimizer
    adapter: OptimizerAdapter
    tracker: StallTracker
    units: dict[str, ResetUnit] = field(default_factory=dict)
    rho: dict[str, float | None] = field(default_factory=dict)
    steps: int = 0
    measuring: bool = False
    announced: bool = False
    adopted: int = -1  # tracker.version whose records are grouped into units
    warming: dict[str, torch.Tensor] = field(default_factory=dict)  # parameters before a warm-up step


class StaleStateCallback(Callback):
    """Measure how stale each stored optimizer moment is, log it, and optionally reset moments.

    Args:
        reset: ``None`` (monitor only), ``"periodic"`` (needs ``every``), ``"theory"`` (period K* from the paper's
            model for each slot's format and beta), ``"adaptive"`` (paper Alg. 2 on the measured stall fraction) or
            any :class:`~lightning_stale.policies.ResetPolicy`.
        every: reset period in optimizer steps for ``reset="periodic"``.
        s0: staleness tolerance of the theory and adaptive rules (the paper uses 0.6).
        min_interval: fewest steps between two adaptive resets of a parameter.
        moments: which moments a shortcut policy resets: ``("m", "v")`` or ``("v",)`` (asymmetric, exact only on
            optimizers with per-moment ages such as ``QuantizedAdamW``; others use the adapter's safe scheme).
        track: ``"sample"`` compares a fixed random subset of up to ``sample_size`` elements per slot; ``"exact"``
            compares every element.
        sample_size: elements per slot in sample mode (also the drift sample in both modes).
        track_every: measure one optimizer step in ``track_every`` (shadows still see every step).
        log_per_param: also log ``<prefix>/<param name>/<moment>/frac`` for every parameter.
        log_key_prefix: prefix of every logged key.
        strict: raise for optimizers without an adapter; ``False`` falls back to a generic adapter with a warning.
        seed: seed of the element sample.
        underflow_guard: after every real optimizer step, zero the first moment of elements whose stored second
            moment is exactly zero while m is not (see :mod:`lightning_stale.guard`): prevents the
            ``lr * m / eps`` jump a later zero gradient would cause. Off by default; costs one full pass over the
            state per step. Resets chosen by the policy are applied after it and are not altered.
        warmup_steps: after a reset, scale the next ``warmup_steps`` parameter updates of the reset parameters by
            ``i / warmup_steps`` (i = 1, 2, ...), as SPAM does: the first update after a hard reset is a sign-like
            step of size lr on every coordinate. 0 (default) disables it. Costs one copy of each warming parameter.
    """

    def __init__(
        self,
        reset: str | ResetPolicy | None = None,
        every: int | None = None,
        s0: float = 0.6,
        min_interval: int = 50,
        moments: Sequence[str] = ("m", "v"),
        track: Literal["sample", "exact"] = "sample",
        sample_size: int = 4096,
        track_every: int = 1,
        log_per_param: bool = False,
        log_key_prefix: str = "stale",
        strict: bool = True,
        seed: int = 0,
        underflow_guard: bool = False,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        if track not in ("sample", "exact"):
            raise ValueError(f"`track` must be 'sample' or 'exact', got {track!r}")
        for name, value in (("sample_size", sample_size), ("track_every", track_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if not isinstance(log_key_prefix, str) or not log_key_prefix:
            raise ValueError(f"`log_key_prefix` must be a non-empty string, got {log_key_prefix!r}")
        for name, value in (("log_per_param", log_per_param), ("strict", strict), ("underflow_guard", underflow_guard)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(
                f"`warmup_steps` must be an int >= 0 (0 disables the post-reset warm-up), got {warmup_steps!r}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"`seed` must be an int, got {seed!r}")
        self.policy = make_policy(reset, every, s0, min_interval, check_moments(moments))
        self.track = track
        self.sample_size = sample_size
        self.track_every = track_every
        self.log_per_param = log_per_param
        self.prefix = log_key_prefix
        self.strict = strict
        self.seed = seed
        self.underflow_guard = underflow_guard
        self.warmup_steps = warmup_steps
        self.reset_events = 0
        self._tracked: list[_Tracked] = []
        self._handles: list[RemovableHandle] = []
        self._listeners: list[ResetListener] = []
        self._pending_state: dict[str, Any] | None = None
        self._totals = StallTotals(_PER_MOMENT * len(MOMENTS))
        self._trainer: Trainer | None = None
        self._param_names: dict[int, str] = {}

    # -- public extension points ------------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    def add_reset_listener(self, listener: ResetListener) -> None:
        """Call ``listener(optimizer, slots)`` after every reset (e.g. to re-warm a learning rate)."""
        self._listeners.append(listener)

    def on_reset(self, trainer: Trainer, optimizer: torch.optim.Optimizer, slots: list[Slot]) -> None:
        """Hook called after the callback reset ``slots`` of ``optimizer``; override to react."""

    def reset_periods(self) -> dict[str, int | None]:
        """The reset period chosen for each parameter (by parameter name), once its state exists."""
        return {self._unit_name(t, u): u.period for t in self._tracked for u in t.units.values()}

    # -- Lightning hooks ---------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = type(trainer.strategy).__name__
        if "DeepSpeed" in strategy or "FSDP" in strategy or "ModelParallel" in strategy:
            raise MisconfigurationException(
                f"StaleStateCallback does not support {strategy} yet: its optimizer state is sharded or flattened and "
                "stall counts would be wrong. Use DDP (or single-device) training, or remove the callback."
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._detach()
        self._trainer = trainer
        self._param_names = {id(p): n for n, p in pl_module.named_parameters()}
        # multi-process: collectives on the strategy's device, since NCCL (GPU DDP) reduces CUDA tensors only
        self._totals = self._totals.to(trainer.strategy.root_device if trainer.world_size > 1 else "cpu")
        optimizers = [adapters.unwrap(opt) for opt in trainer.optimizers]
        if not optimizers:
            raise MisconfigurationException("StaleStateCallback needs at least one optimizer (none was configured)")
        same = [t.source for t in self._tracked] == optimizers
        if not same or self._pending_state is not None:
            self._tracked = [self._track(i, opt) for i, opt in enumerate(optimizers)]
        for t in self._tracked:
            t.tracker.rebind()
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None
        for i, t in enumerate(self._tracked):
            self._handles.append(t.adapter.optimizer.register_step_pre_hook(partial(self._before_step, t)))
            self._handles.append(t.adapter.optimizer.register_step_post_hook(partial(self._after_step, t)))
            t.tracker.refresh(fresh_state=False)
            self._adopt_new_units(t)
            rank_zero_info(f"[lightning_stale] optimizer {i}: {t.adapter.describe()}; policy: {self.policy!r}; "
                           f"tracking: {self.track}" + (f"({self.sample_size})" if self.track == "sample" else "")
                           + f" every {self.track_every} step(s)")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer._logger_connector.should_update_logs:
            self._log(trainer, pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._detach()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._detach()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "reset_events": self.reset_events,
            "pending_totals": self._totals.totals.clone(),
            "optimizers": [self._tracked_state(t) for t in self._tracked],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_state = state_dict

    # -- step hooks ------------------------------------------------------------------------------------------------
    def _before_step(self, t: _Tracked, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        t.measuring = (t.steps + 1) % self.track_every == 0
        t.tracker.before_step(t.measuring)
        t.warming = {u.key: u.param.detach().clone() for u in t.units.values() if u.warmup_left > 0}

    def _warm_up(self, t: _Tracked) -> None:
        """Scale this step's update of recently reset parameters: p = p_old + (i / warmup_steps) * (p - p_old)."""
        for key, old in t.warming.items():
            unit = t.units[key]
            factor = (self.warmup_steps - unit.warmup_left + 1) / self.warmup_steps
            with torch.no_grad():
                unit.param.lerp_(old, 1.0 - factor)
            unit.warmup_left -= 1
        t.warming = {}

    def _after_step(self, t: _Tracked, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # GradScaler hands a fused/AMP-aware optimizer its verdict as the attribute ``found_inf`` during step()
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is not None and bool(found_inf):
            t.tracker.discard()  # the fused optimizer skipped internally: count nothing
            return
        t.steps += 1
        if t.warming:
            self._warm_up(t)
        measured = t.tracker.after_step(t.measuring, t.adapter.builtin_stall_counts() if t.measuring else None)
        self._adopt_new_units(t)
        if self.underflow_guard:
            guard.guard_underflow(record.slot for record in t.tracker.records.values())
        for record in measured:
            expected = predict.predicted_stall(t.rho.get(record.key), record.slot.beta, t.units[record.unit].age)
            if expected is not None:
                record.predicted_sum += expected
                record.predicted_n += 1
        for unit in t.units.values():
            unit.age += 1
        if self.policy is None:
            return
        if self.policy.needs_measurement and t.measuring:
            self._observe(t)
        self._maybe_reset(t)

    # -- units and resets ------------------------------------------------------------------------------------------
    def _track(self, index: int, optimizer: torch.optim.Optimizer) -> _Tracked:
        adapter = adapters.adapter_for(optimizer, strict=self.strict)
        tracker = StallTracker(adapter, f"opt{index}", self.track, self.sample_size, self.seed)
        return _Tracked(optimizer, adapter, tracker)

    def _adopt_new_units(self, t: _Tracked) -> None:
        """Group newly seen slots by parameter into reset units and let the policy configure them."""
        if t.tracker.version == t.adopted:
            return
        t.adopted = t.tracker.version
        new_units = []
        for key, record in t.tracker.records.items():
            unit = t.units.get(record.unit)
            if unit is None:
                unit = t.units[record.unit] = ResetUnit(record.unit, {})
                new_units.append(unit)
            unit.records[key] = record
        for unit in new_units:
            if self.policy is not None and unit.period_source == "":
                self.policy.configure(unit)
        for unit in t.units.values():
            for key, record in unit.records.items():
                if key not in t.rho and record.moment == "v":
                    t.rho[key] = predict.slot_rho_hat(record.slot, record.index)[0]
        if new_units and not t.announced:
            t.announced = True
            rank_zero_info(self._summary(t))

    def _observe(self, t: _Tracked) -> None:
        units = [u for u in t.units.values() if u.driver() is not None]
        if not units:
            return
        last = torch.stack([u.driver().last_step for u in units])  # (stalled, counted) of the last measured step
        fractions = (last[:, 0] / last[:, 1]).tolist()  # one host sync per measured step
        for unit, fraction in zip(units, fractions):
            self.policy.observe(unit, fraction)

    def _maybe_reset(self, t: _Tracked) -> None:
        # Lightning counts a step after optimizer.step() returns: in this post-hook global_step is still one behind.
        step = self._trainer.global_step + 1 if self._trainer is not None else t.steps
        units = list(t.units.values())
        due = [self.policy.should_reset(u, step) for u in units]
        trainer = self._trainer
        if self.policy.needs_sync and trainer is not None and trainer.world_size > 1:
            votes = trainer.strategy.reduce(
                torch.tensor(due, dtype=torch.float32, device=trainer.strategy.root_device), reduce_op="sum"
            )
            due = (votes > 0).tolist()
        chosen = [u for u, d in zip(units, due) if d]
        if chosen:
            self._reset(t, chosen, step)

    def _reset(self, t: _Tracked, units: list[ResetUnit], step: int) -> None:
        moments: tuple[Moment, ...] = self.policy.moments
        t.adapter.reset(moments=moments, params=[u.param for u in units])
        slots = []
        for unit in units:
            for record in unit.records.values():
                if record.moment in moments:
                    record.resync_shadow()
                    slots.append(record.slot)
            unit.age, unit.measured, unit.accumulator = 0, 0, 0.0
            unit.warmup_left = self.warmup_steps
            unit.resets += 1
            unit.last_reset_step = step
        self.reset_events += 1
        for listener in self._listeners:
            listener(t.adapter.optimizer, slots)
        if self._trainer is not None:
            self.on_reset(self._trainer, t.adapter.optimizer, slots)

    # -- logging ---------------------------------------------------------------------------------------------------
    def _log(self, trainer: Trainer, pl_module: LightningModule) -> None:
        vector = torch.zeros(_PER_MOMENT * len(MOMENTS), dtype=torch.float64)
        per_param: dict[str, float] = {}
        for t in self._tracked:
            for unit in t.units.values():
                for key, record in unit.records.items():
                    base = _PER_MOMENT * MOMENTS.index(record.moment)
                    vector[base:base + 5] += record.totals
                    drift = t.tracker.drift(record)
                    if drift is not None and torch.isfinite(drift):
                        vector[base + _DRIFT] += drift.double() * record.index.numel()
                        vector[base + _DRIFT_W] += record.index.numel()
                    if record.predicted_n:
                        expected = record.predicted_sum / record.predicted_n
                        vector[base + _PRED] += expected * record.totals[COUNTED]
                        vector[base + _PRED_W] += record.totals[COUNTED]
                        record.predicted_sum, record.predicted_n = 0.0, 0
                    if self.log_per_param and record.totals[COUNTED] > 0:
                        name = f"{self.prefix}/{self._unit_name(t, unit)}/{record.slot.key}/frac"
                        per_param[name] = float(record.totals[STALLED] / record.totals[COUNTED])
                    record.totals.zero_()
        self._totals.update(vector)
        totals = self._totals.compute()  # collective under DDP: every rank logs at the same steps
        self._totals.reset()
        metrics = self._metrics(totals)
        bar = f"{self.prefix}/v/frac"
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, prog_bar=key == bar, batch_size=1)
        if per_param:
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for logger in trainer.loggers:
                logger.log_metrics(per_param, step=step)

    def _metrics(self, totals: torch.Tensor) -> dict[str, float]:
        metrics: dict[str, float] = {}
        stalled = counted = 0.0
        for i, moment in enumerate(MOMENTS):
            row = totals[_PER_MOMENT * i:_PER_MOMENT * (i + 1)].tolist()
            if row[MEASURED] == 0 or row[COUNTED] == 0:
                continue
            frac = row[STALLED] / row[COUNTED]
            stalled, counted = stalled + row[STALLED], counted + row[COUNTED]
            metrics[f"{self.prefix}/{moment}/frac"] = frac
            if row[_DRIFT_W] > 0:
                metrics[f"{self.prefix}/{moment}/drift"] = row[_DRIFT] / row[_DRIFT_W]
            if row[_PRED_W] > 0:
                metrics[f"{self.prefix}/{moment}/predicted"] = row[_PRED] / row[_PRED_W]
            if moment == "v":
                if row[UNDERFLOW_COUNTED] > 0:
                    metrics[f"{self.prefix}/v/underflow"] = row[UNDERFLOW] / row[UNDERFLOW_COUNTED]
                beta = self._mean_v_beta()
                if beta is not None:
                    metrics[f"{self.prefix}/v/beta_eff"] = theory.effective_beta(beta, frac)
                    horizon = theory.effective_horizon(beta, frac)
                    metrics[f"{self.prefix}/v/horizon_eff"] = horizon if math.isfinite(horizon) else float("inf")
        if counted > 0:
            metrics[f"{self.prefix}/frac"] = stalled / counted
            metrics[f"{self.prefix}/resets"] = float(self.reset_events)
            ages = [u.age for t in self._tracked for u in t.units.values()]
            metrics[f"{self.prefix}/since_reset"] = sum(ages) / len(ages)
        return metrics

    def _mean_v_beta(self) -> float | None:
        betas = [r.slot.beta for t in self._tracked for r in t.tracker.records.values()
                 if r.moment == "v" and r.slot.beta is not None]
        return sum(betas) / len(betas) if betas else None

    # -- checkpointing ---------------------------------------------------------------------------------------------
    def _tracked_state(self, t: _Tracked) -> dict[str, Any]:
        return {
            "steps": t.steps,
            "rho": dict(t.rho),
            "records": {k: {"shadow": r.shadow, "totals": r.totals, "predicted": (r.predicted_sum, r.predicted_n)}
                        for k, r in t.tracker.records.items()},
            "units": {
                k: {"age": u.age, "measured": u.measured, "accumulator": u.accumulator, "period": u.period,
                    "resets": u.resets, "period_source": u.period_source, "last_reset_step": u.last_reset_step,
                    "warmup_left": u.warmup_left}
                for k, u in t.units.items()
            },
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.reset_events = int(state.get("reset_events", 0))
        self._totals.reset()
        self._totals.totals += state["pending_totals"].to(self._totals.totals)
        saved = state.get("optimizers", [])
        if len(saved) != len(self._tracked):
            raise MisconfigurationException(
                f"The checkpoint's StaleStateCallback state tracks {len(saved)} optimizer(s) but the model now has "
                f"{len(self._tracked)}. Resume with the same optimizers, or drop the callback state from the "
                "checkpoint."
            )
        for t, s in zip(self._tracked, saved):
            t.steps = int(s["steps"])
            t.rho.update(s.get("rho", {}))
            t.tracker.restored = dict(s["records"])
            for key, fields in s["units"].items():
                t.units[key] = ResetUnit(key, {}, **fields)

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _unit_name(self, t: _Tracked, unit: ResetUnit) -> str:
        name = self._param_names.get(id(unit.param), unit.key)
        return name if len(self._tracked) == 1 else f"{t.tracker.prefix}/{name}"

    def _summary(self, t: _Tracked) -> str:
        formats: Counter[str] = Counter()
        periods: Counter[str] = Counter()
        for unit in t.units.values():
            formats.update(f"{r.slot.moment}: {r.slot.format} (beta={r.slot.beta})" for r in unit.records.values())
            if self.policy is not None:
                periods[f"{unit.period} ({unit.period_source})"] += 1
        lines = [f"[lightning_stale] {t.adapter.describe()} state formats: "
                 + ", ".join(f"{k} x{n}" for k, n in formats.items())]
        if periods:
            lines.append("[lightning_stale] reset periods: " + ", ".join(f"{k} x{n}" for k, n in periods.items()))
        return "\n".join(lines)
