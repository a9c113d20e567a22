"""The Hugging Face Trainer front-end (``pip install lightning-stale[hf]``) of the monitor.

A ``transformers.TrainerCallback`` that attaches a :class:`~lightning_stale.monitor.StaleStateMonitor` to the
Trainer's optimizer at ``on_train_begin`` (accelerate's ``AcceleratedOptimizer`` wrapper is unwrapped), and adds the
monitor's row to every training log row in ``on_log``: into ``state.log_history`` and into the dict the reporting
callbacks (TensorBoard, W&B, ...) receive, when it runs before them. Hugging Face places user callbacks after its
reporters, so use :func:`add_stale_callback` (it puts the callback first) to reach them::

    trainer = Trainer(model=model, args=TrainingArguments(..., optim="adamw_bnb_8bit"), train_dataset=data)
    add_stale_callback(trainer, reset="theory")
    trainer.train()                                   # or trainer.train(resume_from_checkpoint=...)

The weight write-back's compensation buffers live in the optimizer's state, so ``optimizer.pt`` carries them, and
the monitor's state travels in it too (the callback state below wins where both are saved).

Checkpoints: the callback is an ``ExportableState``, so every checkpoint's ``trainer_state.json`` holds the monitor's
state (``stateful_callbacks``), and ``train(resume_from_checkpoint=...)`` continues its reset schedule, ages, counters
and remedy choices before the first resumed step. It restores itself from there; keep transformers'
``restore_callback_states_from_checkpoint`` at its default (False), which would rebuild the callback from its
arguments (JSON values only) and move it behind the reporters.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import TrainerCallback

from lightning_stale._compat import hf_exportable_state
from lightning_stale.decide.lr_outlook import UNKNOWN_LAST_STEP
from lightning_stale.monitor.monitor import StaleStateMonitor
from lightning_stale.monitor.options import MonitorOptions
from lightning_stale.monitor.window import StaleStateMetric
from lightning_stale.state import from_json, to_json


class StaleStateHFCallback(TrainerCallback, hf_exportable_state()):
    """Measure (and optionally reset) stale optimizer states in a Hugging Face Trainer; the options are those of
    :class:`~lightning_stale.monitor.StaleStateMonitor`."""

    def __init__(self, **options: Any) -> None:
        self.options = MonitorOptions.from_arguments(type(self).__name__, options)
        self.arguments = options
        self.monitor: StaleStateMonitor | None = None
        self.saved_state: dict[str, Any] | None = None  # a checkpoint's monitor state (JSON form) to start from

    @property
    def metric(self) -> StaleStateMetric | None:
        """The window as a torchmetrics Metric (:attr:`StaleStateMonitor.metric`; None before training begins)."""
        return self.monitor.metric if self.monitor is not None else None

    def state(self) -> dict[str, Any]:
        """What transformers writes into ``trainer_state.json`` at each checkpoint: the JSON-valued arguments and the
        monitor's state."""
        saved = to_json(self.monitor.state_dict()) if self.monitor is not None else self.saved_state
        return {"args": {k: v for k, v in self.arguments.items() if _is_json(v)}, "attributes": {"saved_state": saved}}

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, model: Any = None,
                       **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
        # The Trainer state is fresh (our state() at its creation: a second train() continues the counts) or, on
        # resume, the checkpoint's; transformers' own restore, if enabled, has set saved_state instead.
        saved = self.saved_state or _saved_attributes(state, type(self).__name__).get("saved_state")
        self.monitor = StaleStateMonitor(optimizer, options=self.options, names=model,
                                         coverage_steps=max(1, int(args.logging_steps)),
                                         state=from_json(saved) if saved else None)
        self.saved_state = None
        if state.max_steps > 0:
            self.monitor.plan_steps(int(state.max_steps))
        scheduler = kwargs.get("lr_scheduler")  # stepped once per optimizer step, to state.max_steps
        scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper, where there is one
        if self.monitor.watches(getattr(scheduler, "optimizer", None)):
            self.monitor.follow_schedule(scheduler, int(state.max_steps) if state.max_steps > 0 else
                                         UNKNOWN_LAST_STEP)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        if self.monitor is None or logs is None or "loss" not in logs:  # training rows only
            return
        metrics = self.monitor.compute()  # a collective under multi-process training: every rank logs here
        self.monitor.reset_window()  # each logged row covers the steps since the previous one
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()


def _saved_attributes(state: Any, name: str) -> dict[str, Any]:
    """Our entry in the Trainer state's ``stateful_callbacks`` (the first, if several were saved)."""
    entry = (getattr(state, "stateful_callbacks", None) or {}).get(name) or {}
    entry = entry[0] if isinstance(entry, list) and entry else entry
    return entry.get("attributes", {}) if isinstance(entry, dict) else {}


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def add_stale_callback(trainer: Any, **options: Any) -> StaleStateHFCallback:
    """Create a :class:`StaleStateHFCallback` and place it first among ``trainer``'s callbacks, so the reporting
    callbacks log its metrics too; returns it."""
    callback = StaleStateHFCallback(**options)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
