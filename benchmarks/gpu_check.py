"""The prepared GPU check: one command, at most ~8 minutes on one GPU, every result printed and written to a folder.

1. The CUDA half of the device-parametrized tests (``pytest -k cuda``): engine, monitor, adapters' resets, guard,
   ``QuantizedAdamW`` eager and compiled, a Trainer fit with bitsandbytes AdamW8bit.
2. bitsandbytes' CUDA kernel: stall fractions logged by the monitor (exact and sample mode) against an independent
   clone-and-compare of the stored codes, step by step.
3. The tensor-count overhead sweep of ``benchmarks/overhead.py`` on CUDA (16 ... 1024 tensors, default/exact/theory).
4. Optimizer step time on CUDA: ``QuantizedAdamW`` (compiled) against bitsandbytes AdamW8bit
   (``benchmarks/optimizer_step.py --device cuda``).

On the lent device (no network), with wheels downloaded here into ``wheels/`` and carried::

    pip install --no-deps wheels/*.whl && pip install --no-deps -e . && python benchmarks/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(name: str, command: list[str], out: Path, timeout: int) -> dict:
    """Run one part, tee its output into ``out/<name>.txt``; a failure is recorded, not raised."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as error:
        text, code = f"{error.stdout or ''}{error.stderr or ''}\nTIMEOUT after {timeout} s", 124
    (out / f"{name}.txt").write_text(text)
    seconds = time.perf_counter() - start
    print(f"== {name}: exit {code} in {seconds:.0f} s\n{text[-4000:]}", flush=True)
    return {"name": name, "exit": code, "seconds": round(seconds, 1)}


def stall_check() -> None:
    """bitsandbytes AdamW8bit on CUDA: the monitor's exact and sample fractions against clone-and-compare."""
    import bitsandbytes as bnb
    import torch
    from torch import nn

    from lightning_stale import StaleStateMonitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)).cuda()
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    probe: list[float] = []
    before: dict = {}

    def pre(o, args, kwargs):
        before.clear()
        before.update({p: o.state[p]["state2"].clone() for p in o.state if o.state[p]})

    def post(o, args, kwargs):
        stalled = counted = 0
        for p, old in before.items():
            mask = (p.grad != 0) & torch.isfinite(p.grad)
            stalled += int(((o.state[p]["state2"] == old) & mask).sum())
            counted += int(mask.sum())
        if before:
            probe.append(stalled / counted)

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    exact = StaleStateMonitor(opt, track="exact")
    rows = []
    for step in range(200):
        x = torch.randn(64, 512, device="cuda")
        nn.functional.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        if probe:
            rows.append((step, exact.compute().get("stale/v/frac"), probe[-1]))
            exact.reset_window()  # one step per row, like the probe
    exact.close()
    worst = max(abs(a - b) for _, a, b in rows if a is not None)
    print(f"bnb CUDA AdamW8bit, 200 steps: monitor exact vs clone-and-compare, largest difference {worst:.2e}; "
          f"last step {rows[-1][1]:.4f} vs {rows[-1][2]:.4f}")
    sample = StaleStateMonitor(opt, coverage_steps=10)
    probe.clear()
    for _ in range(50):
        x = torch.randn(64, 512, device="cuda")
        nn.functional.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    print(f"sample mode over the next 50 steps: {sample.compute()['stale/v/frac']:.4f}; clone-and-compare mean "
          f"{sum(probe) / len(probe):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check")
    parser.add_argument("--part", choices=["stalls"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "stalls":
        stall_check()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    parts = [
        ("tests-cuda", [python, "-m", "pytest", "-q", "-k", "cuda", "-p", "no:cacheprovider", "tests"], 240),
        ("bnb-cuda-stalls", [python, __file__, "--part", "stalls"], 60),
        ("overhead-sweep", [python, "benchmarks/overhead.py", "--device", "cuda", "--rounds", "2", "--steps", "60"],
         240),
        ("optimizer-step", [python, "benchmarks/optimizer_step.py", "--device", "cuda", "--steps", "20",
                            "--only", "QuantizedAdamW int8_dynamic"], 120),
    ]
    results = [run(name, command, args.out, timeout) for name, command, timeout in parts]
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
