"""Which moment carries a format's loss gap: QuantizedAdamW with the format in m, in v or in both, against fp32 states.

The demo's model and training loop (:mod:`lightning_stale.demo`, monitor only), nearest rounding, by default fp4 at
lr 4e-3 (2x fp32's best: where fp4 loses loss at CPU scale), 600 steps, seeds 0 and 1, two single-thread runs at a
time. Prints one row per run and the gap of each variant to fp32, seed by seed. Run:

    .venv/bin/python benchmarks/moment_formats.py [--format fp4] [--lr 4e-3] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path


def variants(fmt: str) -> dict[str, str]:
    """Variant name -> the demo's ``"<m format>/<v format>"``."""
    return {"fp32": "fp32/fp32", fmt: f"{fmt}/{fmt}", f"{fmt} in m": f"{fmt}/fp32", f"{fmt} in v": f"fp32/{fmt}"}


def run(job: tuple[str, str, int, int, float, str]) -> tuple[str, int, float, float, float]:
    name, state_format, seed, steps, lr, out = job
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from lightning_stale.demo.runner import CONFIGS, DemoSettings, prepare_corpus, train_config

    settings = DemoSettings(steps=steps, seed=seed, lr=lr, progress_bar=False)
    config = replace(CONFIGS["fp4"], name=name.replace(" ", "-"), state_format=state_format)
    result = train_config(config, settings, prepare_corpus(settings), Path(out))
    return name, seed, result.val_loss, result.v_frac, result.v_drift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="fp4", help="a QuantizedAdamW format other than fp32")
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="out/moment_formats")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(name, fmt, seed, args.steps, args.lr, args.out) for seed in seeds
            for name, fmt in variants(args.format).items()]
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(run, jobs))
    print(f"lr {args.lr}, {args.steps} steps, nearest rounding; final validation loss (v stall fraction, v drift)\n")
    print("| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | gap to fp32 per seed |")
    print("|---|" + "---|" * len(seeds) + "---|")
    by_run = {(name, seed): (value, frac, drift) for name, seed, value, frac, drift in results}
    for name in variants(args.format):
        cells = [f"{by_run[name, s][0]:.4f} ({by_run[name, s][1]:.2f}, {by_run[name, s][2]:.2f})" for s in seeds]
        gaps = ", ".join(f"{by_run[name, s][0] - by_run['fp32', s][0]:+.3f}" for s in seeds)
        print(f"| {name} | " + " | ".join(cells) + f" | {gaps} |")


if __name__ == "__main__":
    main()
