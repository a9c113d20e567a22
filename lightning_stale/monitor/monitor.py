"""StaleStateMonitor: the components around any optimizer, in any training loop.

Data flow per optimizer (an :class:`~lightning_stale.monitor.pipeline.OptimizerPipeline` each): optimizer state ->
adapter (slots) -> :class:`~lightning_stale.measure.engine.StallEngine` (counts, in torch's optimizer step hooks) ->
:class:`~lightning_stale.decide.ledger.Ledger` (bookkeeping) and
:class:`~lightning_stale.decide.forecast.StallForecast` (the theory) -> the policy and the remedy (decide) ->
:class:`~lightning_stale.act.interventions.Interventions` (act, in place). :attr:`StaleStateMonitor.metric`, a
torchmetrics Metric (:mod:`lightning_stale.monitor.window`), turns the counts into one row of metrics.
The monitor only attaches, shields and aggregates; the Lightning Trainer callback and the other front-ends are thin
wrappers around it.

Only steps that really ran count: the hooks run inside ``optimizer.step()`` (a GradScaler-skipped step never calls
it; a fused optimizer that skips internally is recognised by the ``found_inf`` flag GradScaler sets on it). A
measurement that cannot be made for a slot (no data yet, a failed estimate) is skipped and retried, with one warning;
an unexpected error inside a hook is reported once and that step is skipped, so the monitor never stops a run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_stale import _compat
from lightning_stale.act.interventions import ListenerError, ResetEvent, ResetListener
import lightning_stale.adapters as adapters
from lightning_stale.adapters.protocol import Slot
from lightning_stale.decide.ledger import LedgerRow
from lightning_stale.measure.engine import StallEngine
from lightning_stale.messages import Notices, ParamNames, StaleStateInternalWarning, StaleStateWarning, info
from lightning_stale.monitor import carried
from lightning_stale.monitor.options import MonitorOptions
from lightning_stale.monitor.pipeline import OptimizerPipeline
from lightning_stale.monitor.window import StaleStateMetric
from lightning_stale.ranks import Reduce, default_reduce, world_size
from lightning_stale.state import STATE_VERSION, upgrade
from lightning_stale.vocab import check_int

__all__ = ["MonitorOptions", "ResetEvent", "ResetListener", "StaleStateInternalWarning", "StaleStateMetric",
           "StaleStateMonitor", "StaleStateWarning"]


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
                monitor.reset_window()  # the next row covers the next 50 steps
        monitor.close()

    :attr:`metric` is the same window as a torchmetrics Metric (``compute()``, ``reset()``, a ``MetricCollection``).

    Args:
        optimizers: a torch optimizer, a wrapper of one (``LightningOptimizer``, accelerate's ``AcceleratedOptimizer``)
            or a sequence of them.
        names: the model (``named_parameters`` gives the names) or a mapping name -> parameter, for readable
            per-parameter keys and messages.
        reduce: sums a float64 tensor across processes (every rank calls :meth:`compute` at the same steps). Default:
            ``torch.distributed.all_reduce`` when a process group is initialized, else nothing.
        steps_taken: optimizer steps each optimizer already took before the monitor attached (a front-end that
            attaches after the first step passes 1), so that :attr:`steps` and :attr:`ResetEvent.step` count the
            optimizer's real steps; a restored :meth:`state_dict` replaces it.
        state: a :meth:`state_dict` to continue from, loaded before the monitor looks at the optimizers' state (so
            its fit-start report and first decisions are those of the resumed run). Without it the monitor continues
            from the state each optimizer's own state dict carried, where a loaded checkpoint left one (every
            optimizer's ``state_dict()`` carries the monitor's part, see :mod:`lightning_stale.monitor.carried`).
        coverage_steps: in sample mode, every parameter is measured at least once in this many measured steps (set it
            to your logging interval). Also the interval of check steps, which re-take the grid estimates of rho-hat
            and on which ``reset="drift"`` and the remedy read their signals (one host synchronisation each).
        options: a :class:`MonitorOptions`, or its fields as keyword arguments (``reset``, ``track``, ``remedy``,
            ...: documented there).
    """

    def __init__(self, optimizers: object | Sequence[object], reset: Any = None, *,
                 names: nn.Module | Mapping[str, Tensor] | None = None, reduce: Reduce | None = None,
                 coverage_steps: int = 50, steps_taken: int = 0, state: Mapping[str, Any] | None = None,
                 options: MonitorOptions | None = None, **kwargs: Any) -> None:
        if options is None:
            options = MonitorOptions.from_arguments("StaleStateMonitor", {"reset": reset, **kwargs})
        elif reset is not None or kwargs:
            raise ValueError("pass either `options` or individual options, not both")
        check_int("coverage_steps", coverage_steps)
        check_int("steps_taken", steps_taken, minimum=0)
        self.options, self.policy, self.remedy = options, options.policy, options.remedy_rule
        self._reduce = reduce if reduce is not None else default_reduce()
        self._listeners: list[ResetListener] = []
        self._handles: list[RemovableHandle] = []
        self._notices = Notices()
        sources = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        if not sources:
            raise ValueError("StaleStateMonitor needs at least one optimizer (none was given)")
        self._names = ParamNames(names, len(sources))
        self._pipelines: list[OptimizerPipeline] = []
        # Plain values a front-end keeps with the monitor's state (the Fabric callback's logging clock): saved in
        # state_dict() and in each optimizer's state dict, restored with them.
        self.front_end: dict[str, Any] = {}
        try:
            for i, source in enumerate(sources):
                self._pipelines.append(self._attach(i, source, coverage_steps, steps_taken))
            self.metric = StaleStateMetric(self._pipelines, options, self._names, self._reduce)  # the window's metrics
            self.restored = self._restore(state)  # whether the monitor continues from a saved state
            for pipeline in self._pipelines:
                pipeline.adopt(stepping=False)  # the remedy judges at the first step hook
        except BaseException:
            self.close()  # a monitor that cannot attach leaves no hook behind (a front-end may train on without it)
            raise

    # -- queries -----------------------------------------------------------------------------------------------------
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The raw optimizers whose step hooks the monitor uses."""
        return [pipeline.optimizer for pipeline in self._pipelines]

    @property
    def steps(self) -> list[int]:
        """Real optimizer steps counted per optimizer (skipped steps excluded)."""
        return [pipeline.steps for pipeline in self._pipelines]

    @property
    def reset_events(self) -> int:
        """Resets applied so far (one event may reset several parameters)."""
        return sum(pipeline.interventions.resets for pipeline in self._pipelines)

    @property
    def remedy_resets(self) -> int:
        """Parameter resets the remedy made so far."""
        return sum(pipeline.interventions.remedy_resets for pipeline in self._pipelines)

    def slots(self, optimizer_index: int = 0) -> list[Slot]:
        """The slots tracked for one optimizer (after its first step)."""
        return [e.slot for e in self._pipelines[optimizer_index].engine.entries.values()]

    def rows(self, optimizer_index: int = 0) -> list[LedgerRow]:
        """The ledger rows of one optimizer's parameters as the reset policy sees them (ages, periods, resets)."""
        return list(self._pipelines[optimizer_index].ledger.rows)

    def engines(self) -> list[StallEngine]:
        """The engine of each optimizer (its readouts: :meth:`StallEngine.tensors`, windows, drift)."""
        return [pipeline.engine for pipeline in self._pipelines]

    def resident_bytes(self) -> int:
        """Memory the monitor keeps between steps, for budgeting: every tensor and array of its components (the
        optimizer state it reads is not counted)."""
        return sum(pipeline.engine.resident_bytes() + pipeline.forecast.resident_bytes()
                   + pipeline.ledger.resident_bytes() + pipeline.interventions.resident_bytes()
                   for pipeline in self._pipelines)

    def weight_buffer_bytes(self) -> int:
        """The weight write-back's compensation buffers, which live in the optimizers' state (2 bytes per element of
        each bf16 parameter under compensated summation; not part of :meth:`resident_bytes`)."""
        return sum(pipeline.writeback.buffer_bytes() for pipeline in self._pipelines if pipeline.writeback is not None)

    def reset_periods(self) -> dict[str, int | None]:
        """The reset period chosen for each parameter (by name), once its state exists."""
        return {pipeline.name(row): row.period for pipeline in self._pipelines for row in pipeline.ledger.rows}

    def watches(self, optimizer: object) -> bool:
        """Whether ``optimizer`` (or a wrapper of it: Lightning's and Fabric's share its param groups) is watched."""
        return self._pipeline_of(optimizer) is not None

    def follow_schedule(self, scheduler: Any, last_step: int, every: int = 1) -> None:
        """Let the fit-start report of stored weights say from which step ``scheduler`` (stepped once every ``every``
        optimizer steps up to ``last_step``) keeps the lr below the one where each format's median weight stops
        moving. The report runs the scheduler ahead and puts it back; one that needs a metric is not followed."""
        check_int("last_step", last_step, minimum=0)
        check_int("every", every)
        pipeline = self._pipeline_of(getattr(scheduler, "optimizer", None))
        if pipeline is None:
            raise ValueError(f"`scheduler` ({type(scheduler).__name__}) must step one of the monitor's optimizers "
                             f"({', '.join(type(pipeline.optimizer).__name__ for pipeline in self._pipelines)})")
        pipeline.follow(scheduler, last_step, every)

    def plan_steps(self, last_step: int) -> None:
        """The run ends at optimizer step ``last_step`` (front-ends that know it say so at fit start): the weight
        write-back then compiles its CPU pass only where the remaining steps repay the compile."""
        check_int("last_step", last_step, minimum=0)
        for pipeline in self._pipelines:
            if pipeline.writeback is not None:
                pipeline.writeback.plan_steps(last_step - pipeline.steps)

    def add_reset_listener(self, listener: ResetListener) -> None:
        """Call ``listener(event)`` with a :class:`ResetEvent` after every reset (e.g. to re-warm a learning rate)."""
        self._listeners.append(listener)

    # -- metrics -----------------------------------------------------------------------------------------------------
    def compute(self) -> dict[str, float]:
        """The metrics of every measured step since the last :meth:`reset_window`, summed across ranks:
        :attr:`metric`'s ``compute()``. A readout: calling it again gives the same row; call :meth:`reset_window`
        after logging a row to start the next one.

        A collective when ``reduce`` is set: call it on every rank at the same steps.
        """
        return self.metric.compute()

    def compute_parts(self) -> tuple[dict[str, float], dict[str, float]]:
        """:meth:`compute` as (the aggregate row, the per-parameter fractions of this rank) for front-ends that log
        them through different paths."""
        return self.metric.compute_parts()

    def reset_window(self) -> None:
        """Start a new window: the next :meth:`compute` covers only the steps after this call (the optimizer states
        and the reset bookkeeping are untouched); :attr:`metric`'s ``reset()``."""
        self.metric.reset()

    # -- lifecycle and state -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Detach from the optimizers' step hooks (the monitor keeps its state and can be inspected)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for pipeline in self._pipelines:
            pipeline.close()

    def __enter__(self) -> StaleStateMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        return self._state(self._pipelines)

    def _state(self, pipelines: list[OptimizerPipeline]) -> dict[str, Any]:
        return {"version": STATE_VERSION, "rank": _compat.global_rank(), "world_size": world_size(),
                "policy": repr(self.policy), "front_end": dict(self.front_end),
                "optimizers": [pipeline.state_dict() for pipeline in pipelines]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (this version's or an earlier one's): counts in the current window,
        drift shadows, ages, reset counts and, when the policy is the one the checkpoint was saved with, its periods
        (a different policy chooses them anew).

        Lightning checkpoints one copy of a callback's state (rank 0's) for every process. What only describes the
        saving process (its unlogged counts, its drift shadows) is therefore used only by that process, and after a
        multi-process resume the first row covers the steps since the resume; ages, reset counts and cursors are the
        same on every rank and always restored."""
        state = upgrade(state)
        if len(state["optimizers"]) != len(self._pipelines):
            raise ValueError(
                f"the saved monitor state tracks {len(state['optimizers'])} optimizer(s) but {len(self._pipelines)} "
                "are attached now. Resume with the same optimizers, or drop the saved monitor state."
            )
        self._load(state, self._pipelines)

    def _load(self, state: dict[str, Any], pipelines: list[OptimizerPipeline]) -> None:
        """Load an upgraded state's per-optimizer parts into ``pipelines`` (one part each)."""
        same_policy = state.get("policy", repr(self.policy)) == repr(self.policy)
        if not same_policy:
            info(f"[lightning_stale] resuming with policy {self.policy!r}; the checkpoint was saved with "
                 f"{state['policy']}: reset periods are chosen by the new policy, ages and counts continue.")
        multi_process = state.get("world_size", 1) > 1 or world_size() > 1
        own_shadows = not multi_process or state.get("rank", 0) == _compat.global_rank()
        for pipeline, part in zip(pipelines, state["optimizers"]):
            pipeline.load_state_dict(part, counts=not multi_process, shadows=own_shadows, periods=same_policy)
        self.front_end = dict(state.get("front_end", {}))

    def continue_from(self, previous: StaleStateMonitor) -> None:
        """Go on from a monitor of an earlier run in this process (a second ``fit`` of the same Trainer): its whole
        state where it watched the same optimizers, else its reset counters (the new optimizers start fresh)."""
        if [id(o) for o in previous.optimizers] == [id(o) for o in self.optimizers]:
            self.load_state_dict(previous.state_dict())
        else:
            self._pipelines[0].interventions.add_counts(previous.reset_events, previous.remedy_resets)

    # -- the state carried in the optimizers' own state dicts ----------------------------------------------------------
    def _restore(self, state: Mapping[str, Any] | None) -> bool:
        """Continue from ``state`` when given, else from what each optimizer's state dict carried; the carried states
        are taken out of the optimizers either way (an explicit state wins: a checkpoint holding both, as the
        Trainer's does, applies one)."""
        waiting = [carried.take(pipeline.optimizer) for pipeline in self._pipelines]
        if state is not None:
            self.load_state_dict(dict(state))
            resumed, source = self._pipelines, "the saved monitor state"
        else:
            resumed = [pipeline for pipeline, part in zip(self._pipelines, waiting)
                       if part is not None and self._continue_carried(pipeline, part)]
            source = "the state carried in the optimizer's state dict"
        if resumed:
            info(f"[lightning_stale] resuming from {source}: "
                 + ", ".join(f"{type(p.optimizer).__name__} at optimizer step {p.steps}" for p in resumed))
        return bool(resumed)

    def _continue_carried(self, pipeline: OptimizerPipeline, state: dict[str, Any]) -> bool:
        """Continue ``pipeline`` from the state its optimizer's state dict carried; one that cannot be read is
        reported once and monitoring goes on from where it is (a checkpoint never stops a run)."""
        try:
            self._load(upgrade(state), [pipeline])
        except Exception as error:
            self._notices.warn_once(
                f"carried:{pipeline.engine.prefix}",
                f"lightning_stale: the monitor state carried in the state dict of {type(pipeline.optimizer).__name__} "
                f"could not be used ({type(error).__name__}: {error}); monitoring goes on without it")
            return False
        return True

    def _carry(self, pipeline: OptimizerPipeline, state_dict: dict[str, Any]) -> None:
        """torch's state-dict post-hook: ``optimizer.state_dict()`` carries this optimizer's part of the monitor."""
        try:
            carried.put(state_dict, self._state([pipeline]))
        except Exception as error:  # saving a checkpoint must not fail because of the monitor
            self._notices.warn_once(
                f"carry:{pipeline.engine.prefix}",
                f"lightning_stale: the state dict of {type(pipeline.optimizer).__name__} does not carry the monitor's "
                f"state ({type(error).__name__}: {error}); save StaleStateMonitor.state_dict() to resume it",
                StaleStateInternalWarning)

    def _take_waiting(self, index: int) -> None:
        """The first pre-step hook: continue from a state that a checkpoint loaded into the optimizer since the last
        step (one dict look-up when there is none)."""
        pipeline = self._pipelines[index]
        if carried.waiting(pipeline.optimizer):
            self._continue_carried(pipeline, carried.take(pipeline.optimizer) or {})

    # -- attaching and the error shield ------------------------------------------------------------------------------
    def _attach(self, index: int, source: object, coverage_steps: int, steps_taken: int) -> OptimizerPipeline:
        adapter = adapters.adapter_for(source, strict=self.options.strict)
        optimizer = adapter.optimizer
        # Registered before the pipeline's write-back registers its own: a loaded state is taken before any of them.
        self._handles.append(optimizer.register_step_pre_hook(lambda *_: self._take_waiting(index)))
        pipeline = OptimizerPipeline(adapter, index, self.options, self._reduce, self._names,
                                     self._notices.warn_once, self._listeners, coverage_steps, steps_taken)
        self._handles.append(optimizer.register_step_pre_hook(lambda *_: self._shielded(pipeline.before_step,
                                                                                        pipeline)))
        self._handles.append(optimizer.register_step_post_hook(lambda *_: self._shielded(pipeline.after_step,
                                                                                         pipeline)))
        self._handles.append(optimizer.register_load_state_dict_post_hook(lambda *_: pipeline.engine.invalidate()))
        self._handles.append(optimizer.register_state_dict_post_hook(lambda _, state_dict: self._carry(pipeline,
                                                                                                      state_dict)))
        return pipeline

    def _pipeline_of(self, optimizer: object) -> OptimizerPipeline | None:
        groups = getattr(optimizer, "param_groups", None)
        return next((pipeline for pipeline in self._pipelines
                     if groups is not None and pipeline.optimizer.param_groups is groups), None)

    def _shielded(self, hook: Callable[[], None], pipeline: OptimizerPipeline) -> None:
        try:
            hook()
        except ListenerError:  # the user's own code failed: it reaches the user like any callback error
            raise
        except Exception as error:  # the monitor must never stop a training run
            pipeline.engine.discard()
            self._notices.warn_once(
                f"{type(error).__name__}: {error}",
                f"lightning_stale skipped a measurement after an unexpected error ({type(error).__name__}: {error}); "
                "training continues. Please report this with your optimizer and model.", StaleStateInternalWarning)
