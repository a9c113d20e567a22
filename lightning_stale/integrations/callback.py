"""StaleStateCallback: the Lightning Trainer front-end of :class:`~lightning_stale.monitor.StaleStateMonitor`.

At ``on_train_start`` it attaches a monitor to the Trainer's optimizers (sums across ranks through the strategy),
logs the monitor's row through the LightningModule logging path at the Trainer's ``log_every_n_steps`` (so
``ModelCheckpoint``/``EarlyStopping`` can monitor ``stale/v/frac``), and saves the monitor's state in checkpoints (as
its callback state; each optimizer's state dict carries its part too, and the callback state wins on resume).

Constructed explicitly, it refuses at setup or fit start what it cannot watch (an unknown optimizer unless
``strict=False``, no optimizer, an unsupported strategy) with a message naming what to use. Created by the
``LIGHTNING_STALE`` entry point, it says so in one warning line instead and the run trains on without it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_stale import _compat
from lightning_stale._compat import rank_zero_info
from lightning_stale.act.interventions import ResetEvent, ResetListener
from lightning_stale.adapters import has_adapter, inner_optimizer
from lightning_stale.decide.lr_outlook import UNKNOWN_LAST_STEP
from lightning_stale.decide.policies import ResetPolicy
from lightning_stale.decide.remedies import Remedy
from lightning_stale.integrations.factory import decline
from lightning_stale.monitor import metrics
from lightning_stale.monitor.monitor import StaleStateMonitor
from lightning_stale.monitor.options import MonitorOptions
from lightning_stale.monitor.window import StaleStateMetric
from lightning_stale.vocab import COMPENSATION_KEY


class StaleStateCallback(Callback):
    """Measure how stale each stored optimizer moment is, log it, and optionally reset moments.

    The arguments are the fields of :class:`~lightning_stale.MonitorOptions`; in sample mode every parameter
    is measured at least once per ``log_every_n_steps``.
    """

    def __init__(
        self,
        reset: str | ResetPolicy | None = None,
        every: int | None = None,
        s0: float | None = None,
        min_interval: int | None = None,
        moments: Sequence[str] | None = None,
        track: Literal["sample", "exact"] = "sample",
        sample_size: int = 512,
        params_per_step: int = 4,
        track_every: int = 1,
        log_per_param: bool = False,
        log_key_prefix: str = metrics.DEFAULT_PREFIX,
        strict: bool = True,
        seed: int = 0,
        underflow_guard: bool = False,
        warmup_steps: int = 0,
        v_reset: Literal["bounded", "exact-unbounded"] = "bounded",
        remedy: Literal["auto"] | Remedy | None = None,
        drift_band: float | None = None,
        weights: Literal["off", "stochastic", "compensated", "stochastic+moments", "compensated+moments"] | None = None,
        policy_args: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.options = MonitorOptions(
            reset=reset, every=every, s0=s0, min_interval=min_interval, moments=moments, track=track,
            sample_size=sample_size, params_per_step=params_per_step, track_every=track_every,
            log_per_param=log_per_param, log_key_prefix=log_key_prefix, strict=strict, seed=seed,
            underflow_guard=underflow_guard, warmup_steps=warmup_steps, v_reset=v_reset, remedy=remedy,
            drift_band=drift_band, weights=weights, policy_args=policy_args,
        )
        self.policy = self.options.policy
        self.from_environment = False  # created by the LIGHTNING_STALE entry point (an explicit callback wins)
        self.monitor: StaleStateMonitor | None = None
        self._listeners: list[ResetListener] = []
        self._pending_state: dict[str, Any] | None = None
        self._trainer: Trainer | None = None
        self._disabled = False

    # -- public extension points ------------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        if self.from_environment:
            return self._generate_state_key(prefix=self.options.log_key_prefix, source="LIGHTNING_STALE")
        return self._generate_state_key(prefix=self.options.log_key_prefix)

    @property
    def reset_events(self) -> int:
        """Resets applied in the current (or last) fit."""
        return self.monitor.reset_events if self.monitor is not None else 0

    def add_reset_listener(self, listener: ResetListener) -> None:
        """Call ``listener(event)`` with a :class:`ResetEvent` after every reset (e.g. to re-warm a learning rate)."""
        self._listeners.append(listener)
        if self.monitor is not None:
            self.monitor.add_reset_listener(listener)

    def on_reset(self, trainer: Trainer, event: ResetEvent) -> None:
        """Hook called after every reset (``event.step``, ``event.optimizer``, ``event.slots``); override to react."""

    def reset_periods(self) -> dict[str, int | None]:
        """The reset period chosen for each parameter (by parameter name), once its state exists."""
        return self.monitor.reset_periods() if self.monitor is not None else {}

    @property
    def metric(self) -> StaleStateMetric | None:
        """The window as a torchmetrics Metric (:attr:`StaleStateMonitor.metric`; None before the fit starts)."""
        return self.monitor.metric if self.monitor is not None else None

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` across the Trainer's processes (every rank logs at the same steps)."""
        trainer = self._trainer
        reduced = trainer.strategy.reduce(tensor.to(trainer.strategy.root_device), reduce_op="sum")
        return reduced.cpu()

    # -- Lightning hooks ---------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._disabled = self.from_environment and any(
            isinstance(cb, StaleStateCallback) and not cb.from_environment for cb in trainer.callbacks)
        if self._disabled:
            rank_zero_info("[lightning_stale] LIGHTNING_STALE is set, but a StaleStateCallback was also passed to the "
                           "Trainer: the explicit callback is used and the one from the variable does nothing.")
            return
        strategy = type(trainer.strategy).__name__
        if "DeepSpeed" in strategy or "FSDP" in strategy:
            what = (f"StaleStateCallback does not support {strategy}: its optimizer state is flattened into shards the "
                    "monitor cannot map to parameters, and bitsandbytes' 8-bit states break under FSDP1 "
                    "(bitsandbytes#89)")
            todo = "Use ModelParallelStrategy (FSDP2, with torch.optim or torchao optimizers), DDP or a single device"
            if self.from_environment:
                self._disabled = True
                decline(what, f"{todo}.")
                return
            raise MisconfigurationException(f"{what}. {todo}, or remove the callback.")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _require_trainer(trainer)
        self._detach()
        if self._disabled:
            return
        same_trainer, self._trainer = self._trainer is trainer, trainer
        if not self.from_environment:
            self._start(trainer, pl_module, same_trainer)
            return
        optimizers = [o for o in trainer.optimizers if not _compat.is_mock_optimizer(o)]
        unknown = [o for o in optimizers if not has_adapter(o)] if self.options.strict else []
        if not optimizers:
            decline("the Trainer has no optimizer (configure_optimizers returned None)",
                    "Return one from configure_optimizers to monitor it.")
        elif unknown:
            names = ", ".join(f"{type(o).__module__}.{type(o).__qualname__}" for o in map(inner_optimizer, unknown))
            decline(f"{names} is not an optimizer lightning_stale knows", "To watch it, pass "
                    "StaleStateCallback(strict=False) (the generic adapter) to the Trainer, or register an adapter "
                    "(lightning_stale.register_adapter).")
        else:
            try:
                self._start(trainer, pl_module, same_trainer)
            except Exception as error:  # the variable's callback never stops a run
                self._detach()
                self.monitor = None
                decline(f"the monitor could not attach ({type(error).__name__}: {error})",
                        "Pass StaleStateCallback(...) to the Trainer to see the error where it arises.")

    def _start(self, trainer: Trainer, pl_module: LightningModule, same_trainer: bool) -> None:
        """Attach a monitor to the Trainer's optimizers; MisconfigurationException for what it cannot watch."""
        if all(_compat.is_mock_optimizer(o) for o in trainer.optimizers):
            raise MisconfigurationException("StaleStateCallback needs at least one optimizer (none was configured: "
                                            "configure_optimizers returned None)")
        if "ModelParallel" in type(trainer.strategy).__name__:
            _check_sharded_optimizers(trainer.optimizers)
            _load_compensation(trainer, pl_module)
        previous = self.monitor
        try:
            self.monitor = StaleStateMonitor(
                trainer.optimizers, options=self.options, names=pl_module,
                reduce=self.reduce_sum if trainer.world_size > 1 else None,
                coverage_steps=max(1, trainer.log_every_n_steps), state=self._pending_state or None,
            )
        except ValueError as error:  # a saved state this version cannot read
            raise MisconfigurationException(f"StaleStateCallback: {error}") from error
        self._pending_state = None
        for listener in self._listeners:
            self.monitor.add_reset_listener(listener)
        self.monitor.add_reset_listener(lambda event: self.on_reset(trainer, event))
        if not self.monitor.restored and previous is not None and same_trainer:
            self.monitor.continue_from(previous)  # a later fit of the same Trainer goes on (a new one starts over)
        last_step = _last_step(trainer)
        if last_step != UNKNOWN_LAST_STEP:
            self.monitor.plan_steps(last_step)
        for config in trainer.lr_scheduler_configs:  # the weights' fit-start report says when lr falls past them
            if config.interval == "step" and not config.reduce_on_plateau and \
                    self.monitor.watches(config.scheduler.optimizer):
                self.monitor.follow_schedule(config.scheduler, last_step, every=config.frequency)

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        """Only Lightning Fabric calls this hook: this callback is the Trainer's front-end."""
        _require_trainer(None)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Under gradient accumulation the log condition holds on every micro-batch of a logging step; the row is
        # computed once, after the micro-batch whose optimizer step completes the window.
        if self.monitor is None or not _compat.lightning_should_log(trainer) or _compat.lightning_accumulating(trainer):
            return
        row, per_param = self.monitor.compute_parts()
        self.monitor.reset_window()  # each logged row covers the steps since the previous one
        bar = f"{self.options.log_key_prefix}/v/frac"
        for key, value in row.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, prog_bar=key == bar, batch_size=1)
        if per_param:
            step = _compat.lightning_logger_step(trainer)
            for logger in trainer.loggers:
                logger.log_metrics(per_param, step=step)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._detach()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._detach()

    def state_dict(self) -> dict[str, Any]:
        if self.monitor is not None:
            return self.monitor.state_dict()
        return dict(self._pending_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_state = state_dict

    def _detach(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def _last_step(trainer: Trainer) -> int:
    """The fit's last optimizer step: ``max_steps``, else Lightning's estimate (a large number where it has none)."""
    try:
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        return int(total) if math.isfinite(total) else UNKNOWN_LAST_STEP
    except Exception:  # no estimate (an unsized loader): the report's time budget bounds the look-ahead
        return UNKNOWN_LAST_STEP


def _require_trainer(trainer: object) -> None:
    """A clear error where the Trainer callback is given to Lightning Fabric (which has no ``optimizers``)."""
    if not isinstance(trainer, Trainer):
        raise MisconfigurationException(
            "StaleStateCallback is the Lightning Trainer's front-end; with Lightning Fabric pass "
            "lightning_stale.fabric.StaleStateFabricCallback(...) to Fabric(callbacks=...) instead")


def _load_compensation(trainer: Trainer, pl_module: LightningModule) -> None:
    """The weight write-back's compensation buffers of a distributed checkpoint being resumed, loaded into the
    optimizers' state: ModelParallelStrategy loads optimizer state into a template it builds before this callback
    attaches (and the write-back creates them), so the template leaves them out. Every rank loads its shards."""
    path = trainer.ckpt_path
    if not path or not os.path.isdir(path):
        return
    from torch.distributed.checkpoint import FileSystemReader, load

    saved = FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    names = {id(p): name for name, p in pl_module.named_parameters()}
    for index, optimizer in enumerate(trainer.optimizers):
        wanted = {}
        for param in (p for group in optimizer.param_groups for p in group["params"]):
            name = names.get(id(param))
            state = optimizer.state.get(param)
            if name is not None and state and f"optimizer_{index}.state.{name}.{COMPENSATION_KEY}" in saved:
                wanted[name] = {COMPENSATION_KEY: state.setdefault(COMPENSATION_KEY, torch.zeros_like(param))}
        if wanted:
            load({f"optimizer_{index}": {"state": wanted}}, checkpoint_id=os.fspath(path))


def _check_sharded_optimizers(optimizers: list) -> None:
    """Under FSDP2 only optimizers that keep DTensor states (torch.optim, torchao) can be monitored."""
    from lightning_stale.adapters import adapter_for

    for optimizer in optimizers:
        family = adapter_for(optimizer, strict=False).family
        if family in ("bitsandbytes", "lightning_stale"):
            upstream = " (bitsandbytes has no DTensor support: bitsandbytes#1633)" if family == "bitsandbytes" else ""
            raise MisconfigurationException(
                f"StaleStateCallback under ModelParallelStrategy (FSDP2) supports torch.optim and torchao optimizers, "
                f"not {type(optimizer).__name__}{upstream}. Use torch.optim.AdamW (bf16 states with bf16 parameters) "
                "or torchao's AdamW8bit/AdamW4bit/AdamWFp8, or DDP."
            )
