"""The Lightning Fabric front-end (LitGPT and other hand-written Fabric loops) of the monitor.

Fabric calls a callback's ``on_after_optimizer_step(strategy, optimizer)`` from every wrapped optimizer's ``step()``
but has no hook before a step, so this callback watches torch's global optimizer pre-step hook for the first step of
each optimizer its Fabric wraps and attaches a :class:`~lightning_stale.monitor.StaleStateMonitor` there (that step is
measured, and a monitor restored from a checkpoint counts it). It logs one row every ``log_every_n_steps`` optimizer
steps through ``fabric.log_dict`` (sums across processes through the strategy), and resets on the monitor's policy.
Parameters are named as the model that ``fabric.setup`` set up names them (Fabric's ``on_after_setup`` hook).
Pass it as ``Fabric(callbacks=[StaleStateFabricCallback()])``, or set ``LIGHTNING_STALE`` (see
:mod:`lightning_stale.factory`) for zero-code activation.

Checkpoints: every watched optimizer's ``state_dict()`` carries its monitor's state and the logging clock, so a loop
that saves and loads its optimizer (``fabric.save(path, {"model": model, "optimizer": optimizer, ...})``, as LitGPT
does) resumes the callback exactly without naming it. Adding the callback itself to what ``fabric.save`` stores and
``fabric.load`` restores works too (its state then wins over the optimizer's)::

    fabric.save(path, {"model": model, "optimizer": optimizer, "stale": callback})
    fabric.load(path, {"model": model, "optimizer": optimizer, "stale": callback})
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torchmetrics import MetricCollection

from lightning_stale import _compat
from lightning_stale.adapters import has_adapter, unwrap
from lightning_stale.integrations.factory import decline
from lightning_stale.monitor.monitor import StaleStateMonitor
from lightning_stale.monitor.options import MonitorOptions
from lightning_stale.vocab import check_int


class StaleStateFabricCallback:
    """Measure (and optionally reset) stale optimizer states in a Fabric loop.

    Args:
        log_every_n_steps: optimizer steps between two rows logged with ``fabric.log_dict`` (0: never log; read
            :meth:`compute` and call :meth:`reset_window` yourself).
        fabric: the Fabric to log through; found on the call stack when omitted.
        **options: the options of :class:`~lightning_stale.monitor.StaleStateMonitor` (``reset``, ``track``, ...).
    """

    def __init__(self, log_every_n_steps: int = 50, fabric: Any = None, **options: Any) -> None:
        check_int("log_every_n_steps", log_every_n_steps, minimum=0)
        self.options = MonitorOptions.from_arguments(type(self).__name__, options)
        self.log_every_n_steps = log_every_n_steps
        self.monitors: dict[int, StaleStateMonitor] = {}  # by id of the raw optimizer, in order of first step
        # Every monitor's window as a torchmetrics Metric, ``opt<i>`` in order of first step: compute() is one row
        self.metric = MetricCollection({}, compute_groups=False)
        self.steps = 0  # optimizer steps of the first optimizer (the logging clock; kept in its monitor's front_end)
        self.from_environment = False  # created by the LIGHTNING_STALE entry point: it never stops a run
        self._fabric = weakref.ref(fabric) if fabric is not None else None
        self._modules: list[weakref.ref] = []  # the modules fabric.setup set up, in order (parameter names)
        self._pending: list[dict[str, Any]] | None = None
        self._schedules: list[tuple[Any, int, int]] = []  # followed by the monitors attached from now on
        self._foreign: weakref.WeakSet = weakref.WeakSet()  # optimizers stepped outside this callback's Fabric
        self._declined: weakref.WeakSet = weakref.WeakSet()  # optimizers the entry point's callback does not watch
        _watch_first_steps(self)

    @property
    def fabric(self) -> Any:
        return self._fabric() if self._fabric is not None else None

    def on_after_setup(self, fabric: Any, module: Any) -> None:
        """Fabric's hook after ``fabric.setup(module, ...)``: the Fabric to log through and a model to name parameters
        by."""
        if self._fabric is None or self._fabric() is None:
            self._fabric = weakref.ref(fabric)
        self._modules.append(weakref.ref(module))

    def on_after_optimizer_step(self, strategy: Any, optimizer: torch.optim.Optimizer) -> None:
        raw = unwrap(optimizer)
        monitor = self.monitors.get(id(raw))
        if monitor is None:  # not seen before its first step (Fabric's wrapper was not found): this step is missed
            if raw in self._declined:
                return
            monitor = self._attach(strategy, raw, steps_taken=1)
            if monitor is None:
                return
        if monitor is not next(iter(self.monitors.values())):
            return
        self.steps = monitor.front_end["steps"] = int(monitor.front_end.get("steps", self.steps)) + 1
        if self.log_every_n_steps and self.steps % self.log_every_n_steps == 0:
            metrics = self.compute()
            self.reset_window()  # each logged row covers the steps since the previous one
            fabric = self.fabric or self._find(strategy)
            if fabric is not None and metrics:
                fabric.log_dict(metrics, step=self.steps)

    def follow_schedule(self, scheduler: Any, last_step: int, every: int = 1) -> None:
        """Let the fit-start report of bf16 weights say from which step ``scheduler`` keeps the lr below where they
        stop moving (:meth:`StaleStateMonitor.follow_schedule`); call it before the first step of its optimizer."""
        check_int("last_step", last_step, minimum=0)
        check_int("every", every)
        self._schedules.append((scheduler, last_step, every))
        for monitor in self.monitors.values():
            self._follow(monitor, [(scheduler, last_step, every)])

    def compute(self) -> dict[str, float]:
        """One row for every optimizer (the second and later ones under ``<prefix>/opt<i>/``) of the steps since the
        last :meth:`reset_window`: :attr:`metric`'s ``compute()``. A collective, and a readout (calling it again gives
        the same row)."""
        return self.metric.compute()

    def reset_window(self) -> None:
        """Start a new window for every optimizer: the next :meth:`compute` covers only the steps after this call."""
        self.metric.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "monitors": [m.state_dict() for m in self.monitors.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; monitors pick up their part when their optimizer first steps."""
        self.steps = int(state.get("steps", 0))
        self._pending = list(state.get("monitors", []))

    def _before_first_step(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's global pre-step hook: attach to an optimizer of this callback's Fabric before its first step."""
        if id(optimizer) in self.monitors or optimizer in self._foreign or optimizer in self._declined:
            return
        strategy = _compat.fabric_strategy_stepping(optimizer, self)
        if strategy is None:
            self._foreign.add(optimizer)
        else:  # the monitor's own hooks, registered now, run from this very step on
            self._attach(strategy, optimizer, steps_taken=0)

    def _attach(self, strategy: Any, optimizer: torch.optim.Optimizer, steps_taken: int) -> StaleStateMonitor | None:
        """A monitor for ``optimizer``; None (and one line) where the entry point's callback cannot watch it."""
        if self.from_environment and self.options.strict and not has_adapter(optimizer):
            self._declined.add(optimizer)
            name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
            decline(f"{name} is not an optimizer lightning_stale knows", "To watch it, pass "
                    "StaleStateFabricCallback(strict=False) (the generic adapter) or register an adapter "
                    "(lightning_stale.register_adapter)")
            return None
        reduce = functools.partial(_all_reduce_sum, strategy) if getattr(strategy, "world_size", 1) > 1 else None
        fabric = self.fabric or self._find(strategy)
        try:
            monitor = StaleStateMonitor(optimizer, options=self.options, reduce=reduce, steps_taken=steps_taken,
                                        coverage_steps=max(1, self.log_every_n_steps or 50),
                                        names=self._model_of(optimizer, None if fabric else strategy),
                                        state=self._pending.pop(0) if self._pending else None)
        except Exception as error:
            if not self.from_environment:
                raise
            self._declined.add(optimizer)
            decline(f"it cannot watch {type(optimizer).__name__} ({type(error).__name__}: {error})",
                    "Pass StaleStateFabricCallback(...) to Fabric(callbacks=...) to see the error where it arises")
            return None
        if not self.monitors and "steps" in monitor.front_end:  # a resumed first optimizer: its clock goes on
            self.steps = int(monitor.front_end["steps"])
        self._follow(monitor, self._schedules)
        index = len(self.monitors)
        if index:  # the later optimizers' keys: <prefix>/opt<i>/...
            monitor.metric.prefix = f"{self.options.log_key_prefix}/opt{index}"
        self.metric.add_metrics({f"opt{index}": monitor.metric})
        self.monitors[id(optimizer)] = monitor
        return monitor

    def _model_of(self, optimizer: torch.optim.Optimizer, strategy: Any) -> Any:
        """The set-up module holding most of ``optimizer``'s parameters (the first on a tie), else the strategy's
        model where there is no Fabric, else None (parameters are then named ``opt0.<i>``)."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        best, most = None, 0
        for ref in self._modules:
            module = ref()
            held = sum(id(p) in params for p in module.parameters()) if module is not None else 0
            if held > most:
                best, most = module, held
        return best if best is not None else getattr(strategy, "model", None)

    @staticmethod
    def _follow(monitor: StaleStateMonitor, schedules: list[tuple[Any, int, int]]) -> None:
        """Let ``monitor`` follow those of ``schedules`` that step its optimizer."""
        for scheduler, last_step, every in schedules:
            if monitor.watches(getattr(scheduler, "optimizer", None)):
                monitor.follow_schedule(scheduler, last_step, every)

    def _find(self, strategy: Any) -> Any:
        fabric = _compat.find_fabric(strategy)
        if fabric is not None:
            self._fabric = weakref.ref(fabric)
        return fabric

    def teardown(self) -> None:
        """Detach from every optimizer."""
        _WATCHING.discard(self)
        for monitor in self.monitors.values():
            monitor.close()


# The callbacks that attach to their Fabric's optimizers before their first step, held weakly, and torch's global
# pre-step hook that tells them of every step: one hook for the process, registered once and never removed (a hook
# removed while torch runs the hooks of a step, as a callback's finalizer could be, ends that step with an error).
_WATCHING: weakref.WeakSet = weakref.WeakSet()
_HOOK: list[Any] = []


def _watch_first_steps(callback: StaleStateFabricCallback) -> None:
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_any_step))
    _WATCHING.add(callback)


def _before_any_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global pre-step hook: each watching callback attaches to ``optimizer`` if it is its Fabric's."""
    for callback in list(_WATCHING):
        callback._before_first_step(optimizer)


def _all_reduce_sum(strategy: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` across Fabric's processes on the strategy's device (as its collectives need); back on the host."""
    return strategy.all_reduce(tensor.to(strategy.root_device), reduce_op="sum").cpu()
