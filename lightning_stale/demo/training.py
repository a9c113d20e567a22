"""Train one demo configuration with the stale-state callback attached and collect what it measured.

Shared by ``lightning-stale demo`` and the benchmarks (``benchmarks/recovery.py``, ``benchmarks/moment_formats.py``):
:func:`train_config` turns a :class:`~lightning_stale.demo.configs.RunConfig` into a :class:`RunResult`.
"""

from __future__ import annotations

import contextlib
import csv
import getpass
import importlib.util
import logging
import math
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_stale.decide.remedies import GUARD, REMEDIES, RESET, STOCHASTIC
from lightning_stale.demo.configs import DemoSettings, RunConfig
from lightning_stale.demo.data import ByteCorpus, corpus_source, load_corpus
from lightning_stale.demo.model import LanguageModel
from lightning_stale.monitor import metrics
from lightning_stale.vocab import COMPENSATION_KEY, WEIGHT

STALL_KEYS = {  # the callback's logged keys (default prefix) that the demo tabulates and plots
    "v_frac": metrics.key(metrics.DEFAULT_PREFIX, "v", metrics.FRAC),
    "v_predicted": metrics.key(metrics.DEFAULT_PREFIX, "v", metrics.PREDICTED),
    "v_drift": metrics.key(metrics.DEFAULT_PREFIX, "v", metrics.DRIFT),
    "v_underflow": metrics.key(metrics.DEFAULT_PREFIX, "v", metrics.UNDERFLOW_KEY),
    "m_frac": metrics.key(metrics.DEFAULT_PREFIX, "m", metrics.FRAC),
    "w_frac": metrics.key(metrics.DEFAULT_PREFIX, WEIGHT, metrics.FRAC),
    "w_predicted": metrics.key(metrics.DEFAULT_PREFIX, WEIGHT, metrics.PREDICTED),
    "remedy_weights": metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, metrics.WEIGHTS),
    "resets": metrics.key(metrics.DEFAULT_PREFIX, metrics.RESETS),
    "remedy_guard": metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, REMEDIES[GUARD]),
    "remedy_stochastic": metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, REMEDIES[STOCHASTIC]),
    "remedy_reset": metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, REMEDIES[RESET]),
}
LR_KEY = "lr"  # the learning rate of the first param group, logged every step (the curve the weight stall follows)


@dataclass
class RunResult:
    """What one training run produced: final validation loss, state memory, stall metrics and their curves."""

    name: str
    seed: int
    val_loss: float
    state_bytes_per_param: float
    seconds: float
    log_dir: str
    v_frac: float = math.nan
    v_predicted: float = math.nan
    v_drift: float = math.nan
    v_underflow: float = math.nan
    resets: float = math.nan
    remedy_guard: float = math.nan
    remedy_stochastic: float = math.nan
    remedy_reset: float = math.nan
    w_frac: float = math.nan
    w_predicted: float = math.nan
    remedy_weights: float = math.nan
    weight_buffer_bytes_per_param: float = 0.0  # the write-back's compensation buffers at the end of the run
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's own state tensors (each storage counted once, e.g. a shared quantization map),
    the weight write-back's compensation buffers left out (counted as ``weight_buffer_bytes_per_param``)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != COMPENSATION_KEY and torch.is_tensor(value) and value.numel() and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total


def read_metric_curves(metrics_csv: Path) -> dict[str, list[tuple[int, float]]]:
    """Every column of a CSVLogger ``metrics.csv`` as a list of (step, value), empty cells skipped."""
    curves: dict[str, list[tuple[int, float]]] = {}
    with metrics_csv.open(newline="") as handle:
        for row in csv.DictReader(handle):
            step = int(row["step"])
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    curves.setdefault(key, []).append((step, float(value)))
    return curves


@torch.no_grad()
def evaluate(model: LanguageModel, loader: torch.utils.data.DataLoader) -> float:
    """Mean next-byte cross-entropy over the loader's batches."""
    model.eval()
    device = next(model.parameters()).device
    losses = [model.loss([t.to(device) for t in batch]).item() for batch in loader]
    model.train()
    return sum(losses) / len(losses)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Hide Lightning's per-run info lines and the few-workers warning, which repeat for every configuration."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*is smaller than the logging interval.*")
            yield
    finally:
        logger.setLevel(level)


def _progress_bar(title: str):  # noqa: ANN202 (a Lightning callback)
    from lightning.pytorch.callbacks import TQDMProgressBar

    class TitledBar(TQDMProgressBar):
        """Lightning's bar, labelled with the configuration name instead of the epoch number."""

        def on_train_epoch_start(self, trainer, *args) -> None:  # noqa: ANN001
            super().on_train_epoch_start(trainer, *args)
            self.train_progress_bar.set_description(title)

    return TitledBar()


def train_config(config: RunConfig, settings: DemoSettings, corpus: ByteCorpus, log_root: Path,
                 extra_callbacks: Sequence[object] = ()) -> RunResult:
    """Train one configuration from the settings' seed, with the stale-state callback attached, and collect results.

    The callback only monitors when ``config.reset`` is None, so stall metrics exist for every configuration.
    ``extra_callbacks`` (Lightning callbacks) join it, e.g. a benchmark's experimental intervention.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_stale import StaleStateCallback

    pl.seed_everything(settings.seed, verbose=False)
    model = LanguageModel(settings.model, config.optimizer_spec(settings), total_steps=settings.steps)
    version = f"seed{settings.seed}"
    shutil.rmtree(Path(log_root) / config.name / version, ignore_errors=True)  # a rerun replaces its old logs
    loggers = [CSVLogger(log_root, name=config.name, version=version)]
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        loggers.append(TensorBoardLogger(log_root, name=config.name, version=version))
    # strict=False: the weight write-back's peer torch-optimi has no adapter; the monitor reads it generically
    callbacks = [StaleStateCallback(reset=config.reset, every=config.every, moments=config.moments,
                                    underflow_guard=config.underflow_guard, remedy=config.remedy,
                                    weights=config.weights, strict=False), LearningRateMonitor("step"),
                 *extra_callbacks]
    if settings.progress_bar:
        callbacks.append(_progress_bar(config.name))
    train_loader = corpus.train_loader(settings.steps, settings.batch_size, settings.seed)
    val_loader = corpus.val_loader(settings.val_batches, settings.batch_size, settings.seed)
    with quiet_lightning():
        trainer = pl.Trainer(
            accelerator=settings.accelerator,
            devices=1,
            precision=config.precision,
            max_steps=settings.steps,
            logger=loggers,
            callbacks=callbacks,
            log_every_n_steps=settings.log_every,
            gradient_clip_val=1.0,
            val_check_interval=max(1, settings.steps // settings.evaluations),
            num_sanity_val_steps=0,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=settings.progress_bar,
        )
        start = time.perf_counter()
        trainer.fit(model, train_loader, val_loader)
    seconds = time.perf_counter() - start
    val_loss = evaluate(model, val_loader)
    n_params = sum(p.numel() for p in model.parameters())
    curves = read_metric_curves(Path(loggers[0].log_dir) / "metrics.csv")
    for key in [k for k in curves if k.startswith("lr-")][:1]:  # LearningRateMonitor's "lr-<optimizer class>"
        curves[LR_KEY] = curves.pop(key)
    val_curve = curves.setdefault("val/loss", [])
    if not val_curve or val_curve[-1][0] < settings.steps:
        val_curve.append((settings.steps, val_loss))
    result = RunResult(
        name=config.name,
        seed=settings.seed,
        val_loss=val_loss,
        state_bytes_per_param=optimizer_state_bytes(trainer.optimizers[0]) / n_params,
        seconds=seconds,
        log_dir=loggers[0].log_dir,
        weight_buffer_bytes_per_param=callbacks[0].monitor.weight_buffer_bytes() / n_params,
        curves=curves,
    )
    for attr in ("v_frac", "v_predicted", "v_underflow", "w_frac", "w_predicted"):
        points = curves.get(STALL_KEYS[attr], [])
        if points:
            setattr(result, attr, sum(v for _, v in points) / len(points))
    for attr in ("v_drift", "resets", "remedy_guard", "remedy_stochastic", "remedy_reset", "remedy_weights"):
        points = curves.get(STALL_KEYS[attr], [])
        if points:
            setattr(result, attr, points[-1][1])
    return result


def separate_compile_cache() -> str | None:
    """Give runs under ``ATEN_CPU_CAPABILITY`` their own ``torch.compile`` kernel cache; returns the folder set, if any.

    Inductor's on-disk cache (``<tmp>/torchinductor_<user>``) does not tell torch's CPU kernel sets apart: after a run
    under ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 machine, a run under the default kernels reuses the kernels
    compiled for AVX2 and the reverse, and the weight write-back's fused pass then computes wrong weights or corrupts
    the heap (torch 2.13). A folder per kernel set keeps the two apart. A ``TORCHINDUCTOR_CACHE_DIR`` other than
    torch's default (which torch writes into the environment once it has looked it up) is left alone. Call it before
    anything compiles (worker processes inherit it)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    default = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser()))
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not capability or (current and os.path.abspath(current) != os.path.abspath(default)):
        return None
    folder = f"{default}_{capability}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def prepare_corpus(settings: DemoSettings) -> ByteCorpus:
    """Load and split the settings' corpus; FileNotFoundError / ValueError for a missing path or too little text."""
    return ByteCorpus(load_corpus(settings.data, settings.max_bytes), settings.model.context,
                      source=corpus_source(settings.data))


__all__ = [
    "LR_KEY",
    "STALL_KEYS",
    "RunResult",
    "evaluate",
    "optimizer_state_bytes",
    "prepare_corpus",
    "quiet_lightning",
    "read_metric_curves",
    "separate_compile_cache",
    "train_config",
]
