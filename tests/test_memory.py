"""What the monitor keeps, counted by an independent walk of every object it references (benchmarks/memory.py):
``resident_bytes()`` reports all of it, and at GPT-2 shapes of 20M parameters it stays under 1% of the optimizer
state it watches."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
