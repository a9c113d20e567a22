"""Loss recovery at CPU scale: where low-precision optimizer states cost loss, and which remedy recovers it.

The paper's Table 5 protocol (fp32 compute, only the optimizer states stored in low precision) on the demo's model
and loop (:mod:`lightning_stale.demo`), over learning rates and seeds. Columns are state storages: fp32 (torch
AdamW, the reference), bf16 / fp8 / fp4 / int8 (``QuantizedAdamW``), bnb8bit (bitsandbytes AdamW8bit), torchbf16
(torch AdamW on bf16 parameters: bf16 weights and states), bnb8bitbf16 (bitsandbytes AdamW8bit on bf16 parameters:
8-bit states, bf16 weights), torchmixed (torch AdamW under bf16-mixed: bf16 compute, fp32 weights and states) and
torchmaster (torch AdamW on fp32 master weights of a bf16-true model: bf16-true compute, nothing else rounded),
torchsrw / torchsrs (the same with the weights / the moments stored in bf16 with stochastic rounding: what each
part's rounding noise costs).
Rows are remedies, each a ``StaleStateCallback`` setting: nearest (none), stochastic (rounding, ``QuantizedAdamW``
only), guard (``underflow_guard=True``), theory / vonly (theory periods, both moments / v only) / adaptive /
periodic / drift (``reset=...``; fp32's periodic cell is the control, every 300 steps), wsr / wkahan (the weight
write-back with stochastic rounding / compensated summation, ``weights=...``; bf16 weights only), wsrm (the write-back
rounding torch's bf16 moments stochastically too, ``weights="stochastic+moments"``; torchbf16 only), wkahanm (the
same with compensated weights, ``weights="compensated+moments"``; torchbf16 only) and auto
(``remedy="auto"``).

For every learning rate it prints the grid (mean ± std over seeds), then per column the gap of nearest rounding to
fp32 paired by seed (runs with one seed share initialization and data order) with its 95% interval (Student's t,
n-1 degrees of freedom; significant when the interval excludes zero), and per configuration the paired change
against its nearest baseline with its interval, the share of the gap it recovers (where the gap is significant),
and what the callback logged: v stall fraction (mean over the run), v underflow (mean), v drift (at the end), resets, and
for ``auto`` the parameters it guards and the resets it made.

Runs are independent single-thread processes (``--workers``, default 2: both cores of a 2-core machine).

    python benchmarks/recovery.py                       # the default plan (PLAN below), 3 seeds
    python benchmarks/recovery.py --plan long --resume  # whole runs, every remedy on every storage (hours)
    python benchmarks/recovery.py --lrs 4e-3 --columns fp32,fp8 --rows nearest,guard,auto --seeds 0
    python benchmarks/recovery.py --summarize-only      # rebuild the tables from OUT/runs.json
    python benchmarks/recovery.py --plan long --summarize-only --out A --include B,C --against torchmaster
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

from lightning_stale.demo.configs import CONFIGS, DemoSettings
from lightning_stale.demo.data import cpu_kernels
from lightning_stale.demo.model import DecoderConfig
from lightning_stale.demo.stats import PairedDifference
from lightning_stale.demo.training import prepare_corpus, separate_compile_cache, train_config

COLUMNS = ("fp32", "bf16", "fp8", "fp4", "int8", "bnb8bit", "torchbf16", "bnb8bitbf16", "torchmixed", "torchmaster",
           "torchsrw", "torchsrs", "optimikahan", "aobf16sr")
# bf16-true controls and the weight write-back's peers (torch-optimi Kahan, torchao bf16 stochastic rounding), one
# (nearest) cell each
CONTROLS = ("torchmaster", "torchsrw", "torchsrs", "optimikahan", "aobf16sr")
ROWS = ("nearest", "stochastic", "guard", "theory", "vonly", "adaptive", "periodic", "drift", "wsr", "wkahan", "wsrm",
        "wkahanm", "auto")
SUFFIX = {"nearest": "", "guard": "+guard", "theory": "+reset", "vonly": "+vreset", "adaptive": "+adaptive",
          "periodic": "+periodic", "drift": "+drift", "wsr": "+wsr", "wkahan": "+wkahan", "wsrm": "+wsrm",
          "wkahanm": "+wkahanm", "auto": "+auto"}
NO_STOCHASTIC = ("bnb8bit", "torchbf16", "bnb8bitbf16", "torchmixed")  # optimizers without stochastic rounding
BF16_WEIGHTS = ("torchbf16", "bnb8bitbf16")  # the columns whose weights the write-back rows take over


def cell_config(row: str, column: str) -> str | None:
    """The configuration name of a table cell, or None where the cell does not exist."""
    if column == "fp32":
        return {"nearest": "fp32", "periodic": "fp32+reset"}.get(row)
    if column in CONTROLS:
        return column if row == "nearest" else None
    if row == "stochastic":
        return None if column in NO_STOCHASTIC else f"{column}-sr"
    if (row in ("wsr", "wkahan") and column not in BF16_WEIGHTS) or \
            (row in ("wsrm", "wkahanm") and column != "torchbf16"):
        return None
    return column + SUFFIX[row]
TARGET_SHARE = 0.8
# The default plan, 84 runs of 600 steps (about an hour on 2 cores): at lr 4e-3 (2x fp32's best, where
# low-precision states lose loss) every remedy on fp8, all but adaptive on fp4, the cheap ones elsewhere; at lr 2e-3
# (fp32's best, where no storage lost loss in 3 seeds before) whether the automatic remedy costs anything.
PLAN: dict[float, dict[str, tuple[str, ...]]] = {
    4e-3: {"fp32": ("nearest", "periodic"),
           "fp8": ("nearest", "stochastic", "guard", "theory", "adaptive", "drift", "auto"),
           "fp4": ("nearest", "stochastic", "guard", "theory", "drift", "auto"),
           "bf16": ("nearest", "auto"),
           "int8": ("nearest", "guard", "auto"),
           "bnb8bit": ("nearest", "guard", "auto")},
    2e-3: {"fp32": ("nearest",), "fp8": ("nearest", "auto"), "bnb8bit": ("nearest", "auto")},
}
# The long plan: a whole run (5,000 steps of the 0.13M model at lr 2e-3, fp32's best), every remedy on every storage,
# 3 seeds, about 140 runs of a few minutes each: hours on 2 cores, run with --resume over several sessions.
LONG = {"steps": 5000, "dim": 64, "hidden": 176, "lrs": [2e-3], "out": "out/recovery-long"}
LONG_PLAN = {c: tuple(r for r in ROWS if r != "periodic" and cell_config(r, c)) for c in COLUMNS if c != "fp32"}
LONG_PLAN["fp32"] = ("nearest",)
# bf16 weights: the write-back's rows and auto against nearest; bf16-mixed is what autocast's bf16 compute
# costs, torchmaster what bf16-true compute costs (the floor under any write of weights and states)
LONG_PLAN.update({c: ("nearest", "wsr", "wkahan", "auto") for c in ("bnb8bitbf16",)}, torchmixed=("nearest",),
                 **{c: ("nearest",) for c in CONTROLS})




def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)


def _train(name: str, settings: DemoSettings, log_root: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    corpus = prepare_corpus(settings)
    result = train_config(CONFIGS[name], settings, corpus, Path(log_root) / f"lr{settings.lr:g}")
    return {"name": name, "lr": settings.lr, "seed": settings.seed, "eps": settings.eps,
            "corpus_sha256": corpus.identity.sha256,
            "cpu_kernels": cpu_kernels(),
            "val_loss": result.val_loss,
            "seconds": result.seconds, **{k: getattr(result, k) for k in (
                "v_frac", "v_predicted", "v_drift", "v_underflow", "resets", "remedy_guard", "remedy_stochastic",
                "remedy_reset", "w_frac", "w_predicted", "remedy_weights",
                "state_bytes_per_param", "weight_buffer_bytes_per_param")}}


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else math.nan)


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def summarize(runs: list[dict], lr: float, cells: dict[str, tuple[str, ...]], against: str | None = None) -> str:
    """Markdown for one learning rate: the grid, the gaps per column, and every configuration against its baseline
    (and against the configuration ``against`` too, paired by seed, where given)."""
    by_name: dict[str, dict[int, dict]] = {}
    for run in runs:
        if math.isclose(run["lr"], lr):
            by_name.setdefault(run["name"], {})[run["seed"]] = run
    columns = [c for c in COLUMNS if c in cells]
    rows = [r for r in ROWS if any(r in cells[c] for c in columns)]

    def loss(name: str | None) -> str:
        seeds = by_name.get(name or "", {})
        if not seeds:
            return "-"
        mean, std = _mean_std([r["val_loss"] for r in seeds.values()])
        return f"{mean:.4f}" + (f" ± {std:.4f}" if len(seeds) > 1 else "") + f" (n={len(seeds)})"

    def paired(name: str, reference: str) -> PairedDifference:
        seeds = sorted(set(by_name.get(name, {})) & set(by_name.get(reference, {})))
        return PairedDifference.of([by_name[name][s]["val_loss"] - by_name[reference][s]["val_loss"] for s in seeds])

    def signal(name: str, key: str) -> float:
        values = [r[key] for r in by_name.get(name, {}).values() if r.get(key) is not None]
        return statistics.fmean(values) if values else math.nan

    lines = [f"#### lr {lr:g}", "", "| remedy | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(loss(cell_config(row, c)) if row in cells[c] else "-"
                                                for c in columns) + " |")
    lines += ["", "| column | gap of nearest to fp32, paired, [95% interval] | seeds | significant |", "|---|---|---|---|"]
    gaps = {}
    for column in columns:
        if column == "fp32" or column not in by_name:
            continue
        gap = paired(column, "fp32")
        if gap.significant and gap.mean > 0:  # a share of a gap within the noise means nothing
            gaps[column] = gap.mean
        lines.append(f"| {column} | {gap} | {gap.n} | {'yes' if gap.significant else 'no'} |")
    lines += ["", "| configuration | change vs its baseline, paired, [95% interval] | significant | recovered | "
                  "vs fp32, paired [95%] | " + (f"vs {against}, paired [95%] | " if against else "") +
              "v stall | v underflow | v drift (end) | w stall | resets | auto: guarded, SR, resets, weights |",
              "|---" * (11 + bool(against)) + "|"]
    for column in columns:
        for row in rows:
            name = cell_config(row, column)
            if row not in cells[column] or name not in by_name:
                continue
            baseline = "fp32" if column == "fp32" else column
            change = paired(name, baseline) if name != baseline else PairedDifference.of([])
            gap = gaps.get(column, math.nan)
            share = (0.0 - change.mean) / gap if not math.isnan(change.mean) else math.nan
            remedy = (f"{signal(name, 'remedy_guard'):.1f}, {_fmt(signal(name, 'remedy_stochastic'), '.1f')}, "
                      f"{signal(name, 'remedy_reset'):.1f}, {_fmt(signal(name, 'remedy_weights'), '.0f')}"
                      if row == "auto" else "-")
            lines.append(
                f"| {name} | {change} | {'yes' if change.significant else ('no' if change.n > 1 else '-')} | "
                f"{_fmt(100 * share, '.0f') + ('%' if not math.isnan(share) else '')} | "
                f"{paired(name, 'fp32') if name != 'fp32' else '-'} | "
                + (f"{paired(name, against) if name != against else '-'} | " if against else "") +
                f"{_fmt(signal(name, 'v_frac'), '.3f')} | {_fmt(signal(name, 'v_underflow'), '.4f')} | "
                f"{_fmt(signal(name, 'v_drift'), '.2f')} | {_fmt(signal(name, 'w_frac'), '.3f')} | "
                f"{_fmt(signal(name, 'resets'), '.1f')} | {remedy} |")
    return "\n".join(lines)


def plan(args: argparse.Namespace) -> dict[float, dict[str, tuple[str, ...]]]:
    """Cells to run per learning rate: the rectangle asked for on the command line (within the long plan's cells
    with ``--plan long``), else the plan's."""
    if args.columns or args.rows:
        columns, rows = args.columns or list(COLUMNS), tuple(args.rows or ROWS)
        allowed = LONG_PLAN if args.plan == "long" else {c: ROWS for c in COLUMNS}
        return {lr: {c: tuple(r for r in rows if cell_config(r, c) and r in allowed[c]) for c in columns}
                for lr in args.lrs}
    if args.plan == "long":
        return {lr: LONG_PLAN for lr in args.lrs}
    return {lr: PLAN.get(lr, PLAN[4e-3]) for lr in args.lrs}


def saved_runs(path: Path, sha256: str, eps: float) -> list[dict]:
    """The runs in ``path`` trained on the corpus with this hash and with this Adam eps (the others are left out, and
    counted; runs that recorded no eps used the demo's 1e-6)."""
    if not path.exists():
        return []
    runs = json.loads(path.read_text())["runs"]
    kept = [r for r in runs if r.get("corpus_sha256") == sha256 and math.isclose(r.get("eps", 1e-6), eps)]
    if len(kept) < len(runs):
        print(f"{path}: {len(runs) - len(kept)} runs on another corpus or eps (or none recorded) left out", flush=True)
    return kept


def _train_all(args: argparse.Namespace, base: DemoSettings, cells: dict, out: Path, sha256: str) -> list[dict]:
    """Run every (lr, configuration, seed); save runs.json after each finished run (``--resume`` keeps the runs
    already there on the same corpus and trains only the missing ones)."""
    runs = saved_runs(out / "runs.json", sha256, base.eps) if args.resume else []
    done = {(r["name"], r["lr"], r["seed"]) for r in runs}
    jobs = [(name, replace(base, lr=lr, seed=seed)) for lr, columns in cells.items()  # row by row: baselines first
            for name in dict.fromkeys(cell_config(r, c) for r in ROWS for c, rows in columns.items() if r in rows)
            for seed in args.seeds if (name, lr, seed) not in done]
    print(f"{len(jobs)} runs ({len(runs)} kept), {args.steps} steps each, {args.workers} workers", flush=True)
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=_worker_init) as pool:
        futures = [pool.submit(_train, name, settings, str(out / "logs")) for name, settings in jobs]
        for future in as_completed(futures):
            runs.append(future.result())
            run = runs[-1]
            print(f"  lr {run['lr']:g} {run['name']:>16} seed {run['seed']}: val loss {run['val_loss']:.4f} "
                  f"({run['seconds']:.0f} s; {len(runs) - len(done)}/{len(jobs)} after "
                  f"{(time.perf_counter() - start) / 60:.1f} min)", flush=True)
            (out / "runs.json").write_text(json.dumps({"settings": asdict(base), "runs": runs}, indent=1,
                                                      default=str))
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=("default", "long"), default="default",
                        help="default: 600 steps, lr 4e-3 and 2e-3 (PLAN); long: a whole run, every remedy on every "
                             f"storage ({LONG})")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the plan's)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--lrs", default=None, help="comma-separated peak learning rates (default: the plan's)")
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--eps", type=float, default=None, help="Adam's eps (default: the demo's, 1e-6)")
    parser.add_argument("--dim", type=int, default=None, help="model width (default: the plan's)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=None, help="feed-forward width (default: the plan's)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--columns", default="", help=f"subset of {','.join(COLUMNS)} (default: the plan's)")
    parser.add_argument("--rows", default="", help=f"subset of {','.join(ROWS)} (default: the plan's)")
    parser.add_argument("--workers", type=int, default=2, help="parallel single-thread runs (default: 2)")
    parser.add_argument("--data", default=None, help="text file or folder (default: the shipped corpus)")
    parser.add_argument("--out", default=None, help="folder for logs and results (default: out/recovery, "
                                                     "out/recovery-long)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in OUT/runs.json (same settings) and train only the missing ones")
    parser.add_argument("--summarize-only", action="store_true",
                        help="train nothing; rebuild the tables from the runs already saved in OUT/runs.json")
    parser.add_argument("--include", default="",
                        help="with --summarize-only: comma-separated folders whose runs.json join OUT's (a run of the "
                             "same configuration, lr and seed counts once, OUT's first)")
    parser.add_argument("--against", default=None,
                        help="one more reference configuration (e.g. torchmaster): every configuration paired with "
                             "it by seed")
    args = parser.parse_args(argv)
    for name, allowed in (("columns", COLUMNS), ("rows", ROWS)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        bad = [x for x in chosen if x not in allowed]
        if bad:
            parser.error(f"--{name} must be a comma list of {allowed}, got {getattr(args, name)!r}")
        setattr(args, name, chosen)
    if args.against is not None and args.against not in CONFIGS:
        parser.error(f"--against must name a configuration ({', '.join(CONFIGS)}), got {args.against!r}")
    defaults = LONG if args.plan == "long" else {"steps": 600, "dim": 128, "hidden": 352, "lrs": [4e-3, 2e-3],
                                                  "out": "out/recovery"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if isinstance(args.lrs, str):
        args.lrs = [float(x) for x in args.lrs.split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    separate_compile_cache()  # runs under ATEN_CPU_CAPABILITY get their own torch.compile cache (workers inherit it)
    model = DecoderConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, hidden=args.hidden,
                          context=args.context)
    base = DemoSettings(steps=args.steps, batch_size=args.batch_size, model=model, beta2=args.beta2,
                        data=args.data, progress_bar=False, log_every=max(10, args.steps // 100),
                        **({} if args.eps is None else {"eps": args.eps}))
    corpus = prepare_corpus(base).identity  # fails fast on a bad --data
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = plan(args)
    saved = out / "runs.json"
    start = time.perf_counter()
    runs = saved_runs(saved, corpus.sha256, base.eps) if args.summarize_only else _train_all(args, base, cells, out,
                                                                                               corpus.sha256)
    if args.summarize_only:
        seen = {(r["name"], r["lr"], r["seed"]) for r in runs}
        for folder in [f for f in args.include.split(",") if f]:
            for run in saved_runs(Path(folder) / "runs.json", corpus.sha256, base.eps):
                if (run["name"], run["lr"], run["seed"]) not in seen:
                    seen.add((run["name"], run["lr"], run["seed"]))
                    runs.append(run)
    minutes = (time.perf_counter() - start) / 60
    command = "python benchmarks/recovery.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (f"{args.steps} steps, beta2 {args.beta2}, warm-up 10% then cosine to 10%, model dim {args.dim} x "
              f"{args.layers} layers, batch {args.batch_size} x {args.context} bytes, seeds {args.seeds}; "
              f"{len(runs)} runs on {os.cpu_count()} cores" + ("" if args.summarize_only else
                                                               f" in {minutes:.1f} min") +
              f".\nCorpus: {corpus}; CPU kernels: "
              f"{', '.join(sorted({r.get('cpu_kernels', '?') for r in runs}))}.\n`{command.strip()}`" + (" (tables rebuilt from the saved runs)" if args.summarize_only else ""))
    text = header + "\n\n" + "\n\n".join(summarize(runs, lr, columns, args.against) for lr, columns in cells.items())
    (out / "recovery.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {out / 'recovery.md'}, {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
