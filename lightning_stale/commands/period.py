"""``lightning-stale period``: predicted staleness and the recommended reset period for a state format and b2."""

from __future__ import annotations

import argparse
import math
import sys

HELP = ("Predict how v stalls on a storage format (rho-hat, the settled stall share, its build-up after a reset) and "
        "the theory's reset period K*, with what was measured about resets there.")

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
                        help="share of v's updates that already stall right after a reset (the paper's P_init), for "
                             "the build-up after a reset (default: 0)")
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
    fp32 = 1 / (1 - beta2)
    lines = [f"lightning-stale period: beta2 = {beta2}, s0 = {args.s0}, rounding = {args.rounding}", *source, ""]
    if grid is not None:
        q = grid.r_quantiles
        lines.append(f"  relative spacing r = ulp/v   10%: {q[0.1]:.3%}  50%: {q[0.5]:.3%}  90%: {q[0.9]:.3%}"
                     f"  effective (harmonic mean): {grid.r_effective:.3%}")
    memory = f"{_steps(horizon)} (fp32: {_steps(fp32)})"
    if horizon > 100 * fp32:
        memory += ": in this model v practically stops following new gradients"
    lines += [
        f"  rho-hat                      {rho:.3g}  "
        f"({'>= 1: a settled v mostly stalls' if rho >= 1 else '< 1: v keeps moving'})",
        f"  steady stall, nearest        {p_nr:.3f}  (share of v's updates that round back once v has settled)",
        f"  steady stall, stochastic     {p_sr:.3f}",
        f"  {f'v averages over ({args.rounding})':<29}{memory}",
        f"  steps after a reset (or the start) until this share of v's updates stall, from {args.p_init:.0%} right "
        "after it (--p-init):",
    ]
    for p0 in STARTUP_THRESHOLDS:
        j = theory.startup_window(p0, rho, beta2, args.p_init)
        lines.append(f"      {p0:.0%}: {'never (above the settled share)' if j is None else f'{j:,} steps'}")
    lines.append(f"  the theory's reset period K* (s0 = {args.s0:g}): {_steps(k_star)}")
    sweep = "  ".join(f"{s0:g}: {_steps(theory.reset_period(rho, beta2, s0))}" for s0 in S0_SWEEP)
    lines.append(f"  K* at other s0: {sweep}")
    if p_used < 0.5:
        lines.append(f"  note: only {p_used:.0%} of v updates stall at steady state; resets are unlikely to pay off "
                     "(the paper found them slightly harmful on fp32 states)")
    if rho < 1:
        lines.append("  note: rho-hat < 1, K* uses Eq. 39 with its lower term (our extension; the paper's Eq. 53 "
                     "needs rho-hat >= 1)")
    storage = args.fmt if args.state is None else storage_of(described)
    lines += ["", *measured(storage), "", *LEGEND]
    return lines


# What this project's benchmarks measured about resets, per storage (BENCHMARKS.md, "recovery": 5,000 steps of a
# 0.13M-parameter decoder at lr 2e-3, b2 = 0.999, 5 seeds; change in validation loss, paired by seed, [95% interval]).
MEASURED_SETUP = ("measured here (BENCHMARKS.md: 5,000 steps of a 0.13M-parameter decoder at lr 2e-3, b2 = 0.999, "
                  "5 seeds; change in validation loss paired by seed, [95% interval]):")
BNB_8BIT = ("bitsandbytes AdamW8bit (8-bit map, blocks of 256): most v updates stall, yet v follows its fp32 average: "
            "stale but harmless. Resets of both moments every K* steps +0.008 [-0.005, +0.022]; resets of v alone "
            "(moments=('v',)) -0.010 [-0.021, +0.000], better in all 5 seeds but not significant; remedy='auto' left "
            "it bit-identical.")
MEASURED = {
    "bf16": "QuantizedAdamW with bf16 moments (fp32 weights): resets were not measured. Nearest rounding lets v drift "
            "to 1.44x its fp32 average; stochastic rounding from step 2 (remedy='auto') improved the loss, -0.013 "
            "[-0.020, -0.005]. With bf16 weights (bf16-true) the weights' stall costs far more than the states' "
            "(docs/weights.md).",
    "fp8_e4m3": "QuantizedAdamW with fp8 moments, one scale per tensor: resets of both moments every K* steps made the "
                "loss worse in every seed, +0.013 [+0.006, +0.020] (v restarts from zero and its small elements stay "
                "there); resets of v alone -0.024 [-0.050, +0.002], not significant. What helped: the underflow "
                "guard, -0.038 [-0.073, -0.003], and remedy='auto', -0.036 [-0.068, -0.004]. These measurements do "
                "not support resets of both moments on this storage.",
    "fp4_e2m2": "QuantizedAdamW with fp4 moments (blocks of 128): resets were not measured; remedy='auto' -0.004 "
                "[-0.012, +0.003], no significant change. What fp4 costs comes from v's resolution, not its "
                "staleness: refreshing v from an exact fp32 average after every step left the gap where it was, so "
                "no reset can recover it.",
    "int8_dynamic": "QuantizedAdamW with the 8-bit dynamic map: resets were not measured; remedy='auto' -0.001 "
                    "[-0.003, +0.002]. " + BNB_8BIT,
    "bnb8bit": BNB_8BIT,
}
MEASURED_ALWAYS = ("At this scale resets of both moments paid on no storage measured; the paper's gains come from runs "
                   "of 10K-60K steps on larger models. K* is the theory's period, not a measured gain: if you try "
                   "resets, watch the logged metrics and the loss on your own run.")
LEGEND = [
    "what these mean:",
    "  rho-hat: how coarse the storage grid is for v, the running average of squared gradients: the grid's relative",
    "    gap over what one step can move v, 2 (1 - beta2). At 1 or more, most steps of a settled v are under half a",
    "    gap and round back: v stalls.",
    "  steady stall: the share of v's updates that round back once v has settled, with nearest and with stochastic",
    "    rounding. v averages over: how many recent steps v effectively averages (1 / (1 - beta2) in fp32); stalled",
    "    updates stretch it.",
    "  s0: the stalled share the reset rule tolerates (the paper's 0.6). K*: the period after which the stall built up",
    "    since a reset outweighs what restarting the average costs (the paper's rule, a prediction of its theory).",
]


def measured(storage: str | None) -> list[str]:
    """What this project measured about resets on ``storage`` (a --format name or 'bnb8bit'), as wrapped lines."""
    import textwrap

    fact = MEASURED.get(ALIASES.get(storage or "", storage or ""))
    text = fact if fact is not None else "nothing was measured on this storage."
    return [*textwrap.wrap(MEASURED_SETUP, 118, subsequent_indent="  "),
            *textwrap.wrap(f"{text} {MEASURED_ALWAYS}", 118, initial_indent="  ", subsequent_indent="  ")]


def storage_of(described: str) -> str | None:
    """The measured storage a saved state's description (``load_v_sample``'s) names, if any."""
    if "bitsandbytes 8-bit" in described:
        return "bnb8bit"
    for name in (*PAPER_FORMATS, "int8_dynamic"):
        if f"QuantizedAdamW {name}" in described:
            return name
    if "torch bfloat16" in described:
        return "bf16"
    return None


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
