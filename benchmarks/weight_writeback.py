"""Cost of the weight write-back against a bf16-true training step of the demo decoder, side by side in one run.

Two identical bf16 models, one with plain ``torch.optim.AdamW`` and one with the same optimizer plus
:class:`WeightWriteBack`, step alternately on the same batches; the medians of the whole training step (forward,
backward, optimizer step) give the ratio ``(with - plain) / plain``. The write-back's own post-hook is also timed
directly, between two timing hooks registered around it, as a ratio of the plain step (less noisy on a shared
machine). Run: ``python benchmarks/weight_writeback.py``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

from lightning_stale.act.weights import ROUNDINGS, WeightWriteBack
from lightning_stale.demo.model import Decoder, DecoderConfig


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    """One bf16-true step (forward, backward, optimizer step); returns its wall time in seconds."""
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounding", choices=ROUNDINGS, default="stochastic")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = DecoderConfig(dim=64, hidden=176, context=64, n_layers=2, n_heads=4)
    plain = Decoder(config).to(torch.bfloat16)
    taken = copy.deepcopy(plain)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=2e-3, foreach=args.foreach)
    opt_taken = torch.optim.AdamW(taken.parameters(), lr=2e-3, foreach=args.foreach)
    hook_times: list[float] = []
    opt_taken.register_step_post_hook(lambda *_: hook_times.append(-time.perf_counter()))  # runs before the write
    writeback = WeightWriteBack(opt_taken, args.rounding)
    opt_taken.register_step_post_hook(lambda *_: hook_times.append(hook_times.pop() + time.perf_counter()))
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"plain": [], "writeback": []}
    for step in range(args.steps + 5):
        tokens = torch.randint(0, config.vocab_size, (args.batch, config.context + 1), generator=gen)
        pair = (("plain", plain, opt_plain), ("writeback", taken, opt_taken))
        for name, model, opt in pair if step % 2 else pair[::-1]:
            elapsed = train_step(model, opt, tokens)
            if step >= 5:  # warm-up steps excluded
                times[name].append(elapsed)
    plain_ms, taken_ms = (1e3 * statistics.median(times[k]) for k in ("plain", "writeback"))
    hook_ms = 1e3 * statistics.median(hook_times[5:])
    params = sum(p.numel() for p in plain.parameters())
    print(f"demo decoder {params:,} bf16 parameters, batch {args.batch}, context {config.context}, "
          f"torch AdamW foreach={args.foreach}, rounding {args.rounding}, {torch.get_num_threads()} threads")
    print(f"median step: plain {plain_ms:.2f} ms, with write-back {taken_ms:.2f} ms, "
          f"ratio {(taken_ms - plain_ms) / plain_ms:+.1%}")
    print(f"write-back post-hook: median {hook_ms:.2f} ms, {hook_ms / plain_ms:.1%} of the plain step")
    writeback.close()


if __name__ == "__main__":
    main()
