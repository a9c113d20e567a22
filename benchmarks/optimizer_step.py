"""Step time of AdamW variants on a ~10M-parameter MLP, as ratios to bitsandbytes AdamW8bit (CPU or ``--device cuda``).

Fixed random gradients, ``opt.step()`` only, median over ``--steps`` interleaved steps after ``--warmup`` warm-up
steps. The first step (lazy state creation; torch.compile for torchao and for QuantizedAdamW, whose default
``compile=None`` compiles when a C++ compiler is present) is reported separately. Run:

    .venv/bin/python benchmarks/optimizer_step.py --steps 20 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch._inductor.config

from lightning_stale import _compat
from lightning_stale.formats import get_format
from lightning_stale.optim import QuantizedAdamW

BASELINE = "bnb AdamW8bit"


def make_model() -> torch.nn.Module:
    """MLP 1024->2048->2048->1024->1536 (9.97M parameters; its biases are below the 4096 quantization threshold)."""
    sizes = [1024, 2048, 2048, 1024, 1536]
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])


def optimizer_factories() -> dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    """Every optimizer to time, by display name; optional libraries are skipped when not importable."""
    factories: dict[str, Callable] = {
        "torch AdamW (foreach)": lambda p: torch.optim.AdamW(p, foreach=True),
        "torch AdamW (fused)": lambda p: torch.optim.AdamW(p, fused=True),
    }
    try:
        import bitsandbytes as bnb

        factories[BASELINE] = lambda p: bnb.optim.AdamW8bit(p)
    except ImportError:
        pass
    try:
        from torchao.optim import AdamW8bit, AdamWFp8

        factories["torchao AdamW8bit"] = lambda p: AdamW8bit(p)
        factories["torchao AdamWFp8"] = lambda p: AdamWFp8(p)
    except ImportError:
        pass
    for fmt in ("fp32", "bf16", "fp16", "fp8_e4m3", "fp4", "int8_dynamic"):
        for rounding in ("nearest", "stochastic"):
            factories[f"QuantizedAdamW {fmt} {rounding}"] = (
                lambda p, f=fmt, r=rounding: QuantizedAdamW(p, state_format=f, rounding=r)
            )
    for fmt in ("int8_dynamic", "bf16"):  # the optimizer's own exact stall counts (off by default)
        factories[f"QuantizedAdamW {fmt} nearest, counting stalls"] = lambda p, f=fmt: QuantizedAdamW(
            p, state_format=f, count_stalls=True
        )
    for fmt in ("bf16", "fp8_e4m3", "int8_dynamic"):
        factories[f"QuantizedAdamW {fmt} nearest, eager"] = lambda p, f=fmt: QuantizedAdamW(
            p, state_format=f, compile=False
        )
    return factories


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state (tensor subclasses counted through their inner tensors);
    maps shared by all parameters (bitsandbytes qmap) are counted once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        inner = getattr(t, "__tensor_flatten__", None)
        if inner is not None and type(t) is not torch.Tensor:
            for name in inner()[0]:
                add(getattr(t, name))
            return
        if t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()

    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    return total


def benchmark(
    factories: dict[str, Callable], steps: int, warmup: int, seed: int = 0, device: str = "cpu"
) -> list[tuple[str, float, float, float]]:
    """Per optimizer: (name, first step seconds, median ms per later step, state bytes per parameter).

    Timed steps are interleaved round-robin across all optimizers (rotating the order each round), so load from other
    processes on a shared machine slows every optimizer alike instead of whichever happens to run at that moment.
    """
    runs = []
    for name, factory in factories.items():
        torch.manual_seed(seed)
        params = list(make_model().to(device).parameters())
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = factory(params)
        start = time.perf_counter()
        optimizer.step()
        _sync(device)
        first = time.perf_counter() - start
        for _ in range(warmup):
            optimizer.step()
        runs.append((name, optimizer, first, sum(p.numel() for p in params)))
        print(f"  set up {name} (first step {first:.2f} s)", flush=True)
    times: dict[str, list[float]] = {name: [] for name, *_ in runs}
    for round_index in range(steps):
        shift = round_index % len(runs)
        for name, optimizer, _, _ in runs[shift:] + runs[:shift]:
            start = time.perf_counter()
            optimizer.step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return [
        (name, first, statistics.median(times[name]) * 1e3, state_bytes(optimizer) / numel)
        for name, optimizer, first, numel in runs
    ]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--only", default="", help="run only optimizers whose name contains this text (and the baseline)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Cold compiles: a fresh Inductor cache, so first-step times include code generation and the C++ build.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="optimizer_step_inductor_")
    torch._inductor.config.fx_graph_cache = False
    # One compiled QuantizedAdamW step per format pair, rounding and stall counting: more than dynamo's default 8.
    setattr(torch._dynamo.config, _compat.recompile_limit_name(torch._dynamo.config) or "recompile_limit", 64)

    factories = {
        name: factory
        for name, factory in optimizer_factories().items()
        if not args.only or args.only in name or name == BASELINE
    }
    rows = benchmark(factories, args.steps, args.warmup, device=args.device)
    baseline = next((ms for name, _, ms, _ in rows if name == BASELINE), None)
    numel = sum(p.numel() for p in make_model().parameters())
    print(f"\n{numel / 1e6:.2f}M parameters on {args.device}, {args.threads} threads, median of {args.steps} interleaved steps after "
          f"{args.warmup} warm-up steps, torch {torch.__version__}\n")
    print("| Optimizer | Median ms/step | Ratio to bnb AdamW8bit | First step s | State bytes/param |")
    print("|---|---|---|---|---|")
    for name, first, median_ms, bpp in rows:
        ratio = f"{median_ms / baseline:.2f}" if baseline else "n/a"
        print(f"| {name} | {median_ms:.1f} | {ratio} | {first:.2f} | {bpp:.3f} |")
    n = 1 << 22
    storage = {
        name: get_format(name, True).bytes_per_element(n) + get_format(name, False).bytes_per_element(n)
        for name in ("fp32", "bf16", "fp16", "fp8_e4m3", "fp4", "int8_dynamic")
    }
    print("\nFormat storage (both moments, scales included, for a 4M-element tensor): "
          + ", ".join(f"{name} {size:.3f}" for name, size in storage.items()))


if __name__ == "__main__":
    main()
