"""``lightning-stale simulate``: the controlled simulator of quantized Adam moments, measured against the theory."""

from __future__ import annotations

import argparse
import sys

HELP = "Simulate Adam moments stored in a low-precision format; compare measured stalls and drift with the theory."

SIMULATED_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp4", "int8_dynamic")  # the formats --format offers


def _reset(text: str) -> str | int:
    if text in ("none", "theory"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'none', 'theory' or an integer period, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", dest="fmt", default="bf16", choices=SIMULATED_FORMATS,
                        help="state format (default: bf16)")
    parser.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"),
                        help="rounding of the state writes (default: nearest)")
    parser.add_argument("--steps", type=int, default=4000, help="simulated steps (default: 4000)")
    parser.add_argument("--n", type=int, default=10_000, help="independent coordinates (default: 10000)")
    parser.add_argument("--beta1", type=float, default=0.9, help="Adam b1 (default: 0.9)")
    parser.add_argument("--beta2", type=float, default=0.999, help="Adam b2 (default: 0.999)")
    parser.add_argument("--scale", type=float, default=1.0, help="gradient standard deviation (default: 1)")
    parser.add_argument("--scale-after", type=float, default=0.5,
                        help="gradient standard deviation from --change-step on (default: 0.5, i.e. variance / 4)")
    parser.add_argument("--change-step", type=int, default=2000,
                        help="step at which the gradient scale changes; 0 keeps it constant (default: 2000)")
    parser.add_argument("--spread-octaves", type=int, default=2,
                        help="per-coordinate gradient variances are log-uniform over this many octaves (default: 2)")
    parser.add_argument("--reset", type=_reset, default="theory",
                        help="'none', 'theory' (the paper's K*) or a period K; a run without resets is always "
                             "added for comparison (default: theory)")
    parser.add_argument("--s0", type=float, default=0.6, help="tolerance of the theory reset rule (default: 0.6)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--out", default="stale-simulate",
                        help="output folder for the CSVs and simulate.png (default: ./stale-simulate)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from lightning_stale.sim import SimConfig, plot_runs, simulate

    changes = args.change_step > 0
    try:
        configs = [
            SimConfig(fmt=args.fmt, rounding=args.rounding, steps=args.steps, n=args.n, beta1=args.beta1,
                      beta2=args.beta2, scale=args.scale, scale_after=args.scale_after if changes else None,
                      change_step=args.change_step if changes else None, spread_octaves=args.spread_octaves,
                      reset=reset, s0=args.s0, seed=args.seed)
            for reset in (["none"] if args.reset == "none" else ["none", args.reset])
        ]
    except ValueError as error:
        print(f"lightning-stale simulate: error: {error}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the simulated tensors are small: intra-op threads only add overhead
    try:
        results = [simulate(cfg) for cfg in configs]
    finally:
        torch.set_num_threads(threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first = results[0]
    print(f"format {args.fmt}, rounding {args.rounding}, b2 = {args.beta2}: rho-hat = {first.rho_hat:.3g} "
          f"({first.rho_source})")
    print(format_table([r.summary() for r in results]))
    for res in results:
        name = "simulate_no_reset.csv" if res.period is None else "simulate_reset.csv"
        res.write_csv(out / name)
        print(f"csv:    {out / name}")
    plot_runs(results, out / "simulate.png")
    print(f"figure: {out / 'simulate.png'}")
    return 0


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of :meth:`SimResult.summary` rows."""
    headers = {"run": "run", "stall_v": "v stall", "predicted_v": "theory", "mean_abs_gap": "|gap|",
               "stall_m": "m stall", "v_abs_err": "median |v/fp32-1|", "v_ratio_before_change": "v/fp32 pre-change",
               "v_ratio_end": "v/fp32 end"}
    keys = [k for k in headers if any(k in row for row in rows)]
    cells = [[headers[k] for k in keys]] + [[_cell(row.get(k)) for k in keys] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(keys))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
