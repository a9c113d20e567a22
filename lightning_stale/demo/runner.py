"""Train the demo configurations on identical data, then tabulate and plot what the stale-state callback measured.

Shared by ``lightning-stale demo`` and ``benchmarks/recovery.py``: a configuration is an optimizer (state format and
rounding) plus an optional reset policy, and :func:`train_config` turns one into a :class:`RunResult`.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import logging
import math
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from lightning_stale import metrics
from lightning_stale.demo.data import DEFAULT_MAX_BYTES, ByteCorpus, load_corpus
from lightning_stale.demo.model import DecoderConfig, LanguageModel, OptimizerSpec
from lightning_stale.remedies import GUARD, REMEDIES, RESET, STOCHASTIC
from lightning_stale.vocab import check_int

STALL_KEYS = {  # the callback's logged keys (default prefix) that the demo tabulates and plots
    "v_frac": metrics.key(metrics.DEFAULT_PREFIX, "v", metrics.FRAC),
    "v_predicted": metrics.key(metrics.DEFAULT_PREFIX, "v", metrics.PREDICTED),
    "v_drift": metrics.key(metrics.DEFAULT_PREFIX, "v", metrics.DRIFT),
    "v_underflow": metrics.key(metrics.DEFAULT_PREFIX, "v", metrics.UNDERFLOW_KEY),
    "m_frac": metrics.key(metrics.DEFAULT_PREFIX, "m", metrics.FRAC),
    "resets": metrics.key(metrics.DEFAULT_PREFIX, metrics.RESETS),
    "remedy_guard": metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, REMEDIES[GUARD]),
    "remedy_stochastic": metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, REMEDIES[STOCHASTIC]),
    "remedy_reset": metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, REMEDIES[RESET]),
}
FP32_CONTROL_PERIOD = 300  # the paper's fp8 reset period
MIN_GAP_FOR_SHARE = 0.005  # below this gap (about the seed noise at CPU scale) a "share recovered" means nothing


@dataclass(frozen=True)
class RunConfig:
    """One demo configuration: how the optimizer stores its states and what remedy the callback applies.

    ``reset``, ``every``, ``underflow_guard`` and ``remedy`` are passed to :class:`~lightning_stale.StaleStateCallback`;
    ``baseline`` names the configuration without a remedy (nearest rounding) that a variant is compared with.
    """

    name: str
    kind: str
    state_format: str = "fp32"
    rounding: str = "nearest"
    reset: str | None = None
    every: int | None = None
    baseline: str | None = None
    description: str = ""
    underflow_guard: bool = False
    remedy: str | None = None

    def optimizer_spec(self, settings: DemoSettings) -> OptimizerSpec:
        return OptimizerSpec(
            kind=self.kind,
            state_format=self.state_format,
            rounding=self.rounding,
            lr=settings.lr,
            betas=(0.9, settings.beta2),
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            min_quantized_size=settings.min_quantized_size,
        )


STORAGES = {  # name: (optimizer kind, state format, words)
    "fp32": ("adamw", "fp32", "torch AdamW, fp32 states"),
    "bnb8bit": ("bnb_adamw8bit", "fp32", "bitsandbytes AdamW8bit (block-wise 8-bit states)"),
    "bf16": ("quantized", "bf16", "QuantizedAdamW, bf16 states"),
    "fp8": ("quantized", "fp8_e4m3", "QuantizedAdamW, fp8 E4M3 states (per-tensor scale)"),
    "fp4": ("quantized", "fp4", "QuantizedAdamW, fp4 states (block 128)"),
    "int8": ("quantized", "int8_dynamic", "QuantizedAdamW, int8 dynamic-map states"),
}
REMEDY_SUFFIXES = {  # name suffix: (StaleStateCallback arguments, words)
    "": ({}, ""),
    "+reset": ({"reset": "theory"}, ", theory-period resets"),
    "+adaptive": ({"reset": "adaptive"}, ", adaptive resets"),
    "+periodic": ({"reset": "periodic", "every": FP32_CONTROL_PERIOD}, f", resets every {FP32_CONTROL_PERIOD} steps"),
    "+drift": ({"reset": "drift"}, ", drift-band resets"),
    "+guard": ({"underflow_guard": True}, ", underflow guard"),
    "+auto": ({"remedy": "auto"}, ", automatic remedy"),
}


def _build_configs() -> dict[str, RunConfig]:
    """Name every (storage, rounding, remedy) combination: ``<storage>[-sr][<remedy suffix>]``."""
    configs = {}
    for storage, (kind, state_format, words) in STORAGES.items():
        if storage == "fp32":
            configs[storage] = RunConfig(storage, kind, description=words)
            continue
        roundings = ["nearest"] if kind != "quantized" else ["nearest", "stochastic"]
        for rounding in roundings:
            for suffix, (arguments, remedy_words) in REMEDY_SUFFIXES.items():
                name = storage + ("-sr" if rounding == "stochastic" else "") + suffix
                text = words + (", stochastic rounding" if rounding == "stochastic" else "") + remedy_words
                baseline = None if name == storage else storage
                configs[name] = RunConfig(name, kind, state_format, rounding, baseline=baseline, description=text,
                                          **arguments)
    # fp32 states never stall, so the theory gives them no period: the control resets at the fp8 period instead,
    # as the paper's fp32 control used the bf16 period.
    configs["fp32+reset"] = RunConfig(
        "fp32+reset", "adamw", reset="periodic", every=FP32_CONTROL_PERIOD, baseline="fp32",
        description=f"torch AdamW, fp32 states, periodic resets every {FP32_CONTROL_PERIOD} steps (control)",
    )
    return configs


CONFIGS: dict[str, RunConfig] = _build_configs()
DEFAULT_CONFIGS = ("fp32", "fp8", "fp8+reset", "fp8+auto")


def resolve_configs(names: str | Sequence[str]) -> list[RunConfig]:
    """Look up configurations by name (a comma-separated string or a list); unknown names raise ValueError."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError("configs must name at least one configuration")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configs {unknown}; available: {', '.join(CONFIGS)}")
    return [CONFIGS[n] for n in dict.fromkeys(names)]


@dataclass(frozen=True)
class DemoSettings:
    """Everything shared by the runs of one comparison (model, data, schedule, logging)."""

    steps: int = 400
    seed: int = 0
    batch_size: int = 16
    model: DecoderConfig = field(default_factory=DecoderConfig)
    lr: float = 4e-3  # twice fp32's best for the default model: where per-tensor fp8 states lose loss (BENCHMARKS.md)
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.0
    min_quantized_size: int = 128
    evaluations: int = 6
    val_batches: int = 20
    log_every: int = 10
    data: str | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    progress_bar: bool = True
    threads: int | None = 1  # torch threads per run: one is fastest for this model on a busy or 2-core machine

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "evaluations", "val_batches", "log_every", "max_bytes"):
            check_int(name, getattr(self, name))
        if self.threads is not None:
            check_int("threads", self.threads)


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
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (each storage counted once, e.g. a shared quantization map)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.numel() and value.data_ptr() not in seen:
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
    losses = [model._loss(batch).item() for batch in loader]
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
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_stale import StaleStateCallback

    pl.seed_everything(settings.seed, verbose=False)
    model = LanguageModel(settings.model, config.optimizer_spec(settings), total_steps=settings.steps)
    version = f"seed{settings.seed}"
    shutil.rmtree(Path(log_root) / config.name / version, ignore_errors=True)  # a rerun replaces its old logs
    loggers = [CSVLogger(log_root, name=config.name, version=version)]
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        loggers.append(TensorBoardLogger(log_root, name=config.name, version=version))
    callbacks = [StaleStateCallback(reset=config.reset, every=config.every, underflow_guard=config.underflow_guard,
                                    remedy=config.remedy), *extra_callbacks]
    if settings.progress_bar:
        callbacks.append(_progress_bar(config.name))
    train_loader = corpus.train_loader(settings.steps, settings.batch_size, settings.seed)
    val_loader = corpus.val_loader(settings.val_batches, settings.batch_size, settings.seed)
    with quiet_lightning():
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
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
        curves=curves,
    )
    for attr in ("v_frac", "v_predicted", "v_underflow"):
        points = curves.get(STALL_KEYS[attr], [])
        if points:
            setattr(result, attr, sum(v for _, v in points) / len(points))
    for attr in ("v_drift", "resets", "remedy_guard", "remedy_stochastic", "remedy_reset"):
        points = curves.get(STALL_KEYS[attr], [])
        if points:
            setattr(result, attr, points[-1][1])
    return result


def recovered_share(loss: float, baseline_loss: float, reference_loss: float) -> float:
    """Share of the baseline's gap to the reference that ``loss`` closes (1 = fully recovered); NaN without a gap."""
    gap = baseline_loss - reference_loss
    if not gap > MIN_GAP_FOR_SHARE:
        return math.nan
    return (baseline_loss - loss) / gap


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def format_table(results: Sequence[RunResult], reference: str = "fp32") -> str:
    """A plain-text results table; gaps are to ``reference``, shares are of each reset variant's baseline gap."""
    losses = {r.name: r.val_loss for r in results}
    ref = losses.get(reference, math.nan)
    header = ["config", "val loss", f"gap to {reference}", "recovered", "state B/param", "v stall", "v stall pred",
              "v drift", "v underflow", "resets", "auto: guard/SR/reset", "time s"]
    rows = [header]
    for r in results:
        baseline = CONFIGS[r.name].baseline if r.name in CONFIGS else None
        share = math.nan
        if baseline in losses:
            share = recovered_share(r.val_loss, losses[baseline], ref)
        rows.append([
            r.name, _fmt(r.val_loss, ".4f"), _fmt(r.val_loss - ref, "+.4f"), _fmt(100 * share, ".0f") + ("%" if
            not math.isnan(share) else ""), _fmt(r.state_bytes_per_param, ".2f"), _fmt(r.v_frac, ".3f"),
            _fmt(r.v_predicted, ".3f"), _fmt(r.v_drift, ".2f"), _fmt(r.v_underflow, ".4f"), _fmt(r.resets, ".0f"),
            "-" if math.isnan(r.remedy_guard) else
            f"{r.remedy_guard:.0f}/{r.remedy_stochastic:.0f}/{r.remedy_reset:.0f}",
            _fmt(r.seconds, ".0f"),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    notes = [
        f"recovered: (baseline loss - loss) / (baseline gap to {reference}) for a remedy variant, where the baseline "
        f"is the same storage without a remedy and its gap exceeds {MIN_GAP_FOR_SHARE}.",
        "v stall: mean stalled fraction of the second moment over logged steps (measured / theory prediction); "
        "v drift: median stored v over an fp32 shadow of it at the end (1 = no drift); v underflow: mean share of "
        "v elements stored as exactly zero while their gradient was not; auto: parameters the automatic remedy "
        "guards at the end / switched to stochastic rounding / resets it made.",
    ]
    return "\n".join(lines + [""] + notes)


def plot_results(results: Sequence[RunResult], path: Path, title: str = "") -> None:
    """Four panels: validation loss; v stall fraction measured (solid) vs predicted (dashed); v drift; v underflow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    for index, r in enumerate(results):
        color = f"C{index % 10}"
        style = "--" if CONFIGS.get(r.name) and CONFIGS[r.name].baseline else "-"
        for ax, key, kwargs in (
            (axes[0], "val/loss", dict(linestyle=style, marker="o", markersize=3)),
            (axes[1], STALL_KEYS["v_frac"], dict(linestyle="-")),
            (axes[1], STALL_KEYS["v_predicted"], dict(linestyle=":", alpha=0.8)),
            (axes[2], STALL_KEYS["v_drift"], dict(linestyle=style)),
            (axes[3], STALL_KEYS["v_underflow"], dict(linestyle=style)),
        ):
            points = r.curves.get(key, [])
            if points:
                steps, values = zip(*points)
                label = r.name if key != STALL_KEYS["v_predicted"] else None
                ax.plot(steps, values, color=color, label=label, **kwargs)
    axes[0].set(title="validation loss (dashed: with a remedy)", xlabel="step", ylabel="loss")
    axes[1].set(title="v stalled fraction: measured (solid), theory (dotted)", xlabel="step", ylim=(-0.02, 1.02))
    axes[2].set(title="v drift: median stored v / fp32 shadow", xlabel="step")
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    axes[3].set(title="v underflow: stored zero, gradient not", xlabel="step")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prepare_corpus(settings: DemoSettings) -> ByteCorpus:
    """Load and split the settings' corpus; FileNotFoundError / ValueError for a missing path or too little text."""
    return ByteCorpus(load_corpus(settings.data, settings.max_bytes), settings.model.context)


def _train_in_worker(config: RunConfig, settings: DemoSettings, log_root: Path) -> RunResult:
    """One configuration in a worker process (its own corpus and thread count; no progress bar)."""
    warnings.filterwarnings("ignore")
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    return train_config(config, settings, prepare_corpus(settings), log_root)


def run_demo(
    settings: DemoSettings, configs: Sequence[RunConfig], out: Path, corpus: ByteCorpus | None = None,
    workers: int = 1,
) -> list[RunResult]:
    """Train every configuration, then write ``results.json``, ``results.txt`` and ``demo.png`` into ``out``.

    ``workers`` > 1 trains that many configurations at once in separate processes (each with ``settings.threads``
    threads, without progress bars): on a 2-core machine two single-thread runs finish sooner than one after the
    other. Results are identical either way."""
    check_int("workers", workers)
    corpus = corpus or prepare_corpus(settings)  # fails fast on bad data before any worker starts
    out.mkdir(parents=True, exist_ok=True)
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        quiet = replace(settings, progress_bar=False)
        for index, config in enumerate(configs, 1):
            print(f"[{index}/{len(configs)}] {config.name}: {config.description}", flush=True)
        with ProcessPoolExecutor(min(workers, len(configs)), mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_train_in_worker, config, quiet, out / "logs") for config in configs]
            results = []
            for config, future in zip(configs, futures):
                results.append(future.result())
                print(f"  {config.name}: val loss {results[-1].val_loss:.4f} ({results[-1].seconds:.0f} s)",
                      flush=True)
    else:
        results = []
        threads = torch.get_num_threads()
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        try:
            for index, config in enumerate(configs, 1):
                print(f"[{index}/{len(configs)}] {config.name}: {config.description}", flush=True)
                results.append(train_config(config, settings, corpus, out / "logs"))
        finally:
            torch.set_num_threads(threads)
    table = format_table(results)
    (out / "results.txt").write_text(table + "\n")
    summary = {"settings": asdict(settings), "results": [asdict(r) for r in results]}
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    title = f"{settings.steps} steps, lr {settings.lr:g}, beta2 {settings.beta2}, seed {settings.seed}"
    plot_results(results, out / "demo.png", title=title)
    return results


__all__ = [
    "CONFIGS",
    "DEFAULT_CONFIGS",
    "DemoSettings",
    "RunConfig",
    "RunResult",
    "format_table",
    "optimizer_state_bytes",
    "plot_results",
    "prepare_corpus",
    "recovered_share",
    "resolve_configs",
    "run_demo",
    "train_config",
]
