"""``lightning-stale demo``: pre-train a small byte-level LLaMA-style model with several optimizer-state formats."""

from __future__ import annotations

import argparse

HELP = ("Train a small LM with fp32 and low-precision optimizer states, with and without remedies (resets, the "
        "automatic remedy), two configurations at a time, and compare loss and stall, drift and underflow signals.")

# Kept in sync with lightning_stale.demo.configs (checked by the tests) so that --help needs no torch import.
DEFAULT_CONFIGS = "fp32,fp8,fp8+reset,fp8+auto"
_REMEDY_SUFFIXES = ("", "+reset", "+vreset", "+adaptive", "+periodic", "+drift", "+guard", "+auto")
_WEIGHT_SUFFIXES = ("+wsr", "+wkahan")
AVAILABLE_CONFIGS = ", ".join(
    ["fp32", "fp32+reset", "torchmaster", "torchsrw", "torchsrs", *(f"{s}{x}" for s in ("bnb8bit", "torchmixed") for x in _REMEDY_SUFFIXES),
     *(f"{s}{x}" for s in ("torchbf16", "bnb8bitbf16") for x in _REMEDY_SUFFIXES + _WEIGHT_SUFFIXES),
     "torchbf16+wsrm", "torchbf16+wkahanm"]
    + [f"{s}{r}{x}" for s in ("bf16", "fp8", "fp4", "int8") for r in ("", "-sr") for x in _REMEDY_SUFFIXES]
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=400, help="training steps per configuration (default: 400)")
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated configurations (default: {DEFAULT_CONFIGS}). Available: {AVAILABLE_CONFIGS}. "
        "fp32 is torch AdamW, bnb8bit bitsandbytes AdamW8bit, torchbf16 torch AdamW on bf16 parameters (bf16-true), "
        "bnb8bitbf16 bitsandbytes AdamW8bit on bf16 parameters, torchmixed torch AdamW under bf16-mixed, "
        "torchmaster torch AdamW on fp32 master weights of a bf16-true model (torchsrw / torchsrs: weights / states "
        "in bf16 with stochastic rounding instead), "
        "the others QuantizedAdamW with that state format; -sr: stochastic rounding; +reset: "
        "StaleStateCallback(reset='theory') (fp32+reset: periodic, every 300); +vreset: theory resets of v only; "
        "+adaptive/+drift: reset='adaptive'/'drift'; +periodic: every 300; +guard: underflow_guard=True; "
        "+auto: remedy='auto'; +wsr/+wkahan: weights='stochastic'/'compensated' (bf16 parameters only); +wsrm: "
        "weights='stochastic+moments', +wkahanm: weights='compensated+moments' (torchbf16 only)",
    )
    parser.add_argument("--out", default="stale-demo",
                        help="output folder for logs, table and figure (default: ./stale-demo)")
    parser.add_argument("--seed", type=int, default=0, help="seed for model initialization and data order (default: 0)")
    parser.add_argument("--lr", type=float, default=4e-3,
                        help="peak learning rate (default: 4e-3, twice fp32's best here, where fp8 states lose loss)")
    parser.add_argument("--workers", type=int, default=2,
                        help="configurations trained at once, one process each (default: 2, both cores of a 2-core "
                             "machine)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per run (default: 1, fastest for this small model on a 2-core or busy machine)",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="a text file or folder to train on (default: the shipped corpus, 4 MB of CPython 3.11.7's standard "
        "library source: the same bytes on every machine)",
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lightning_stale.demo.configs import DemoSettings, resolve_configs
    from lightning_stale.demo.data import cpu_kernels
    from lightning_stale.demo.report import format_table
    from lightning_stale.demo.runner import run_demo
    from lightning_stale.demo.training import prepare_corpus

    try:
        configs = resolve_configs(args.configs)
        settings = DemoSettings(steps=args.steps, seed=args.seed, lr=args.lr, data=args.data, threads=args.threads)
        corpus = prepare_corpus(settings)
    except (FileNotFoundError, ValueError) as error:
        print(f"lightning-stale demo: error: {error}")
        return 2
    out = Path(args.out)
    print(f"corpus: {corpus.identity}; CPU kernels: {cpu_kernels()}", flush=True)
    results = run_demo(settings, configs, out, corpus, workers=args.workers)
    print()
    print(format_table(results))
    print(f"corpus: {corpus.identity}; CPU kernels: {cpu_kernels()}")
    print()
    print(f"table:   {out / 'results.txt'} (and results.json)")
    print(f"figure:  {out / 'demo.png'}")
    print(f"logs:    {out / 'logs'}/<config>/seed{args.seed}/metrics.csv")
    return 0
