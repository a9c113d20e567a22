"""StaleStateMonitor: the engine, the reset schedule and the policy around any optimizer, in any training loop.

Data flow per optimizer: optimizer state -> adapter (slots, resets) -> :class:`~lightning_stale.engine.StallEngine`
(stall counts, in torch's optimizer step hooks) -> :class:`~lightning_stale.schedule.ResetSchedule` and the policy
(decide) -> resets in place; :meth:`StaleStateMonitor.compute` turns the counts into one row of metrics
(:mod:`lightning_stale.metrics`). The Lightning Trainer callback and the other front-ends are thin wrappers.

Only steps that really ran count: the hooks run inside ``optimizer.step()`` (a GradScaler-skipped step never calls
it; a fused optimizer that skips internally is recognised by the ``found_inf`` flag GradScaler sets on it). A
measurement that cannot be made for a slot (no data yet, a failed estimate) is skipped and retried, with one warning;
an unexpected error inside a hook is reported once and that step is skipped, so the monitor never stops a run.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

import lightning_stale.adapters as adapters
from lightning_stale import _compat, guard, metrics, predict, remedies
from lightning_stale._compat import rank_zero_info
from lightning_stale.adapters.base import OptimizerAdapter, Slot
from lightning_stale.engine import Batch, StallEngine, Unit, driver_group
from lightning_stale.policies import ResetPolicy, check_band, check_min_interval, check_s0, make_policy
from lightning_stale.remedies import REMEDY_NAMES, AutoRemedy
from lightning_stale.schedule import ResetSchedule, ResetUnit
from lightning_stale.vocab import MOMENTS, check_choice, check_flag, check_int, check_moments, invalid

Reduce = Callable[[Tensor], Tensor]  # sums a host float64 tensor across processes (on the collective's device)
STATE_VERSION = 2
TRACK_MODES = ("sample", "exact")
V_RESETS = ("bounded", "exact-unbounded")
POST_RESET_GUARD_STEPS = 30  # steps after a reset during which the underflow guard protects the reset parameters


@dataclass(frozen=True)
class ResetEvent:
    """What a reset listener receives: ``step``, the monitor's count of real optimizer steps after which the reset
    ran (skipped steps excluded; counted from ``steps_taken`` when the monitor attached, restored from its checkpoint
    on resume); the ``optimizer``; the ``slots`` (parameter x moment) that were reset."""

    step: int
    optimizer: torch.optim.Optimizer
    slots: list[Slot]

    @property
    def params(self) -> list[Tensor]:
        """The parameters whose state was reset, each once, in slot order."""
        return list({id(s.param): s.param for s in self.slots}.values())


ResetListener = Callable[[ResetEvent], None]


class StaleStateWarning(UserWarning):
    """A measurement the monitor skipped (it keeps trying); training is not affected."""


class StaleStateInternalWarning(StaleStateWarning):
    """An unexpected error inside a step hook: the monitor skipped that step (a bug; please report it)."""


@dataclass
class MonitorOptions:
    """The options every front-end shares, validated once (see :class:`StaleStateMonitor` for their meaning)."""

    reset: str | ResetPolicy | None = None
    every: int | None = None
    s0: float = 0.6
    min_interval: int = 50
    moments: Sequence[str] = MOMENTS
    track: str = "sample"
    sample_size: int = 512
    params_per_step: int = 4
    track_every: int = 1
    log_per_param: bool = False
    log_key_prefix: str = metrics.DEFAULT_PREFIX
    strict: bool = True
    seed: int = 0
    underflow_guard: bool = False
    warmup_steps: int = 0
    v_reset: str = "bounded"
    remedy: str | None = None
    drift_band: float = 1.5
    policy: ResetPolicy | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        check_choice("track", self.track, TRACK_MODES)
        for name in ("sample_size", "params_per_step", "track_every"):
            check_int(name, getattr(self, name))
        if not isinstance(self.log_key_prefix, str) or not self.log_key_prefix:
            raise invalid("log_key_prefix", "a non-empty string", self.log_key_prefix)
        for name in ("log_per_param", "strict", "underflow_guard"):
            check_flag(name, getattr(self, name))
        check_int("warmup_steps", self.warmup_steps, minimum=0, unit="0 disables the post-reset warm-up")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise invalid("seed", "an int", self.seed)
        check_choice("v_reset", self.v_reset, V_RESETS)
        check_s0(self.s0)  # validated even where the chosen policy does not use them: a typo should not wait
        check_min_interval(self.min_interval)
        check_band(self.drift_band)
        check_choice("remedy", self.remedy, (None, *REMEDY_NAMES))
        if self.remedy is not None and self.reset is not None:
            raise ValueError(f"remedy={self.remedy!r} chooses the resets itself (by drift); drop `reset` "
                             f"(got reset={self.reset!r}) or set remedy=None")
        self.policy = make_policy(self.reset, self.every, self.s0, self.min_interval, check_moments(self.moments),
                                  self.drift_band)


@dataclass(eq=False)
class _Attached:
    """What the monitor keeps per optimizer."""

    source: object  # as the caller passed it (a wrapper, e.g. LightningOptimizer); hooks go on adapter.optimizer
    adapter: OptimizerAdapter
    engine: StallEngine
    schedule: ResetSchedule = field(default_factory=ResetSchedule)
    steps: int = 0  # real optimizer steps seen (restored from checkpoints)
    measuring: bool = False
    curves: list[np.ndarray] = field(default_factory=list)  # distinct build-up curves in use
    curve_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # per unit, -1 for none
    pending: set[int] = field(default_factory=set)  # unit positions waiting for a grid estimate
    warming: dict[int, Tensor] = field(default_factory=dict)  # parameters before a warm-up step
    adopted: int = -1  # the engine version whose units the schedule holds
    guard_plan: tuple[tuple, guard.GuardPlan] | None = None  # (engine version and guarded positions, the plan)
    announced: bool = False

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.adapter.optimizer


class StaleStateMonitor:
    """Measure how stale the stored moments of one or more optimizers are, and optionally reset them.

    Attaches to torch's optimizer step hooks at construction; works in any training loop::

        monitor = StaleStateMonitor(optimizer, reset="theory", names=model)
        for step, batch in enumerate(loader):
            model(batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 50 == 0:
                print(monitor.compute())  # or writer.add_scalars / wandb.log / fabric.log_dict
        monitor.close()

    Args:
        optimizers: a torch optimizer, a wrapper of one (``LightningOptimizer``, accelerate's ``AcceleratedOptimizer``)
            or a sequence of them.
        reset: ``None`` (monitor only), ``"periodic"`` (needs ``every``), ``"theory"`` (period K* from the paper's
            model for each slot's format and beta), ``"adaptive"`` (paper Alg. 2 on the measured stall fraction),
            ``"drift"`` (when stored v leaves ``drift_band`` around its fp32 EMA) or any
            :class:`~lightning_stale.policies.ResetPolicy`.
        every: reset period in optimizer steps for ``reset="periodic"``.
        s0: staleness tolerance of the theory and adaptive rules (the paper uses 0.6).
        min_interval: fewest steps between two adaptive resets of a parameter.
        moments: which moments a shortcut policy resets: ``("m", "v")`` or ``("v",)``.
        track: ``"sample"`` measures a systematic sample of up to ``sample_size`` elements of each slot of
            ``params_per_step`` parameters per measured step, in turn; ``"exact"`` compares every element of every
            slot on every measured step.
        sample_size: elements per slot in sample mode.
        params_per_step: parameters measured per step in sample mode (raised so that every parameter is measured
            within ``coverage_steps`` measured steps).
        track_every: measure one optimizer step in ``track_every`` (drift shadows still see every step).
        log_per_param: :meth:`compute` also returns ``<prefix>/<param name>/<state key>/frac`` for every parameter
            measured in the window.
        log_key_prefix: prefix of every key.
        strict: raise for optimizers without an adapter; ``False`` falls back to a generic adapter with a warning.
        seed: seed of the element sample (ranks may use different seeds: counts are summed across ranks).
        underflow_guard: after every real step, zero the first moment of elements whose stored second moment is
            exactly zero while m is not (see :mod:`lightning_stale.guard`). Whatever this says, the parameters a
            reset touched are guarded for the next ``POST_RESET_GUARD_STEPS`` steps.
        warmup_steps: after a reset, scale the next ``warmup_steps`` updates of the reset parameters by
            ``i / warmup_steps`` (SPAM-style).
        v_reset: how a v-only reset (``moments=("v",)``) restarts v. ``"bounded"`` (default) keeps m and writes v so
            that the next update is at most about lr (see :mod:`lightning_stale.adapters.restart`).
            ``"exact-unbounded"`` is the paper's exact asymmetric reset on optimizers with one age per moment
            (``QuantizedAdamW``): v and its age restart from zero while m is kept, so the next update is
            ``lr * m_hat / |g|`` per element, unbounded where the new gradient is small (2.6e11x lr and NaN losses
            measured on fp8 states). Other optimizers always use the bounded restart.
        remedy: ``"auto"`` applies, per parameter, the remedy its measured cause calls for (the underflow guard where
            v underflows, a drift reset where v drifts out of band, nothing otherwise; see
            :mod:`lightning_stale.remedies`) and logs ``<prefix>/remedy/guard`` and ``<prefix>/remedy/reset``. It
            chooses resets itself, so it cannot be combined with ``reset``.
        drift_band: allowed ratio of stored v to its fp32 EMA for ``reset="drift"`` and ``remedy="auto"``.
        names: the model (``named_parameters`` gives the names) or a mapping name -> parameter, for readable
            per-parameter keys and messages.
        reduce: sums a float64 tensor across processes (every rank calls :meth:`compute` at the same steps). Default:
            ``torch.distributed.all_reduce`` when a process group is initialized, else nothing.
        steps_taken: optimizer steps each optimizer already took before the monitor attached (a front-end that
            attaches after the first step passes 1), so that :attr:`steps` and :attr:`ResetEvent.step` count the
            optimizer's real steps; a restored :meth:`state_dict` replaces it.
        coverage_steps: in sample mode, every parameter is measured at least once in this many measured steps (set it
            to your logging interval). Also the interval of check steps, on which ``reset="drift"`` and
            ``remedy="auto"`` read their signals (one host synchronisation each).
    """

    def __init__(self, optimizers: object | Sequence[object], reset: str | ResetPolicy | None = None, *,
                 names: nn.Module | Mapping[str, Tensor] | None = None, reduce: Reduce | None = None,
                 coverage_steps: int = 50, steps_taken: int = 0, options: MonitorOptions | None = None,
                 **kwargs: Any) -> None:
        if options is None:
            options = MonitorOptions(reset=reset, **kwargs)
        elif reset is not None or kwargs:
            raise ValueError("pass either `options` or individual options, not both")
        check_int("coverage_steps", coverage_steps)
        check_int("steps_taken", steps_taken, minimum=0)
        self.options = options
        self.policy = options.policy
        self.remedy = AutoRemedy(options.drift_band, options.min_interval, options.moments) \
            if options.remedy == "auto" else None
        self.reset_events = 0
        self.remedy_resets = 0  # parameter resets the automatic remedy made
        self._check_every = coverage_steps
        self._reduce = reduce if reduce is not None else _default_reduce()
        self._listeners: list[ResetListener] = []
        self._handles: list[RemovableHandle] = []
        self._warned: set[str] = set()
        self._names = _names(names)
        sources = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        if not sources:
            raise ValueError("StaleStateMonitor needs at least one optimizer (none was given)")
        self._attached = [self._attach(i, source, coverage_steps, steps_taken) for i, source in enumerate(sources)]

    # -- public API --------------------------------------------------------------------------------------------------
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The raw optimizers whose step hooks the monitor uses."""
        return [a.optimizer for a in self._attached]

    @property
    def steps(self) -> list[int]:
        """Real optimizer steps counted per optimizer (skipped steps excluded)."""
        return [a.steps for a in self._attached]

    def slots(self, optimizer_index: int = 0) -> list[Slot]:
        """The slots tracked for one optimizer (after its first step)."""
        return [e.slot for e in self._attached[optimizer_index].engine.entries.values()]

    def units(self, optimizer_index: int = 0) -> list[ResetUnit]:
        """The parameters of one optimizer as the reset policy sees them (ages, periods, reset counts)."""
        return list(self._attached[optimizer_index].schedule.units)

    def resident_bytes(self) -> int:
        """Memory the monitor keeps between steps (engine tensors and host arrays), for budgeting."""
        return sum(a.engine.resident_bytes() for a in self._attached)

    def add_reset_listener(self, listener: ResetListener) -> None:
        """Call ``listener(event)`` with a :class:`ResetEvent` after every reset (e.g. to re-warm a learning rate)."""
        self._listeners.append(listener)

    def reset_periods(self) -> dict[str, int | None]:
        """The reset period chosen for each parameter (by name), once its state exists."""
        return {self._unit_name(a, u): u.period for a in self._attached for u in a.schedule.units}

    def compute(self) -> dict[str, float]:
        """The metrics of every measured step since the previous call, summed across ranks; starts a new window.

        A collective when ``reduce`` is set: call it on every rank at the same steps.
        """
        row, per_param = self.compute_parts()
        return {**row, **per_param}

    def compute_parts(self) -> tuple[dict[str, float], dict[str, float]]:
        """:meth:`compute` as (the aggregate row, the per-parameter fractions of this rank) for front-ends that log
        them through different paths."""
        vector = torch.zeros(len(metrics.MOMENTS) * metrics.PER_MOMENT, dtype=torch.float64)
        per_param: dict[str, float] = {}
        for a in self._attached:
            engine = a.engine
            window = engine.window()
            entries = list(engine.entries.values())
            drift = engine.drift()
            vector += metrics.moment_vector(
                window["totals"], [e.moment for e in entries],
                [(engine.entries[k].moment, value, engine.drift_weight(k)) for k, value in drift.items()],
                window["predicted"])
            if self.options.log_per_param:
                for entry, row in zip(entries, window["totals"].tolist()):
                    if row[metrics.COUNTED] > 0:
                        name = self._unit_name(a, a.schedule.units[entry.unit.position])
                        per_param[metrics.key(self.options.log_key_prefix, name, entry.slot.key, metrics.FRAC)] = \
                            row[metrics.STALLED] / row[metrics.COUNTED]
        if self._reduce is not None:
            vector = self._reduce(vector).to(torch.float64).cpu()
        ages = np.concatenate([a.schedule.ages for a in self._attached])
        betas = [e.slot.beta for a in self._attached for e in a.engine.entries.values()
                 if e.moment == "v" and e.slot.beta is not None]
        row = metrics.row(vector, self.options.log_key_prefix, self.reset_events,
                          float(ages.mean()) if ages.size else None, sum(betas) / len(betas) if betas else None)
        if self.remedy is not None and row:  # decisions are agreed across ranks: rank-local counts are global
            chosen = np.concatenate([a.schedule.arrays["remedy"] for a in self._attached])
            row.update(metrics.remedy_row(self.options.log_key_prefix, int((chosen == remedies.GUARD).sum()),
                                          int((chosen == remedies.STOCHASTIC).sum()), self.remedy_resets))
        return row, per_param

    def close(self) -> None:
        """Detach from the optimizers' step hooks (the monitor keeps its state and can be inspected)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> StaleStateMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "rank": _compat.global_rank(),
            "world_size": _world_size(),
            "policy": repr(self.policy),
            "reset_events": self.reset_events,
            "remedy_resets": self.remedy_resets,
            "optimizers": [{"steps": a.steps, "engine": a.engine.state_dict(), "schedule": a.schedule.state_dict()}
                           for a in self._attached],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: counts in the current window, drift shadows, ages and reset counts;
        reset periods are re-derived from the policy configured now.

        Lightning checkpoints one copy of a callback's state (rank 0's) for every process. What only describes the
        saving process (its unlogged counts, its drift shadows) is therefore used only by that process, and after a
        multi-process resume the first row covers the steps since the resume; ages, reset counts and cursors are the
        same on every rank and always restored."""
        saved = state.get("optimizers", [])
        if len(saved) != len(self._attached):
            raise ValueError(
                f"the saved monitor state tracks {len(saved)} optimizer(s) but {len(self._attached)} are attached now. "
                "Resume with the same optimizers, or drop the saved monitor state."
            )
        self.reset_events = int(state.get("reset_events", 0))
        self.remedy_resets = int(state.get("remedy_resets", 0))
        if state.get("policy", repr(self.policy)) != repr(self.policy):
            self._info(f"[lightning_stale] resuming with policy {self.policy!r}; the checkpoint was saved with "
                       f"{state['policy']}: reset periods are chosen by the new policy, ages and counts continue.")
        multi_process = state.get("world_size", 1) > 1 or _world_size() > 1
        own_shadows = not multi_process or state.get("rank", 0) == _compat.global_rank()
        for a, s in zip(self._attached, saved):
            a.steps = int(s["steps"])
            a.engine.load_state_dict(s["engine"], counts=not multi_process, shadows=own_shadows)
            a.schedule.load_state_dict(s["schedule"])
            a.schedule.sync([])
            a.curves, a.curve_of, a.pending, a.adopted = [], np.zeros(0, dtype=np.int64), set(), -1

    # -- attaching ---------------------------------------------------------------------------------------------------
    def _attach(self, index: int, source: object, coverage_steps: int, steps_taken: int) -> _Attached:
        options = self.options
        adapter = adapters.adapter_for(source, strict=options.strict)
        engine = StallEngine(adapter, f"opt{index}", options.track == "exact", options.sample_size,
                             options.params_per_step, max(1, coverage_steps // options.track_every), options.seed)
        engine.keep_recent = self.remedy is not None or (self.policy is not None and self.policy.needs_measurement)
        attached = _Attached(source, adapter, engine, steps=steps_taken)
        self._handles.append(adapter.optimizer.register_step_pre_hook(lambda *_: self._guarded(self._before, attached)))
        self._handles.append(adapter.optimizer.register_step_post_hook(lambda *_: self._guarded(self._after, attached)))
        self._adopt(attached)
        return attached

    def _guarded(self, hook: Callable[[_Attached], None], attached: _Attached) -> None:
        try:
            hook(attached)
        except Exception as error:  # the monitor must never stop a training run
            attached.engine.discard()
            self._warn_once(f"{type(error).__name__}: {error}",
                            f"lightning_stale skipped a measurement after an unexpected error ({type(error).__name__}: "
                            f"{error}); training continues. Please report this with your optimizer and model.",
                            StaleStateInternalWarning)

    def _warn_once(self, key: str, message: str, category: type[Warning] = StaleStateWarning) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, category, stacklevel=3)

    # -- step hooks --------------------------------------------------------------------------------------------------
    def _before(self, a: _Attached) -> None:
        a.measuring = (a.steps + 1) % self.options.track_every == 0
        a.engine.before_step(a.measuring)
        self._adopt(a)
        if a.schedule.warming_any:
            a.warming = {u.position: u.param.detach().clone() for u in a.schedule.warming()}

    def _after(self, a: _Attached) -> None:
        # GradScaler hands a fused/AMP-aware optimizer its verdict as the attribute ``found_inf`` during step()
        found_inf = getattr(a.optimizer, "found_inf", None)
        if found_inf is not None and bool(found_inf):  # a host sync, only under GradScaler with a fused optimizer
            a.engine.discard()
            return
        a.steps += 1
        if a.warming:
            self._warm_up(a)
        measured = a.engine.after_step()
        self._adopt(a, after_step=True)
        if self.options.underflow_guard:
            self._guard(a, a.schedule.units)
        elif a.schedule.guarding:
            self._guard(a, a.schedule.guarded())
        if measured:
            self._predict(a, measured)
        if a.pending and a.engine.measured_cohort:
            self._estimate_pending(a)
        a.schedule.advance()
        if (self.remedy is not None or (self.policy is not None and self.policy.needs_drift)) \
                and a.steps % self._check_every == 0:
            self._check(a)
        if self.policy is None:
            return
        if self.policy.needs_measurement and measured:
            self._observe(a, measured)
        self._maybe_reset(a)

    def _guard(self, a: _Attached, units: list[ResetUnit]) -> None:
        """Run the underflow guard on ``units``, through a plan kept while the guarded set and the slots stay."""
        key = (a.engine.version, tuple(u.position for u in units))
        if a.guard_plan is None or a.guard_plan[0] != key:
            a.guard_plan = (key, guard.GuardPlan(s for unit in units for s in unit.slots))
        a.guard_plan[1].run()

    def _warm_up(self, a: _Attached) -> None:
        """Scale this step's update of recently reset parameters: p = p_old + (i / warmup_steps) * (p - p_old)."""
        steps = self.options.warmup_steps
        for position, old in a.warming.items():
            unit = a.schedule.units[position]
            factor = (steps - unit.warmup_left + 1) / steps
            with torch.no_grad():
                unit.param.lerp_(old, 1.0 - factor)
            unit.warmup_left -= 1
        a.warming = {}

    # -- parameters appearing ----------------------------------------------------------------------------------------
    def _adopt(self, a: _Attached, after_step: bool = False) -> None:
        """Align the schedule with the engine's units; give new parameters their age, rho-hat and period.

        A parameter whose state existed before monitoring began (a checkpoint saved without the monitor) is as old as
        its optimizer step counter says; inside the post-step hook that counter already includes this step, which
        the schedule adds next."""
        if a.adopted == a.engine.version:
            return
        a.adopted = a.engine.version

        def initial_age(unit: Unit) -> int:
            return max(0, (a.adapter.steps_taken(unit.param) or 0) - after_step)

        new = a.schedule.sync(a.engine.units, initial_age)
        a.curve_of = np.full(len(a.schedule.units), -1, dtype=np.int64)
        a.pending = set()
        for unit in a.schedule.units:
            if unit.rho is None and self._reduce is not None and unit.period_source == "":
                # Several processes: every rho-hat is agreed on at the parameter's first measurement (shards may
                # hold different formats), so all ranks pick the same period.
                a.pending.add(unit.position)
                continue
            driver = unit.driver()
            rho, _, needs_estimate = predict.closed_form_rho(driver) if driver is not None else (None, "", False)
            if rho is not None:
                a.schedule.arrays["rho"][unit.position] = rho
            elif needs_estimate and unit.rho is None:
                a.pending.add(unit.position)
            self._configure(a, unit, unit in new)
        if new and not a.announced:
            a.announced = True
            self._info(self._summary(a))

    def _configure(self, a: _Attached, unit: ResetUnit, new: bool) -> None:
        """Pick the unit's build-up curve and let the policy choose its period (once its rho-hat is known)."""
        driver = unit.driver()
        if unit.rho is not None and driver is not None and driver.beta is not None:
            curve = predict.build_up_curve(unit.rho, driver.beta)
            ids = [i for i, c in enumerate(a.curves) if c is curve]
            if not ids:
                a.curves.append(curve)
                ids = [len(a.curves) - 1]
            a.curve_of[unit.position] = ids[0]
        if self.policy is not None and (new or unit.period_source == "") and unit.position not in a.pending:
            self.policy.configure(unit)

    def _estimate_pending(self, a: _Attached) -> None:
        """Give the parameters of the step's cohort that still lack one their rho-hat: the paper's closed form for
        float formats, the grid estimate (one host sync each) for other grids; agreed across processes."""
        units = [a.schedule.units[u.position] for u in a.engine.measured_cohort if u.position in a.pending]
        if not units:  # the same on every rank: pending sets change only through agreed results
            return
        rows = []
        for unit in units:
            driver = unit.driver()
            closed, _, needs = predict.closed_form_rho(driver) if driver is not None else (None, "", False)
            sums = predict.estimate_sums(driver, unit.key) if needs else None
            rows.append([closed is not None, closed or 0.0, needs, *(sums or (0.0, 0))])
        totals = torch.tensor(rows, dtype=torch.float64)
        if self._reduce is not None:
            totals = self._reduce(totals.reshape(-1)).to(torch.float64).cpu().view(-1, 5)
        for unit, (n_closed, closed_sum, n_needs, inverse_sum, n) in zip(units, totals.tolist()):
            driver = unit.driver()
            if n > 0:
                rho = predict.rho_from_sums(inverse_sum, int(n), driver.beta)
            elif n_needs > 0:
                self._warn_once(f"estimate:{unit.key}",
                                f"lightning_stale: no theory prediction yet for {self._unit_name(a, unit)!r}: its "
                                "stored second moment holds no non-zero value (zero gradients so far?); retrying when "
                                "it is next measured.")
                continue
            else:
                rho = closed_sum / n_closed if n_closed > 0 else None
            a.pending.discard(unit.position)
            if rho is not None:
                a.schedule.arrays["rho"][unit.position] = rho
            self._configure(a, unit, new=True)

    def _predict(self, a: _Attached, measured: list[Batch]) -> None:
        """Add the theory's predicted stall to every measured second moment with a curve (host arrays only)."""
        ages = a.schedule.ages
        for batch in measured:
            curve_ids = np.where(batch.is_v, a.curve_of[batch.positions], -1)
            present = curve_ids[curve_ids >= 0]
            if present.size == 0:
                continue
            distinct = [present[0]] if (present == present[0]).all() else np.unique(present)  # usually one curve
            for curve_id in distinct:
                chosen = curve_ids == curve_id
                values = predict.predicted_stall(a.curves[curve_id], ages[batch.positions[chosen]])
                a.engine.add_predictions(batch.global_rows[chosen], values)

    # -- resets ------------------------------------------------------------------------------------------------------
    def _observe(self, a: _Attached, measured: list[Batch]) -> None:
        """Feed the adaptive policy the stall fraction of each measured driver slot (one host sync per step)."""
        recent = a.engine.take_recent()
        for entry in (e for b in measured for e in b.entries):
            unit = a.schedule.units[entry.unit.position]
            if unit.driver() is entry.slot:
                stalled, counted, _ = recent[entry.row]
                self.policy.observe(unit, stalled / counted if counted > 0 else math.nan)

    def _check(self, a: _Attached) -> None:
        """A check step: read the drift of every driver group (and, for the automatic remedy, each parameter's v
        underflow since the last check), agreed across ranks, into the schedule; then let the remedy act.

        One host synchronisation (and one collective with several processes) per check. The reduced vector has four
        entries per parameter whatever each rank holds (parameters are the same on every rank), so the collective
        matches even where shards differ."""
        units, engine = a.schedule.units, a.engine
        local = np.zeros((len(units), 4))  # per unit: drift * weight, weight, v stored as zero, v counted
        for key, value in engine.drift().items():
            entry = engine.entries[key]
            if entry.moment == "v" and units[entry.unit.position].driver() is entry.slot:
                local[entry.unit.position, :2] += (value * engine.drift_weight(key), engine.drift_weight(key))
        if self.remedy is not None:
            recent = engine.take_recent()
            for entry in engine.entries.values():
                if entry.moment == "v":
                    local[entry.unit.position, 2:] += recent[entry.row, 2], recent[entry.row, 1]
        vector = torch.from_numpy(local.reshape(-1))
        if self._reduce is not None:
            vector = self._reduce(vector).to(torch.float64).cpu()
        values = vector.numpy().reshape(-1, 4)
        groups = {g: i for i, g in enumerate(dict.fromkeys(driver_group(u) for u in engine.units))}
        group_of = np.array([groups[driver_group(u)] for u in engine.units], dtype=np.int64)
        drift = np.zeros((len(groups), 2))  # per driver group: sum of drift * weight, weight
        np.add.at(drift, group_of, values[:, :2])
        with np.errstate(invalid="ignore", divide="ignore"):
            group_drift = np.where(drift[:, 1] > 0, drift[:, 0] / drift[:, 1], np.nan)
            read = values[:, 3] > 0
            a.schedule.arrays["underflow"][read] = values[read, 2] / values[read, 3]
        a.schedule.arrays["drift"][:] = group_drift[group_of]
        if self.remedy is not None:
            self._remedy(a)

    def _remedy(self, a: _Attached) -> None:
        """Apply the automatic remedy's choice: open (or extend) guard windows; for drifted parameters switch to
        stochastic rounding where the optimizer has it (once), else reset them."""
        schedule = a.schedule
        previous = schedule.arrays["remedy"]
        chosen = self.remedy.choose(schedule)
        # Both switches are for good: a parameter whose v underflowed once stays guarded (its window is re-armed at
        # every check), and stochastic rounding stays on; only a new cause (drift, underflow) changes the choice.
        chosen[(chosen == remedies.NONE) & (previous == remedies.GUARD)] = remedies.GUARD
        chosen[(previous == remedies.STOCHASTIC) & (chosen != remedies.GUARD)] = remedies.STOCHASTIC
        drifted = np.flatnonzero(chosen == remedies.RESET)
        if drifted.size and a.adapter.use_stochastic_rounding([schedule.units[i].param for i in drifted]):
            chosen[drifted] = remedies.STOCHASTIC
            first = schedule.units[drifted[0]]
            self._info(f"[lightning_stale] remedy: stochastic rounding from step {a.steps + 1} for {drifted.size} "
                       f"parameter(s) whose stored v drifted out of [1/{self.remedy.drift.band:g}, "
                       f"{self.remedy.drift.band:g}] x its fp32 EMA (e.g. {self._unit_name(a, first)!r}: "
                       f"{first.drift:.2f})")
        guard_rows = np.flatnonzero(chosen == remedies.GUARD)
        for i in guard_rows[schedule.arrays["remedy"][guard_rows] != remedies.GUARD]:
            unit = schedule.units[i]
            self._info(f"[lightning_stale] remedy: underflow guard on for {self._unit_name(a, unit)!r} (v stored as "
                       f"zero for {100 * unit.underflow:.2g}% of its sampled elements with a non-zero gradient)")
        window = remedies.GUARD_CHECKS * self._check_every
        schedule.arrays["guard_left"][guard_rows] = np.maximum(schedule.arrays["guard_left"][guard_rows], window)
        schedule.arrays["remedy"][:] = chosen
        reset_rows = np.flatnonzero(chosen == remedies.RESET)
        if reset_rows.size:
            drifted = [schedule.units[i] for i in reset_rows]
            self._info(f"[lightning_stale] remedy: reset {len(drifted)} parameter(s) whose stored v drifted out of "
                       f"[1/{self.remedy.drift.band:g}, {self.remedy.drift.band:g}] x its fp32 EMA (e.g. "
                       f"{self._unit_name(a, drifted[0])!r}: {drifted[0].drift:.2f}) at step {a.steps}")
            self.remedy_resets += len(drifted)
            self._reset(a, drifted, self.remedy.moments)

    def _maybe_reset(self, a: _Attached) -> None:
        due = self.policy.due(a.schedule, a.steps)
        if self.policy.needs_sync and self._reduce is not None:
            due = self._reduce(torch.from_numpy(due.astype(np.float64))).cpu().numpy() > 0
        if due.any():
            self._reset(a, [a.schedule.units[i] for i in np.flatnonzero(due)], self.policy.moments)

    def _reset(self, a: _Attached, units: list[ResetUnit], moments: Sequence[str]) -> None:
        reset = a.adapter.reset_exact if self.options.v_reset == "exact-unbounded" else a.adapter.reset
        reset(moments=moments, params=[u.param for u in units])
        slots = []
        for unit in units:
            for entry in unit.entries:
                if entry.moment in moments:
                    a.engine.resync(entry)
                    slots.append(entry.slot)
        a.schedule.record_reset(units, a.steps, self.options.warmup_steps, POST_RESET_GUARD_STEPS)
        self.reset_events += 1
        event = ResetEvent(a.steps, a.optimizer, slots)
        for listener in self._listeners:
            listener(event)

    # -- names and messages ------------------------------------------------------------------------------------------
    def _unit_name(self, a: _Attached, unit: ResetUnit) -> str:
        name = self._names.get(id(unit.param), unit.key)
        return name if len(self._attached) == 1 else f"{a.engine.prefix}/{name}"

    def _info(self, message: str) -> None:
        rank_zero_info(message)

    def _summary(self, a: _Attached) -> str:
        """The fit-start report: formats (parameters and elements each), periods, and, with several processes,
        parameters whose low-precision state fell back to fp32 on some ranks only (optimizers apply their size
        threshold to the local shard). A collective when several processes run: every rank calls it at once."""
        from collections import Counter

        params: Counter[str] = Counter()
        elements: Counter[str] = Counter()
        periods: Counter[str] = Counter()
        for unit in a.schedule.units:
            for slot in unit.slots:
                params[f"{slot.moment} {slot.format} (beta={slot.beta})"] += 1
                elements[f"{slot.moment} {slot.format} (beta={slot.beta})"] += slot.numel
            if self.policy is not None and unit.position not in a.pending and unit.period_source:
                periods[f"{unit.period} ({unit.period_source})"] += 1
        engine = a.engine
        remedy = f"; remedy: {self.remedy!r}" if self.remedy is not None else ""
        lines = [f"[lightning_stale] {a.adapter.describe()}; policy: {self.policy!r}{remedy}; tracking: "
                 + ("exact" if engine.exact else f"sample ({engine.sample_size} elements, "
                    f"{len(engine.cohorts[0]) if engine.cohorts else 0} parameters per step)")
                 + f" every {self.options.track_every} step(s)",
                 "[lightning_stale] state formats (parameters, elements on this rank): "
                 + ", ".join(f"{k} x{params[k]} ({elements[k]:,})" for k in params)]
        if self._reduce is not None:
            low = torch.tensor([[float(any(s.format != "fp32" for s in u.slots)), 1.0] for u in a.schedule.units],
                               dtype=torch.float64).reshape(-1)
            counts = self._reduce(low).to(torch.float64).cpu().view(-1, 2)
            mixed = [self._unit_name(a, u) for u, (n_low, n) in zip(a.schedule.units, counts.tolist())
                     if 0 < n_low < n]
            if mixed:
                lines.append(f"[lightning_stale] {len(mixed)} parameter(s) have low-precision states on some ranks and "
                             f"fp32 on others (the optimizer's size threshold applies to local shards): "
                             + ", ".join(mixed[:5]) + (" ..." if len(mixed) > 5 else ""))
        if periods:
            lines.append("[lightning_stale] reset periods: " + ", ".join(f"{k} x{n}" for k, n in periods.items()))
        if a.pending:
            lines.append(f"[lightning_stale] {len(a.pending)} parameter(s) get their rho-hat at their first "
                         "measurement")
        return "\n".join(lines)


def _names(names: nn.Module | Mapping[str, Tensor] | None) -> dict[int, str]:
    if names is None:
        return {}
    pairs: Iterable[tuple[str, Tensor]] = names.named_parameters() if isinstance(names, nn.Module) else names.items()
    return {id(p): n for n, p in pairs}


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _default_reduce() -> Reduce | None:
    """``torch.distributed.all_reduce`` (sum) when a multi-process group is up, on the backend's device."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def reduce(tensor: Tensor) -> Tensor:
        tensor = tensor.to(device)
        dist.all_reduce(tensor)
        return tensor

    return reduce

