"""Live against offline rho-hat: the grid estimate the monitor holds during a run, and the one
``lightning-stale inspect`` takes from a checkpoint of the same step, per 8-bit parameter.

The long plan's set-up (the demo's 0.13M model, lr 2e-3, b2 0.999, bitsandbytes AdamW8bit, 128-element 8-bit
threshold) in a plain loop with ``StaleStateMonitor(coverage_steps=50)``; at each step asked for, the optimizer state
is saved, inspected, and compared with ``monitor.rows()``. The first column is the estimate of the first measured
step, which lightning_stale 0.1 kept for the whole run.

    python benchmarks/settled_rho.py --steps 100,400,1000,2000
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="100,400,1000,2000", help="steps to compare at (comma-separated)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    marks = sorted(int(s) for s in args.steps.split(","))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    from lightning_stale import StaleStateMonitor
    from lightning_stale.commands.inspect import build_report
    from lightning_stale.demo.configs import DemoSettings
    from lightning_stale.demo.model import DecoderConfig, LanguageModel, OptimizerSpec, warmup_cosine
    from lightning_stale.demo.training import prepare_corpus

    total = 5000  # the long plan's schedule (warm-up and cosine decay over 5,000 steps)
    settings = DemoSettings(steps=total, seed=args.seed, lr=2e-3, progress_bar=False,
                            model=DecoderConfig(dim=64, n_layers=2, n_heads=4, hidden=176, context=64))
    torch.manual_seed(args.seed)
    spec = OptimizerSpec(kind="bnb_adamw8bit", lr=2e-3, betas=(0.9, 0.999), eps=settings.eps, min_quantized_size=128)
    model = LanguageModel(settings.model, spec, total_steps=total)
    optimizer = spec.build(list(model.parameters()))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, total, 0.1, 0.1))
    monitor = StaleStateMonitor(optimizer, names=model, coverage_steps=50)
    names = {id(p): n for n, p in model.named_parameters()}
    first: dict[str, float] = {}
    print(f"bnb AdamW8bit, demo model (dim 64), lr 2e-3, b2 0.999, seed {args.seed}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        for step, batch in enumerate(prepare_corpus(settings).train_loader(total, 16, args.seed), 1):
            model.loss(batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            live = {names[id(u.param)]: u.rho for u in monitor.rows() if u.rho is not None}
            for name, rho in live.items():  # each parameter's first estimate (at its first measurement)
                first.setdefault(name, rho)
            if step not in marks:
                continue
            path = Path(folder) / f"step{step}.pt"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            offline = {row.name: m.rho for row in build_report(str(path)).optimizers[0].params for m in row.moments
                       if m.moment == "v" and m.rho is not None and m.format != "fp32"}
            diffs = [(abs(live[n] / rho - 1), n, live[n], rho) for n, rho in offline.items() if n in live]
            worst = max(diffs)
            print(f"step {step:>5}: {len(diffs)} parameters, live vs offline max |rel diff| {worst[0]:.1%} "
                  f"({worst[1]}: {worst[2]:.3g} vs {worst[3]:.3g}); first measured estimate vs offline "
                  f"{max(abs(first[n] / rho - 1) for _, n, _, rho in diffs):.0%} at most")
            if step >= marks[-1]:
                break


if __name__ == "__main__":
    main()
