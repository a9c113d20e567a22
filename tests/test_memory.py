"""What the monitor keeps, counted by an independent walk of every object it references (benchmarks/memory.py):
``resident_bytes()`` reports all of it, and at GPT-2 shapes of 20M parameters it stays under 1% of the optimizer
state it watches. What it allocates during a step beyond that does not grow with the largest tensor."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")


def _memory_benchmark():
    path = Path(__file__).parents[1] / "benchmarks" / "memory.py"
    spec = importlib.util.spec_from_file_location("memory_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_monitor_memory_is_all_counted_and_under_one_percent_of_the_state_at_20m_parameters():
    result = _memory_benchmark().measure("bnb", layers=10, width=256, steps=5, coverage=4)
    assert result["params"] >= 20_000_000 and result["tensors"] > 100
    assert result["walked_bytes"] > 0
    assert result["resident_bytes"] == result["walked_bytes"]  # nothing held that resident_bytes() leaves out
    assert result["walked_bytes"] <= 0.01 * result["state_bytes"]


def _monitored_peak(rows: int, kind: str, options: dict) -> int:
    """The largest transient peak of the monitor's step hooks and ``compute()`` over twelve steps (the first
    measurement, a check step and a compute among them) on a model whose largest tensor is an embedding of
    ``rows`` x 64 elements."""
    import bitsandbytes as bnb

    from lightning_stale import StaleStateMonitor

    bench, device = _memory_benchmark(), torch.device("cpu")
    torch.manual_seed(0)
    params = list(nn.Sequential(nn.Embedding(rows, 64), nn.Linear(64, 64)).parameters())
    optimizer = bnb.optim.AdamW8bit(params, lr=1e-3) if kind == "bnb" else torch.optim.AdamW(params, lr=1e-3)
    monitor, peaks = bench.monitor_with_peaks(
        optimizer, lambda: StaleStateMonitor(optimizer, coverage_steps=10, **options), device)
    g = torch.Generator().manual_seed(0)
    for step in range(1, bench.PEAK_STEPS + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        optimizer.step()
        if step % 10 == 0:
            peaks.append(bench.transient_peak(lambda: bench.log(monitor), device))
    monitor.close()
    return max(peaks)


@pytest.mark.parametrize("kind, options, eager", [
    ("bnb", {}, False), ("torch", {}, False), ("bnb", {"underflow_guard": True}, False),
    ("bnb", {"underflow_guard": True}, True)], ids=["bnb", "torch-fp32", "bnb-guard", "bnb-guard-eager"])
def test_the_monitors_transient_peak_does_not_grow_with_the_largest_tensor(kind, options, eager, monkeypatch):
    """What the monitor allocates during a step beyond what it keeps (torch's CPU allocator, as the profiler records
    it) is the same for a largest tensor of 1M and of 4M elements: no temporary as large as a tensor. ``eager``: the
    guard without a compiler (its eager ops work in slices; before, about 7 bytes per element of the pair)."""
    import lightning_stale.act.guard as guard

    if eager:
        monkeypatch.setattr(guard, "_fused_failed", True)
    small, large = (_monitored_peak(rows, kind, options) for rows in (1 << 14, 1 << 16))
    assert large <= small + (64 << 10), (small, large)


def test_a_plain_loop_monitor_does_not_import_lightning_and_still_says_what_it_tracks():
    """Importing Lightning for the fit-start lines would add some 40 MiB to a plain loop's process (issue 29); the
    lines reach stderr all the same."""
    script = ("import sys, torch\n"
              "from lightning_stale import StaleStateMonitor\n"
              "model = torch.nn.Linear(8, 8)\n"
              "opt = torch.optim.AdamW(model.parameters())\n"
              "monitor = StaleStateMonitor(opt)\n"
              "for _ in range(3):\n"
              "    model(torch.randn(2, 8)).sum().backward()\n"
              "    opt.step()\n"
              "monitor.compute()\n"
              "print(sorted(m for m in sys.modules if m == 'lightning' or m.startswith('lightning.')))\n")
    paths = [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "[lightning_stale] AdamW (torch.optim)" in done.stderr
