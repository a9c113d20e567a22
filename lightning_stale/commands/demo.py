"""``lightning-stale demo``: pre-train a small byte-level LLaMA-style model with several optimizer-state formats."""

from __future__ import annotations

import argparse

HELP = ("Train a small byte-level LM with fp32 and low-precision weights or optimizer states, with and without "
        "remedies, two configurations at a time, and compare the loss with the stall, drift and underflow signals "
        "the callback logs.")

# Kept in sync with lightning_stale.demo.configs (checked by the tests) so that --help needs no torch import.
DEFAULT_CONFIGS = "fp32,torchbf16,torchbf16+auto"
DEFAULT_STEPS, DEFAULT_LR = 1000, 1e-3
FEATURED = (  # (names, one line): what a user would run
    ("fp32", "torch AdamW, fp32 weights and states: the reference"),
    ("torchbf16", "torch AdamW on a bf16-true model: bf16 weights and states"),
    ("torchbf16+auto", "the same with StaleStateCallback(remedy=\"auto\"): the weight write-back"),
    ("bnb8bitbf16,bnb8bitbf16+auto", "bitsandbytes AdamW8bit on a bf16-true model, as is and with remedy=\"auto\""),
    ("torchmaster", "control: torch AdamW's math on fp32 master copies of a bf16-true model"),
    ("bf16,bf16+auto", "QuantizedAdamW with bf16 moments beside fp32 weights (v drifts up)"),
    ("fp8,fp8+auto", "QuantizedAdamW with fp8 moments, one scale per tensor (v underflows)"),
    ("fp8+reset", "fp8 with StaleStateCallback(reset=\"theory\")"),
)
# The grammar of every other name: STORAGE[-sr][+REMEDY] (the tests check it gives exactly the catalogue)
_STATE_STORAGES = ("bf16", "fp8", "fp4", "int8")  # QuantizedAdamW: the only ones with -sr
_OTHER_STORAGES = ("bnb8bit", "torchmixed")
_BF16_WEIGHT_STORAGES = ("torchbf16", "bnb8bitbf16")
_CONTROLS = ("fp32", "torchmaster", "torchsrw", "torchsrs", "optimikahan", "aobf16sr")  # no suffixes (but fp32+reset)
_REMEDY_SUFFIXES = ("+reset", "+vreset", "+adaptive", "+periodic", "+drift", "+guard", "+auto")
_WEIGHT_SUFFIXES = ("+wsr", "+wkahan")  # bf16 weights only
_MOMENT_SUFFIXES = ("+wsrm", "+wkahanm")  # torchbf16 only

EPILOG = "\n".join(
    ["configurations a user would run (--configs, comma-separated; the default is the first three):"]
    + [f"  {names:<30} {words}" for names, words in FEATURED]
    + ["",
       "compose others as STORAGE[-sr][+REMEDY]:",
       "  STORAGE  fp32 (torch AdamW), bnb8bit (bitsandbytes AdamW8bit), bf16, fp8, fp4, int8 (QuantizedAdamW",
       "           moments), torchbf16, bnb8bitbf16 (bf16-true: bf16 weights), torchmixed (bf16-mixed);",
       "           controls without suffixes: torchmaster, torchsrw, torchsrs (bf16 weights / moments rounded",
       "           stochastically over fp32 math); the write-back's peers on bf16-true: optimikahan (torch-optimi",
       "           AdamW kahan_sum), aobf16sr (torchao AdamW bf16_stochastic_round); fp32+reset resets fp32 every",
       "           300 steps",
       "  -sr      stochastic rounding of the moments (bf16, fp8, fp4, int8)",
       "  +REMEDY  +auto remedy=\"auto\"; +reset reset=\"theory\"; +vreset the same for v only; +adaptive, +drift,",
       "           +periodic (every 300 steps) reset policies; +guard underflow_guard=True; bf16 weights only:",
       "           +wsr, +wkahan weights=\"stochastic\", \"compensated\"; torchbf16 only: +wsrm, +wkahanm",
       "           weights=\"stochastic+moments\", \"compensated+moments\"",
       "example: lightning-stale demo --configs fp32,fp8,fp8+auto --lr 4e-3"]
)


def composed_configs() -> list[str]:
    """Every name the grammar in ``EPILOG`` gives (the demo's catalogue, without importing it)."""
    names = [*_CONTROLS, "fp32+reset"]
    for storage in (*_OTHER_STORAGES, *_BF16_WEIGHT_STORAGES, *_STATE_STORAGES):
        suffixes = ("", *_REMEDY_SUFFIXES)
        if storage in _BF16_WEIGHT_STORAGES:
            suffixes += _WEIGHT_SUFFIXES + (_MOMENT_SUFFIXES if storage == "torchbf16" else ())
        for rounding in ("", "-sr") if storage in _STATE_STORAGES else ("",):
            names += [storage + rounding + suffix for suffix in suffixes]
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"training steps per configuration (default: {DEFAULT_STEPS})")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated configurations (default: {DEFAULT_CONFIGS}; see below)")
    parser.add_argument("--out", default="stale-demo",
                        help="output folder for logs, table and figure (default: ./stale-demo)")
    parser.add_argument("--seed", type=int, default=0, help="seed for model initialization and data order (default: 0)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR,
                        help=f"peak learning rate, warm-up 10%% then cosine decay to 10%% (default: {DEFAULT_LR:g})")
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
    from lightning_stale.demo.training import prepare_corpus, separate_compile_cache

    cache = separate_compile_cache()  # before anything compiles: Inductor's cache mixes CPU kernel sets
    try:
        configs = resolve_configs(args.configs)
        settings = DemoSettings(steps=args.steps, seed=args.seed, lr=args.lr, data=args.data, threads=args.threads)
        corpus = prepare_corpus(settings)
    except (FileNotFoundError, ValueError) as error:
        print(f"lightning-stale demo: error: {error}")
        return 2
    out = Path(args.out)
    print(f"corpus: {corpus.identity}; CPU kernels: {cpu_kernels()}", flush=True)
    if cache:
        print(f"torch.compile cache for these kernels: {cache}", flush=True)
    results = run_demo(settings, configs, out, corpus, workers=args.workers)
    print()
    print(format_table(results))
    print(f"corpus: {corpus.identity}; CPU kernels: {cpu_kernels()}")
    print()
    print(f"table:   {out / 'results.txt'} (and results.json)")
    print(f"figure:  {out / 'demo.png'}")
    print(f"logs:    {out / 'logs'}/<config>/seed{args.seed}/metrics.csv")
    return 0
