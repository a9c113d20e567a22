"""The Hugging Face Trainer front-end (``pip install lightning-stale[hf]``) of the monitor.

A ``transformers.TrainerCallback`` that attaches a :class:`~lightning_stale.monitor.StaleStateMonitor` to the
Trainer's optimizer at ``on_train_begin`` (accelerate's ``AcceleratedOptimizer`` wrapper is unwrapped), and adds the
monitor's row to every training log row in ``on_log``: into ``state.log_history`` and into the dict the reporting
callbacks (TensorBoard, W&B, ...) receive, when it runs before them. Hugging Face places user callbacks after its
reporters, so use :func:`add_stale_callback` (it puts the callback first) to reach them::

    trainer = Trainer(model=model, args=TrainingArguments(..., optim="adamw_bnb_8bit"), train_dataset=data)
    add_stale_callback(trainer, reset="theory")
    trainer.train()
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from lightning_stale.monitor import StaleStateMonitor
from lightning_stale.options import MonitorOptions


class StaleStateHFCallback(TrainerCallback):
    """Measure (and optionally reset) stale optimizer states in a Hugging Face Trainer; the options are those of
    :class:`~lightning_stale.monitor.StaleStateMonitor`."""

    def __init__(self, **options: Any) -> None:
        self.options = MonitorOptions.from_arguments(type(self).__name__, options)
        self.monitor: StaleStateMonitor | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, model: Any = None,
                       **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
        self.monitor = StaleStateMonitor(optimizer, options=self.options, names=model,
                                         coverage_steps=max(1, int(args.logging_steps)))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        if self.monitor is None or logs is None or "loss" not in logs:  # training rows only
            return
        metrics = self.monitor.compute()  # a collective under multi-process training: every rank logs here
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()


def add_stale_callback(trainer: Any, **options: Any) -> StaleStateHFCallback:
    """Create a :class:`StaleStateHFCallback` and place it first among ``trainer``'s callbacks, so the reporting
    callbacks log its metrics too; returns it."""
    callback = StaleStateHFCallback(**options)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
