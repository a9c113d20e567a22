"""Which moment carries a format's loss gap, and is it staleness or rounding error?

QuantizedAdamW with the format in m, in v or in both, against fp32 states; then, with the format in v only, three
ways of changing how v is stored: stochastic rounding, and v *refreshed* from an exact fp32 shadow EMA of the same
gradients (every element rewritten as the nearest grid value of the shadow) every step or every 100 steps. A refresh
every step leaves v with one rounding error and no accumulated staleness; every 100 steps lets staleness build up for
at most 100 steps. If the refreshed runs close the gap, staleness (the stored value lagging the EMA) carries it; if
they do not, the per-step rounding error does. The fp32 shadow costs 4 bytes per element: a probe, not a remedy.

The demo's model and training loop (:mod:`lightning_stale.demo`, monitor only), by default fp4 at lr 4e-3 (2x fp32's
best: where fp4 loses loss at CPU scale), 600 steps, seeds 0, 1 and 2, two single-thread runs at a time. Prints one
row per variant and its gap to fp32, seed by seed and paired (mean ± std). Run:

    .venv/bin/python benchmarks/moment_formats.py [--format fp4] [--lr 4e-3] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

REFRESH_EVERY = (1, 100)


def variants(fmt: str) -> dict[str, tuple[str, str, int | None]]:
    """Variant name -> (the demo's ``"<m format>/<v format>"``, rounding, refresh period of v or None)."""
    table = {"fp32": ("fp32/fp32", "nearest", None), fmt: (f"{fmt}/{fmt}", "nearest", None),
             f"{fmt} in m": (f"{fmt}/fp32", "nearest", None), f"{fmt} in v": (f"fp32/{fmt}", "nearest", None),
             f"{fmt} in v stochastic": (f"fp32/{fmt}", "stochastic", None)}
    for every in REFRESH_EVERY:
        table[f"{fmt} in v refreshed/{every}"] = (f"fp32/{fmt}", "nearest", every)
    return table


def shadow_refresh(every: int):  # noqa: ANN201 (a Lightning callback, imported in the worker)
    """A callback keeping an fp32 EMA of g^2 per parameter beside QuantizedAdamW's v and writing its nearest grid
    value into v after every ``every``-th step (in place, through the optimizer's own format)."""
    import torch
    from lightning.pytorch.callbacks import Callback

    class ShadowRefresh(Callback):
        def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            optimizer = trainer.optimizers[0]
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            shadows: dict[int, torch.Tensor] = {}
            steps = [0]

            @torch.no_grad()
            def after_step(opt, *_) -> None:  # noqa: ANN001
                steps[0] += 1
                for group in opt.param_groups:
                    beta2 = group["betas"][1]
                    for p in group["params"]:
                        if p.grad is None or not opt.state[p]:
                            continue
                        shadow = shadows.setdefault(id(p), torch.zeros_like(p, dtype=torch.float32))
                        shadow.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                        fmt = opt.moment_format(p, "v")
                        if steps[0] % every == 0 and fmt.name != "fp32":
                            fmt.quantize_into(opt.moment_state(p, "v"), shadow)

            optimizer.register_step_post_hook(after_step)

    return ShadowRefresh()


def run(job: tuple[str, str, str, int | None, int, int, float, str]) -> tuple[str, int, float, float, float]:
    name, state_format, rounding, every, seed, steps, lr, out = job
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from lightning_stale.demo.configs import CONFIGS, DemoSettings
    from lightning_stale.demo.model import DecoderConfig
    from lightning_stale.demo.training import prepare_corpus, train_config

    # the 0.5M-parameter decoder (dim 128) its recorded runs used
    settings = DemoSettings(steps=steps, seed=seed, lr=lr, model=DecoderConfig(), progress_bar=False)
    config = replace(CONFIGS["fp4"], name=name.replace(" ", "-").replace("/", "-"), state_format=state_format,
                     rounding=rounding)
    callbacks = [shadow_refresh(every)] if every else []
    result = train_config(config, settings, prepare_corpus(settings), Path(out), extra_callbacks=callbacks)
    return name, seed, result.val_loss, result.v_frac, result.v_drift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="fp4", help="a QuantizedAdamW format other than fp32")
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--only", default=None, help="comma list of variant names to run (fp32 always runs)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="out/moment_formats")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = variants(args.format)
    if args.only:
        keep = {"fp32", *(n.strip() for n in args.only.split(","))}
        chosen = {k: v for k, v in chosen.items() if k in keep}
    jobs = [(name, fmt, rounding, every, seed, args.steps, args.lr, args.out) for seed in seeds
            for name, (fmt, rounding, every) in chosen.items()]
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(run, jobs))
    print(f"lr {args.lr}, {args.steps} steps; final validation loss (v stall fraction, v drift)\n")
    print("| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | gap to fp32 per seed | paired gap |")
    print("|---|" + "---|" * len(seeds) + "---|---|")
    by_run = {(name, seed): (value, frac, drift) for name, seed, value, frac, drift in results}
    for name in chosen:
        cells = [f"{by_run[name, s][0]:.4f} ({by_run[name, s][1]:.2f}, {by_run[name, s][2]:.2f})" for s in seeds]
        gaps = [by_run[name, s][0] - by_run["fp32", s][0] for s in seeds]
        spread = f" ± {statistics.stdev(gaps):.3f}" if len(gaps) > 1 else ""
        print(f"| {name} | " + " | ".join(cells) + f" | {', '.join(f'{g:+.3f}' for g in gaps)} | "
              f"{statistics.fmean(gaps):+.3f}{spread} |")


if __name__ == "__main__":
    main()
