"""StaleStateMonitor: the components around any optimizer, in any training loop.

Data flow per optimizer: optimizer state -> adapter (slots) -> :class:`~lightning_stale.engine.StallEngine`
(counts, in torch's optimizer step hooks) -> :class:`~lightning_stale.schedule.ResetSchedule` (bookkeeping) and
:class:`~lightning_stale.forecast.StallForecast` (the theory) -> the policy and the remedy (decide) ->
:class:`~lightning_stale.interventions.Interventions` (act, in place). :meth:`StaleStateMonitor.compute` turns the
counts into one row of metrics (:mod:`lightning_stale.metrics`). The monitor only orchestrates; the Lightning Trainer
callback and the other front-ends are thin wrappers around it.

Only steps that really ran count: the hooks run inside ``optimizer.step()`` (a GradScaler-skipped step never calls
it; a fused optimizer that skips internally is recognised by the ``found_inf`` flag GradScaler sets on it). A
measurement that cannot be made for a slot (no data yet, a failed estimate) is skipped and retried, with one warning;
an unexpected error inside a hook is reported once and that step is skipped, so the monitor never stops a run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

import lightning_stale.adapters as adapters
from lightning_stale import _compat, metrics
from lightning_stale.adapters.protocol import OptimizerAdapter, Slot
from lightning_stale.collective import Collective, Reduce, default_reduce, world_size
from lightning_stale.engine import StallEngine
from lightning_stale.forecast import StallForecast
from lightning_stale.interventions import Interventions, ListenerError, ResetEvent, ResetListener
from lightning_stale.messages import Notices, ParamNames, StaleStateInternalWarning, StaleStateWarning, info
from lightning_stale.options import MonitorOptions
from lightning_stale.remedies import GUARD, STOCHASTIC
from lightning_stale.report import fit_start_report, period_report
from lightning_stale.schedule import ResetSchedule, ResetUnit
from lightning_stale.state import STATE_VERSION, upgrade
from lightning_stale.vocab import check_int

__all__ = ["MonitorOptions", "ResetEvent", "ResetListener", "StaleStateInternalWarning", "StaleStateMonitor",
           "StaleStateWarning"]
RECENT_FOR_POLICY, RECENT_FOR_REMEDY = "policy", "remedy"  # the readers of the engine's recent counts


@dataclass(eq=False)
class _Track:
    """One attached optimizer: its components and the monitor's step counter for it."""

    adapter: OptimizerAdapter
    engine: StallEngine
    schedule: ResetSchedule
    forecast: StallForecast
    interventions: Interventions
    steps: int  # real optimizer steps seen (restored from checkpoints)
    adopted: int = -1  # the engine version whose units the schedule holds
    announced: bool = False
    estimated: set[int] = field(default_factory=set)  # positions given a grid estimate since the last period report

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
            :class:`~lightning_stale.policies.ResetPolicy` (which carries its own arguments).
        every: reset period in optimizer steps for ``reset="periodic"``.
        s0: staleness tolerance of the theory and adaptive rules (default 0.6, the paper's).
        min_interval: fewest steps between two adaptive or drift resets of a parameter (default 50).
        moments: which moments a shortcut policy or the remedy resets: ``("m", "v")`` (default) or ``("v",)``.
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
            ``lr * m_hat / |g|`` per element, unbounded where the new gradient is small. Other optimizers always use
            the bounded restart.
        remedy: ``"auto"`` or a :class:`~lightning_stale.remedies.Remedy`: per parameter, the remedy its measured
            cause calls for (see :mod:`lightning_stale.remedies`), logged as ``<prefix>/remedy/...``. It chooses
            resets itself, so it cannot be combined with ``reset``.
        drift_band: allowed ratio of stored v to its fp32 EMA for ``reset="drift"`` and ``remedy="auto"`` (default
            1.5).
        names: the model (``named_parameters`` gives the names) or a mapping name -> parameter, for readable
            per-parameter keys and messages.
        reduce: sums a float64 tensor across processes (every rank calls :meth:`compute` at the same steps). Default:
            ``torch.distributed.all_reduce`` when a process group is initialized, else nothing.
        steps_taken: optimizer steps each optimizer already took before the monitor attached (a front-end that
            attaches after the first step passes 1), so that :attr:`steps` and :attr:`ResetEvent.step` count the
            optimizer's real steps; a restored :meth:`state_dict` replaces it.
        coverage_steps: in sample mode, every parameter is measured at least once in this many measured steps (set it
            to your logging interval). Also the interval of check steps, on which ``reset="drift"`` and the remedy
            read their signals (one host synchronisation each).
        options: a :class:`MonitorOptions` instead of the individual options above.
    """

    def __init__(self, optimizers: object | Sequence[object], reset: Any = None, *,
                 names: nn.Module | Mapping[str, Tensor] | None = None, reduce: Reduce | None = None,
                 coverage_steps: int = 50, steps_taken: int = 0, options: MonitorOptions | None = None,
                 **kwargs: Any) -> None:
        if options is None:
            options = MonitorOptions.from_arguments("StaleStateMonitor", {"reset": reset, **kwargs})
        elif reset is not None or kwargs:
            raise ValueError("pass either `options` or individual options, not both")
        check_int("coverage_steps", coverage_steps)
        check_int("steps_taken", steps_taken, minimum=0)
        self.options, self.policy, self.remedy = options, options.policy, options.remedy_rule
        self._check_every = coverage_steps
        self._collective = Collective(reduce if reduce is not None else default_reduce())
        self._listeners: list[ResetListener] = []
        self._handles: list[RemovableHandle] = []
        self._notices = Notices()
        sources = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        if not sources:
            raise ValueError("StaleStateMonitor needs at least one optimizer (none was given)")
        self._names = ParamNames(names, len(sources))
        self._tracks = [self._attach(i, source, coverage_steps, steps_taken) for i, source in enumerate(sources)]

    # -- queries -----------------------------------------------------------------------------------------------------
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The raw optimizers whose step hooks the monitor uses."""
        return [t.optimizer for t in self._tracks]

    @property
    def steps(self) -> list[int]:
        """Real optimizer steps counted per optimizer (skipped steps excluded)."""
        return [t.steps for t in self._tracks]

    @property
    def reset_events(self) -> int:
        """Resets applied so far (one event may reset several parameters)."""
        return sum(t.interventions.resets for t in self._tracks)

    @property
    def remedy_resets(self) -> int:
        """Parameter resets the remedy made so far."""
        return sum(t.interventions.remedy_resets for t in self._tracks)

    def slots(self, optimizer_index: int = 0) -> list[Slot]:
        """The slots tracked for one optimizer (after its first step)."""
        return [e.slot for e in self._tracks[optimizer_index].engine.entries.values()]

    def units(self, optimizer_index: int = 0) -> list[ResetUnit]:
        """The parameters of one optimizer as the reset policy sees them (ages, periods, reset counts)."""
        return list(self._tracks[optimizer_index].schedule.units)

    def engines(self) -> list[StallEngine]:
        """The engine of each optimizer (its readouts: :meth:`StallEngine.tensors`, windows, drift)."""
        return [t.engine for t in self._tracks]

    def resident_bytes(self) -> int:
        """Memory the monitor keeps between steps, for budgeting: every tensor and array of its components (the
        optimizer state it reads is not counted)."""
        return sum(t.engine.resident_bytes() + t.forecast.resident_bytes() + t.schedule.resident_bytes()
                   + t.interventions.resident_bytes() for t in self._tracks)

    def reset_periods(self) -> dict[str, int | None]:
        """The reset period chosen for each parameter (by name), once its state exists."""
        return {self._name(t, u): u.period for t in self._tracks for u in t.schedule.units}

    def add_reset_listener(self, listener: ResetListener) -> None:
        """Call ``listener(event)`` with a :class:`ResetEvent` after every reset (e.g. to re-warm a learning rate)."""
        self._listeners.append(listener)

    # -- metrics -----------------------------------------------------------------------------------------------------
    def compute(self) -> dict[str, float]:
        """The metrics of every measured step since the previous call, summed across ranks; starts a new window.

        A collective when ``reduce`` is set: call it on every rank at the same steps.
        """
        row, per_param = self.compute_parts()
        return {**row, **per_param}

    def compute_parts(self) -> tuple[dict[str, float], dict[str, float]]:
        """:meth:`compute` as (the aggregate row, the per-parameter fractions of this rank) for front-ends that log
        them through different paths."""
        prefix = self.options.log_key_prefix
        vector = torch.zeros(len(metrics.MOMENTS) * metrics.PER_MOMENT, dtype=torch.float64)
        per_param: dict[str, float] = {}
        for t in self._tracks:
            engine = t.engine
            totals, predicted = engine.window(), t.forecast.take_window(engine.entries)
            drift = [(engine.entries[k].moment, value, engine.drift_weight(k)) for k, value in engine.drift().items()]
            vector += metrics.moment_vector(totals, [e.moment for e in engine.entries.values()], drift, predicted)
            if self.options.log_per_param:
                for entry, row in zip(engine.entries.values(), totals.tolist()):
                    if row[metrics.COUNTED] > 0:
                        name = self._names(entry.unit.param, entry.unit.key, engine.prefix)
                        per_param[metrics.key(prefix, name, entry.slot.key, metrics.FRAC)] = \
                            row[metrics.STALLED] / row[metrics.COUNTED]
        ages = np.concatenate([t.schedule.ages for t in self._tracks])
        betas = [e.slot.beta for t in self._tracks for e in t.engine.entries.values()
                 if e.moment == "v" and e.slot.beta is not None]
        row = metrics.row(self._collective.sum(vector), prefix, self.reset_events,
                          float(ages.mean()) if ages.size else None, sum(betas) / len(betas) if betas else None)
        if self.remedy is not None and row:  # decisions are agreed across ranks: rank-local counts are global
            chosen = np.concatenate([t.schedule.arrays["remedy"] for t in self._tracks])
            row.update(metrics.remedy_row(prefix, int((chosen == GUARD).sum()), int((chosen == STOCHASTIC).sum()),
                                          self.remedy_resets))
        return row, per_param

    # -- lifecycle and state -----------------------------------------------------------------------------------------
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
        return {"version": STATE_VERSION, "rank": _compat.global_rank(), "world_size": world_size(),
                "policy": repr(self.policy),
                "optimizers": [{"steps": t.steps, "engine": t.engine.state_dict(), "forecast": t.forecast.state_dict(),
                                "schedule": t.schedule.state_dict(), "interventions": t.interventions.state_dict()}
                               for t in self._tracks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (this version's or an earlier one's): counts in the current window,
        drift shadows, ages and reset counts; reset periods are re-derived from the policy configured now.

        Lightning checkpoints one copy of a callback's state (rank 0's) for every process. What only describes the
        saving process (its unlogged counts, its drift shadows) is therefore used only by that process, and after a
        multi-process resume the first row covers the steps since the resume; ages, reset counts and cursors are the
        same on every rank and always restored."""
        state = upgrade(state)
        saved = state["optimizers"]
        if len(saved) != len(self._tracks):
            raise ValueError(
                f"the saved monitor state tracks {len(saved)} optimizer(s) but {len(self._tracks)} are attached now. "
                "Resume with the same optimizers, or drop the saved monitor state."
            )
        if state.get("policy", repr(self.policy)) != repr(self.policy):
            info(f"[lightning_stale] resuming with policy {self.policy!r}; the checkpoint was saved with "
                 f"{state['policy']}: reset periods are chosen by the new policy, ages and counts continue.")
        multi_process = state.get("world_size", 1) > 1 or world_size() > 1
        own_shadows = not multi_process or state.get("rank", 0) == _compat.global_rank()
        for t, s in zip(self._tracks, saved):
            t.steps = int(s["steps"])
            t.engine.load_state_dict(s["engine"], counts=not multi_process, shadows=own_shadows)
            t.forecast.load_state_dict(s["forecast"], window=not multi_process)
            t.schedule.load_state_dict(s["schedule"])
            t.interventions.load_state_dict(s["interventions"])
            t.adopted = -1

    def continue_from(self, previous: StaleStateMonitor) -> None:
        """Go on from a monitor of an earlier run in this process (a second ``fit`` of the same Trainer): its whole
        state where it watched the same optimizers, else its reset counters (the new optimizers start fresh)."""
        if [id(o) for o in previous.optimizers] == [id(o) for o in self.optimizers]:
            self.load_state_dict(previous.state_dict())
        else:
            self._tracks[0].interventions.add_counts(previous.reset_events, previous.remedy_resets)

    # -- attaching and the error shield ------------------------------------------------------------------------------
    def _attach(self, index: int, source: object, coverage_steps: int, steps_taken: int) -> _Track:
        options = self.options
        adapter = adapters.adapter_for(source, strict=options.strict)
        readers = ((RECENT_FOR_REMEDY,) if self.remedy is not None else ()) + \
            ((RECENT_FOR_POLICY,) if self.policy is not None and self.policy.needs_measurement else ())
        engine = StallEngine(adapter, f"opt{index}", options.track == "exact", options.sample_size,
                             options.params_per_step, max(1, coverage_steps // options.track_every), options.seed,
                             readers)
        schedule = ResetSchedule()
        name: Callable[[ResetUnit], str] = lambda unit: self._names(unit.param, unit.key, engine.prefix)  # noqa: E731
        track = _Track(adapter, engine, schedule, StallForecast(self._collective, self._notices.warn_once, name),
                       Interventions(adapter, engine, schedule, underflow_guard=options.underflow_guard,
                                     warmup_steps=options.warmup_steps,
                                     exact_v_reset=options.v_reset == "exact-unbounded", listeners=self._listeners,
                                     name=name),
                       steps=steps_taken)
        self._handles.append(adapter.optimizer.register_step_pre_hook(lambda *_: self._shielded(self._before, track)))
        self._handles.append(adapter.optimizer.register_step_post_hook(lambda *_: self._shielded(self._after, track)))
        self._handles.append(adapter.optimizer.register_load_state_dict_post_hook(lambda *_: engine.invalidate()))
        self._adopt(track)
        return track

    def _shielded(self, hook: Callable[[_Track], None], track: _Track) -> None:
        try:
            hook(track)
        except ListenerError:  # the user's own code failed: it reaches the user like any callback error
            raise
        except Exception as error:  # the monitor must never stop a training run
            track.engine.discard()
            self._notices.warn_once(
                f"{type(error).__name__}: {error}",
                f"lightning_stale skipped a measurement after an unexpected error ({type(error).__name__}: {error}); "
                "training continues. Please report this with your optimizer and model.", StaleStateInternalWarning)

    def _name(self, track: _Track, unit: ResetUnit) -> str:
        return self._names(unit.param, unit.key, track.engine.prefix)

    # -- the step ----------------------------------------------------------------------------------------------------
    def _before(self, t: _Track) -> None:
        t.engine.before_step((t.steps + 1) % self.options.track_every == 0)
        self._adopt(t)
        t.interventions.before_step()

    def _after(self, t: _Track) -> None:
        # GradScaler hands a fused/AMP-aware optimizer its verdict as the attribute ``found_inf`` during step()
        found_inf = getattr(t.optimizer, "found_inf", None)
        if found_inf is not None and bool(found_inf):  # a host sync, only under GradScaler with a fused optimizer
            t.engine.discard()
            return
        t.steps += 1
        t.interventions.warm_up()
        measured = t.engine.after_step()
        self._adopt(t, after_step=True)
        t.interventions.guard()
        waiting = [u.position for u in t.engine.measured_cohort if t.forecast.waiting(t.schedule.units[u.position])]
        if waiting:  # a first estimate at the first measurement (one host read): predictions from the first window on
            self._estimate(t, waiting)
        if measured:
            t.forecast.record(measured, t.schedule)
        t.schedule.advance()
        if t.steps % self._check_every == 0:
            self._check(t)
        if self.policy is None:
            return
        if self.policy.needs_measurement and measured:
            recent = t.engine.take_recent(RECENT_FOR_POLICY)  # one host read per measured step
            for entry in (e for batch in measured for e in batch.entries):
                unit = t.schedule.units[entry.unit.position]
                if unit.driver() is entry.slot:
                    stalled, counted, _ = recent[entry.row]
                    self.policy.observe(unit, stalled / counted if counted > 0 else math.nan)
        due = self.policy.due(t.schedule, t.steps)
        if self.policy.needs_sync and self._collective.active:
            due = self._collective.sum(due.astype(np.float64)) > 0
        if due.any():
            t.interventions.reset([t.schedule.units[i] for i in np.flatnonzero(due)], self.policy.moments, t.steps)

    def _check(self, t: _Track) -> None:
        """A check step (every ``coverage_steps``): grid estimates of the parameters whose rho-hat is not final; for
        the remedy and the drift policy, the drift of every driver group and (for the remedy) each parameter's v
        underflow since the last check, agreed across ranks (one host read, one collective), into the schedule; then
        the remedy acts."""
        if t.forecast.pending:
            self._estimate(t)
        if self.remedy is None and (self.policy is None or not self.policy.needs_drift):
            return
        recent = t.engine.take_recent(RECENT_FOR_REMEDY) if self.remedy is not None else None
        t.schedule.set_signals(*t.engine.agreed_signals(self._collective.sum(t.engine.signals(recent))))
        if self.remedy is not None:
            t.interventions.apply_remedy(self.remedy, t.steps, self._check_every)

    def _adopt(self, t: _Track, after_step: bool = False) -> None:
        """Align the schedule and the forecast with the engine's units; let the policy choose the periods of the
        parameters whose rho-hat is known; announce the optimizer at its first parameters.

        A parameter whose state existed before monitoring began (a checkpoint saved without the monitor) is as old as
        its optimizer step counter says; inside the post-step hook that counter already includes this step, which
        the schedule adds next."""
        if t.adopted == t.engine.version:
            return
        t.adopted = t.engine.version
        new = t.schedule.sync(t.engine.units, lambda unit: max(0, (t.adapter.steps_taken(unit.param) or 0)
                                                              - after_step))
        t.forecast.align(t.engine.entries)
        t.forecast.adopt(t.schedule)
        fresh = {u.position for u in new}
        self._configure([u for u in t.schedule.units if (u.position in fresh or u.period_source == "")
                         and not t.forecast.waiting(u)])
        if new and not t.announced:
            t.announced = True
            mixed = self._mixed_precision(t)  # a collective: every rank adopts at the same step
            info(fit_start_report(t.adapter, t.engine, t.schedule, t.forecast.pending, self.policy, self.remedy,
                                  self.options.track_every, mixed))

    def _estimate(self, t: _Track, positions: list[int] | None = None) -> None:
        """Grid estimates for the parameters whose rho-hat is not final (at ``positions`` only, where given); the
        periods, once all are final."""
        changed = t.forecast.estimate(t.schedule, positions)
        self._configure(changed)
        t.estimated.update(u.position for u in changed)
        if changed and not t.forecast.pending:
            line = period_report(t.schedule, self.policy, only=t.estimated,
                                 title="reset periods from the settled grid estimates")
            if line:
                info(line)
            t.estimated = set()

    def _configure(self, units: list[ResetUnit]) -> None:
        if self.policy is not None:
            for unit in units:
                self.policy.configure(unit)

    def _mixed_precision(self, t: _Track) -> list[str]:
        """With several processes, the parameters whose low-precision state fell back to fp32 on some ranks only."""
        if not self._collective.active:
            return []
        flags = [[float(any(s.format != "fp32" for s in u.slots)), 1.0] for u in t.schedule.units]
        counts = self._collective.sum(np.array(flags, dtype=np.float64).reshape(-1, 2))
        return [self._name(t, u) for u, (n_low, n) in zip(t.schedule.units, counts.tolist()) if 0 < n_low < n]
