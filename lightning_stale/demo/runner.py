"""Run a demo comparison: train each configuration (serially or in worker processes), then write the report.

Only the orchestration lives here: configurations in :mod:`~lightning_stale.demo.configs`, one run in
:mod:`~lightning_stale.demo.training`, the table and figure in :mod:`~lightning_stale.demo.report`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from lightning_stale.demo.configs import DemoSettings, RunConfig
from lightning_stale.demo.data import ByteCorpus, cpu_kernels
from lightning_stale.demo.report import format_table, plot_results
from lightning_stale.demo.training import RunResult, prepare_corpus, train_config
from lightning_stale.vocab import check_int


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
    summary = {"settings": asdict(settings), "corpus": asdict(corpus.identity),
               "cpu_kernels": cpu_kernels(), "results": [asdict(r) for r in results]}
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    title = f"{settings.steps} steps, lr {settings.lr:g}, beta2 {settings.beta2}, seed {settings.seed}"
    plot_results(results, out / "demo.png", title=title)
    return results


__all__ = ["run_demo"]
