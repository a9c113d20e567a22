"""Loss recovery at CPU scale: the paper's Table 5 protocol (fp32 compute, only the optimizer states quantized).

Rows: nearest rounding, stochastic rounding, theory-period resets, stochastic rounding + resets. Columns: fp32, bf16,
fp8_e4m3, fp4, int8 dynamic map (bitsandbytes AdamW8bit for the nearest and reset rows, QuantizedAdamW int8_dynamic
for the stochastic rows). Every cell is the mean +- std of the final validation loss over seeds; the fp32 + resets
cell is the control (resets should not help, and should hurt by no more than the paper's 0.006).

Runs are independent processes with one thread each (``--workers``, default 2), which uses 2 cores better than one
2-thread run of a model this small. Configurations and the training loop come from :mod:`lightning_stale.demo`.

    python benchmarks/recovery.py                      # the full grid, 3 seeds
    python benchmarks/recovery.py --seeds 0 --steps 500 --columns fp32,fp8  # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from multiprocessing import get_context
from pathlib import Path

from lightning_stale.demo.model import DecoderConfig
from lightning_stale.demo.runner import CONFIGS, DemoSettings, prepare_corpus, train_config

COLUMNS = ("fp32", "bf16", "fp8", "fp4", "int8")
ROWS = ("nearest", "stochastic", "resets", "stochastic+resets")
TARGET_SHARE = 0.8  # theory resets should recover at least this share of the fp8 / fp4 gap
CONTROL_TOLERANCE = 0.006  # the paper's fp32 + resets penalty (3.161 vs 3.155)


def cell_config(row: str, column: str) -> str | None:
    """The configuration name of a table cell, or None where the cell does not exist (fp32 has no rounding mode)."""
    stochastic, resets = "stochastic" in row, "resets" in row
    if column == "fp32" and stochastic:
        return None
    storage = "bnb8bit" if column == "int8" and not stochastic else column
    return storage + ("-sr" if stochastic else "") + ("+reset" if resets else "")


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)


def _train(name: str, settings: DemoSettings, log_root: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    corpus = prepare_corpus(settings)
    result = train_config(CONFIGS[name], settings, corpus, Path(log_root))
    return {"name": name, "seed": settings.seed, "val_loss": result.val_loss, "seconds": result.seconds,
            "v_frac": result.v_frac, "v_predicted": result.v_predicted, "v_drift": result.v_drift,
            "resets": result.resets, "state_bytes_per_param": result.state_bytes_per_param}


def _stats(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else math.nan)


def summarize(runs: list[dict], columns: list[str], rows: list[str]) -> str:
    """Markdown: the Table 5 grid, then per-column gap, significance, recovered shares and the fp32 control.

    Besides the plain criterion (gap > 2 x the larger seed std), the gap is also given paired by seed: runs with the
    same seed share initialization and data order, so the per-seed difference removes most seed-to-seed variation.
    """
    by_seed: dict[str, dict[int, dict]] = {}
    for run in runs:
        by_seed.setdefault(run["name"], {})[run["seed"]] = run
    stats = {name: _stats([r["val_loss"] for r in seeds.values()]) for name, seeds in by_seed.items()}
    drift = {name: statistics.fmean(r["v_drift"] for r in seeds.values()) for name, seeds in by_seed.items()}

    def cell(name: str | None) -> str:
        if name is None or name not in stats:
            return "-"
        mean, std = stats[name]
        n = len(by_seed[name])
        return f"{mean:.4f} ± {std:.4f}" + ("" if n == 3 else f" (n={n})") if n > 1 else f"{mean:.4f} (n=1)"

    def paired(name: str, reference: str) -> tuple[float, float]:
        seeds = sorted(set(by_seed[name]) & set(by_seed[reference]))
        if not seeds:
            return math.nan, math.nan
        return _stats([by_seed[name][s]["val_loss"] - by_seed[reference][s]["val_loss"] for s in seeds])

    lines = ["| states | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(cell(cell_config(row, c)) for c in columns) + " |")
    lines += ["", "| column | gap (nearest - fp32) | 2 std | significant | paired gap ± std | recovered by resets | "
                  "recovered by SR + resets | mean v drift: nearest, resets |", "|---|---|---|---|---|---|---|---|"]
    fp32 = stats.get("fp32")
    for column in columns:
        nearest = cell_config("nearest", column)
        if column == "fp32" or fp32 is None or nearest not in stats:
            continue
        gap = stats[nearest][0] - fp32[0]
        noise = 2 * max(stats[nearest][1], fp32[1])
        pair_mean, pair_std = paired(nearest, "fp32")
        shares = []
        for row in ("resets", "stochastic+resets"):
            name = cell_config(row, column)
            shares.append(f"{100 * (stats[nearest][0] - stats[name][0]) / gap:.0f}%" if name in stats and gap > 0
                          else "- (no gap)" if name in stats else "-")
        reset_name = cell_config("resets", column)
        drifts = f"{drift.get(nearest, math.nan):.2f}, {drift.get(reset_name, math.nan):.2f}"
        lines.append(f"| {column} | {gap:+.4f} | {noise:.4f} | {'yes' if gap > noise else 'no'} | "
                     f"{pair_mean:+.4f} ± {pair_std:.4f} | {shares[0]} | {shares[1]} | {drifts} |")
    if fp32 is not None and "fp32+reset" in stats:
        delta = stats["fp32+reset"][0] - fp32[0]
        pair_mean, pair_std = paired("fp32+reset", "fp32")
        verdict = "within" if delta <= CONTROL_TOLERANCE else "beyond"
        lines += ["", f"fp32 control: resets change the loss by {delta:+.4f} (paired {pair_mean:+.4f} ± "
                      f"{pair_std:.4f}; {verdict} the paper's +{CONTROL_TOLERANCE})."]
    return "\n".join(lines)


def _train_all(args: argparse.Namespace, base: DemoSettings, out: Path) -> list[dict]:
    """Run every (configuration, seed), the fp32/fp8/fp4 columns first; save runs.json after each finished run."""
    by_column = [c for c in ("fp32", "fp8", "fp4", "bf16", "int8") if c in args.columns]
    names = [n for c in by_column for r in args.rows if (n := cell_config(r, c)) is not None]
    if args.control and "fp32" in args.columns:
        names.insert(1, "fp32+reset")
    jobs = [(name, replace(base, seed=seed)) for name in dict.fromkeys(names) for seed in args.seeds]
    print(f"{len(jobs)} runs ({len(jobs) // len(args.seeds)} configs x {len(args.seeds)} seeds), {args.steps} steps "
          f"each, {args.workers} workers", flush=True)
    start, runs = time.perf_counter(), []
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=_worker_init) as pool:
        futures = [pool.submit(_train, name, settings, str(out / "logs")) for name, settings in jobs]
        for future in as_completed(futures):
            runs.append(future.result())
            run = runs[-1]
            print(f"  {run['name']:>16} seed {run['seed']}: val loss {run['val_loss']:.4f} ({run['seconds']:.0f} s; "
                  f"{len(runs)}/{len(jobs)} after {(time.perf_counter() - start) / 60:.1f} min)", flush=True)
            (out / "runs.json").write_text(json.dumps({"settings": asdict(base), "runs": runs}, indent=1,
                                                      default=str))
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=352)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--columns", default=",".join(COLUMNS), help=f"subset of {','.join(COLUMNS)}")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"subset of {','.join(ROWS)}")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                        help="also run fp32 + resets (default: on)")
    parser.add_argument("--workers", type=int, default=2, help="parallel single-thread runs (default: 2)")
    parser.add_argument("--data", default=None, help="text file or folder (default: the stdlib source)")
    parser.add_argument("--out", default="out/recovery", help="folder for logs and results")
    parser.add_argument("--summarize-only", action="store_true",
                        help="train nothing; rebuild the tables from the runs already saved in OUT/runs.json")
    args = parser.parse_args(argv)
    for name, allowed in (("columns", COLUMNS), ("rows", ROWS)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            parser.error(f"--{name} must be a comma list of {allowed}, got {getattr(args, name)!r}")
        setattr(args, name, chosen)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = DecoderConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, hidden=args.hidden,
                          context=args.context)
    base = DemoSettings(steps=args.steps, batch_size=args.batch_size, model=model, lr=args.lr, beta2=args.beta2,
                       data=args.data, progress_bar=False, log_every=max(10, args.steps // 100))
    prepare_corpus(base)  # fail fast on a bad --data
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "runs.json"
    runs = json.loads(saved.read_text())["runs"] if args.summarize_only else _train_all(args, base, out)
    table = summarize(runs, args.columns, args.rows)
    command = "python benchmarks/recovery.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (f"{args.steps} steps, beta2 {args.beta2}, lr {args.lr} (warm-up 10%, cosine to 10%), model dim "
              f"{args.dim} x {args.layers} layers, batch {args.batch_size} x {args.context} bytes, seeds "
              f"{args.seeds}; {len(runs)} runs on {os.cpu_count()} cores.\n`{command.strip()}`"
              + (" (tables rebuilt from the saved runs)\n" if args.summarize_only else "\n"))
    (out / "recovery.md").write_text(header + "\n" + table + "\n")
    print(header)
    print(table)
    print(f"\nwritten: {out / 'recovery.md'}, {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
