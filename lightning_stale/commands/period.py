"""``lightning-stale period``: predicted staleness and the recommended reset period for a state format and b2."""

from __future__ import annotations

import argparse
import math
import sys

HELP = "Predict v stalling (rho-hat, P_NR, P_SR, startup windows) and the reset period K* for a format or saved state."

# Names accepted by --format: the paper's float formats (theory.FORMAT_EPSILON's, spelled here so that --help does not
# import torch) plus lightning_stale's scaled/grid formats.
PAPER_FORMATS = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "fp4_e2m2")
ALIASES = {"fp4": "fp4_e2m2"}  # lightning_stale's fp4 stores v as unsigned E2M2, the paper's FP4 v grid
STARTUP_THRESHOLDS = (0.5, 0.8, 0.9, 0.95)
S0_SWEEP = (0.5, 0.6, 0.7, 0.8, 0.9)
SAMPLE_LIMIT = 1_000_000  # elements of a saved state used for the grid estimate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", dest="fmt", default="bf16", choices=(*PAPER_FORMATS, *ALIASES, "int8_dynamic"),
                        help="second-moment storage format (default: bf16); fp4 is the paper's unsigned E2M2 v grid; "
                             "int8_dynamic uses the grid estimate on a synthetic sample")
    parser.add_argument("--beta2", type=float, default=None,
                        help="Adam b2 (default: the saved optimizer's b2 with --state, else 0.999)")
    parser.add_argument("--s0", type=float, default=0.6, help="staleness tolerance of the reset rule (default: 0.6)")
    parser.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"),
                        help="rounding of the state writes, for the effective horizon (default: nearest)")
    parser.add_argument("--p-init", type=float, default=0.0,
                        help="stall floor right after a reset, for the startup windows (default: 0)")
    parser.add_argument("--state", default=None,
                        help="a saved optimizer state (lightning_stale QuantizedAdamW, bitsandbytes 8-bit, torchao "
                             "low-bit, or torch Adam with bf16/fp16 states): a torch.save'd state_dict or a checkpoint "
                             "holding one, as `lightning-stale inspect` reads it; estimate from the stored v of every "
                             "optimizer in it (overrides --format)")


def run(args: argparse.Namespace) -> int:
    try:
        lines = report(args)
    except (ValueError, OSError) as error:
        print(f"lightning-stale period: error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def report(args: argparse.Namespace) -> list[str]:
    """The printed report, line by line."""
    from lightning_stale import theory

    beta2 = args.beta2 if args.beta2 is None else theory.check_beta(args.beta2, "beta2")
    if args.state is not None:
        from lightning_stale.adapters.saved_state import load_v_sample

        values, spacing, saved_beta2, described = load_v_sample(args.state, SAMPLE_LIMIT)
        beta2 = beta2 if beta2 is not None else (saved_beta2 if saved_beta2 is not None else 0.999)
        grid = theory.estimate_grid(values, spacing, beta2, args.s0)
        source = [f"model: grid estimate from {grid.n:,} stored v values of {args.state} ({described})",
                  "       [our extension of the paper's model, not the paper's]"]
        rho = grid.rho_hat
    elif args.fmt == "int8_dynamic":
        beta2 = 0.999 if beta2 is None else beta2
        values, spacing = synthetic_int8_sample()
        grid = theory.estimate_grid(values, spacing, beta2, args.s0)
        source = [f"model: grid estimate (our extension, not the paper's) on a synthetic sample: {grid.n:,} log-normal",
                  "       v values in blocks of 256 stored in the 8-bit dynamic map; an estimate, pass --state",
                  "       for your own optimizer's states"]
        rho = grid.rho_hat
    else:
        beta2 = 0.999 if beta2 is None else beta2
        name = ALIASES.get(args.fmt, args.fmt)
        eps = theory.format_epsilon(name)
        rho, grid = theory.rho_hat(eps, beta2), None
        source = [f"model: the paper's float-grid model (Topollai & Choromanska, arXiv 2603.16731), {name}, "
                  f"eps = 2^{round(math.log2(eps))}"]

    p_nr = theory.stall_probability(rho, "nearest")
    p_sr = theory.stall_probability(rho, "stochastic")
    p_used = p_nr if args.rounding == "nearest" else p_sr
    horizon = theory.effective_horizon(beta2, p_used)
    k_star = theory.reset_period(rho, beta2, args.s0)
    lines = [f"lightning-stale period: beta2 = {beta2}, s0 = {args.s0}, rounding = {args.rounding}", *source, ""]
    if grid is not None:
        q = grid.r_quantiles
        lines.append(f"  relative spacing r = ulp/v   10%: {q[0.1]:.3%}  50%: {q[0.5]:.3%}  90%: {q[0.9]:.3%}"
                     f"  effective (harmonic mean): {grid.r_effective:.3%}")
    lines += [
        f"  rho-hat                      {rho:.3g}",
        f"  steady stall, nearest        {p_nr:.3f}",
        f"  steady stall, stochastic     {p_sr:.3f}",
        f"  effective v horizon ({args.rounding}) {_steps(horizon)} (fp32: {_steps(1 / (1 - beta2))})",
        f"  startup window j*(P0) with P_init = {args.p_init:g} (updates until the stall fraction reaches P0):",
    ]
    for p0 in STARTUP_THRESHOLDS:
        j = theory.startup_window(p0, rho, beta2, args.p_init)
        lines.append(f"      P0 = {p0:.2f}: {'never (above the steady state)' if j is None else f'{j} steps'}")
    lines.append(f"  recommended reset period K* (s0 = {args.s0:g}): {_steps(k_star)}")
    sweep = "  ".join(f"{s0:g}: {_steps(theory.reset_period(rho, beta2, s0))}" for s0 in S0_SWEEP)
    lines.append(f"  s0 sweep: {sweep}")
    if p_used < 0.5:
        lines.append(f"  note: only {p_used:.0%} of v updates stall at steady state; resets are unlikely to pay off "
                     "(the paper found them slightly harmful on fp32 states)")
    if rho < 1:
        lines.append("  note: rho-hat < 1, K* uses Eq. 39 with its lower term (our extension; the paper's Eq. 53 "
                     "needs rho-hat >= 1)")
    return lines


def synthetic_int8_sample(n_blocks: int = 512, block_size: int = 256, log_std: float = 1.5, seed: int = 0):
    """A representative v for the 8-bit dynamic map: log-normal values (ln-std ``log_std``, about 1.3 decades either
    side) in blocks of 256, stored with :mod:`lightning_stale.formats` ``int8_dynamic``; returns (values, spacing)."""
    import torch

    from lightning_stale.formats import get_format

    gen = torch.Generator().manual_seed(seed)
    v = torch.exp(torch.randn(n_blocks * block_size, generator=gen) * log_std)
    fmt = get_format("int8_dynamic", signed=False)
    q = fmt.quantize(v)
    return fmt.dequantize(q), fmt.spacing(q)


def _steps(k: float | int | None) -> str:
    if k is None:
        return "none found"
    if k == math.inf:
        return "infinite"
    return f"{round(k):,} steps" if k < 1e7 else f"{k:.2g} steps"
