"""Largest parameter update after a reset, in units of lr, for every optimizer family, state format and rounding.

A small MLP (``32 -> 256 -> 256 -> 8``, ReLU, regression on fixed random data) trains with weight decay 0 and
lr 1e-3. The monitor resets the chosen moments of every parameter once, after optimizer step ``--at``; the table
shows the largest ``|p_{t+1} - p_t| / lr`` over every element in the ``--window`` steps after the reset, next to the
same statistic over the same steps of the run without a reset (the same monitor options, monitoring only; Adam's
own steps reach about 1-3 lr). Run:

    .venv/bin/python benchmarks/reset_safety.py --at 8 60 --window 20 [--torchao]
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from lightning_stale import StaleStateMonitor
from lightning_stale.optim import QuantizedAdamW
from lightning_stale.policies import ResetPolicy

LR = 1e-3


class ResetOnce(ResetPolicy):
    """Reset every parameter after optimizer step ``at``."""

    needs_sync = False

    def __init__(self, at: int, moments, **options) -> None:
        super().__init__(moments)
        self.at = at

    def should_reset(self, unit, step: int) -> bool:
        return step == self.at

    def due(self, ledger, step: int) -> np.ndarray:
        return np.full(len(ledger.rows), step == self.at)


def optimizers(torchao: bool) -> dict[str, Callable]:
    import bitsandbytes as bnb

    out: dict[str, Callable] = {
        "bnb AdamW8bit": lambda p: bnb.optim.AdamW8bit(p, lr=LR, weight_decay=0.0, min_8bit_size=256),
        "torch AdamW bf16": lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.0),
    }
    if torchao:
        from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

        for name, cls in (("AdamW8bit", AdamW8bit), ("AdamW4bit", AdamW4bit), ("AdamWFp8", AdamWFp8)):
            out[f"torchao {name}"] = lambda p, c=cls: c(p, lr=LR, weight_decay=0.0, block_size=128 if "4" in name
                                                       else 256)
    for fmt in ("bf16", "fp8_e4m3", "fp4", "int8_dynamic"):
        for rounding in ("nearest", "stochastic"):
            out[f"QuantizedAdamW {fmt} {rounding}"] = lambda p, f=fmt, r=rounding: QuantizedAdamW(
                p, lr=LR, weight_decay=0.0, state_format=f, rounding=r, min_quantized_size=256, compile=False)
    return out


def largest_updates(make: Callable, bf16: bool, steps: int, reset: tuple, seed: int = 0) -> np.ndarray:
    """Per step: the largest |update| / lr over all elements, under a monitor that resets after step ``reset[0]``
    (never for None) with the given monitor options."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    if bf16:
        model = model.bfloat16()
    opt = make(list(model.parameters()))
    at, moments, options = reset
    monitor = StaleStateMonitor(opt, reset=ResetOnce(at, moments) if at is not None else None, **options)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(512, 32, generator=g), torch.randn(512, 8, generator=g)
    out = []
    for step in range(steps):
        batch = torch.randint(0, 512, (32,), generator=g)
        before = [p.detach().float().clone() for p in model.parameters()]
        loss = nn.functional.mse_loss(model(x[batch].to(model[0].weight.dtype)).float(), y[batch])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(max(float((p.detach().float() - b).abs().max()) for p, b in zip(model.parameters(), before)) / LR)
    monitor.close()
    return np.array(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--at", type=int, nargs="+", default=[40, 150], help="optimizer steps after which to reset")
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--torchao", action="store_true", help="include torchao (compiles its step: slow on CPU)")
    parser.add_argument("--only", default="", help="only optimizers whose name contains this text")
    parser.add_argument("--options", default="",
                        help="extra monitor options, e.g. \"underflow_guard=True\" or \"v_reset='exact-unbounded'\"")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = dict(eval(f"dict({args.options})"))  # noqa: S307 - a command-line convenience for this benchmark
    steps = max(args.at) + args.window + 1
    print(f"largest |update| / lr in the {args.window} steps after a reset at step {args.at} (lr {LR}, weight decay 0)"
          + (f", monitor options {options}" if options else ""))
    print("\n| optimizer | reset at | no reset | full reset | v-only reset |")
    print("|---|---|---|---|---|")
    has_torchao = args.torchao and importlib.util.find_spec("torchao") is not None
    for name, make in optimizers(has_torchao).items():
        if args.only and args.only not in name:
            continue
        bf16 = "bf16" in name and name.startswith("torch")
        plain = largest_updates(make, bf16, steps, (None, ("m", "v"), options))
        for at in args.at:
            window = slice(at, at + args.window)
            full = largest_updates(make, bf16, steps, (at, ("m", "v"), options))
            v_only = largest_updates(make, bf16, steps, (at, ("v",), options))
            print(f"| {name} | {at} | {plain[window].max():.2f} | {full[window].max():.2f} | "
                  f"{v_only[window].max():.2f} |", flush=True)


if __name__ == "__main__":
    main()
