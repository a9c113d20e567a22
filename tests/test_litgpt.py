"""A real client: LitGPT's own pre-training entry point (Fabric, its own loop, CSV logger, checkpoints and optimizer
instantiation) adopts the monitor with no code change through ``LIGHTNING_STALE``.

- ``LIGHTNING_STALE=1`` with bitsandbytes AdamW8bit from a class path: the stall fractions in LitGPT's logger agree
  with an independent count of the stored codes (sample mode: within sampling error).
- ``LIGHTNING_STALE=auto`` on LitGPT's documented text pipeline (an offline tokenizer, ``TextFiles`` through litdata),
  bf16-true: LitGPT's checkpoints hold only what LitGPT knows (model, optimizer, data loader, counters), yet a run
  resumed mid-window from one logs the uninterrupted run's rows at the same steps, makes the same remedy decisions,
  ends with the same monitor state and bit-identical weights, and names parameters as the model does.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("litgpt")
WORKER = Path(__file__).with_name("litgpt_worker.py")
EVERY = 10


def run_worker(*args: str, **env: str) -> str:
    proc = subprocess.run([sys.executable, str(WORKER), *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def stale_rows(out: Path) -> list[dict[str, str]]:
    with (out / "logs" / "csv" / "version_0" / "metrics.csv").open() as f:
        return [{k: v for k, v in row.items() if k == "step" or k.startswith("stale/")} for row in csv.DictReader(f)
                if row.get("stale/v/frac")]


@pytest.mark.slow
def test_litgpt_pretraining_logs_stall_fractions_through_the_entry_point(tmp_path):
    run_worker(str(tmp_path / "out"), "probe", LIGHTNING_STALE="1", LIGHTNING_STALE_LOG_EVERY=str(EVERY))
    rows = stale_rows(tmp_path / "out")
    probe = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert len(rows) == len(probe) // EVERY >= 3
    for i, row in enumerate(rows):  # window i: optimizer steps EVERY*i+1 .. EVERY*(i+1), the first has no snapshot
        window = [c for c in probe[EVERY * i:EVERY * (i + 1)] if c[1] > 0]
        exact = sum(s for s, _ in window) / sum(c for _, c in window)
        assert abs(float(row["stale/v/frac"]) - exact) < 0.05, (i, row["stale/v/frac"], exact)


def same(ours, theirs, where: str = "") -> None:
    """``ours`` equals ``theirs`` exactly: tensors bit for bit (NaN where NaN), numbers, containers."""
    if isinstance(ours, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours.nan_to_num(), theirs.nan_to_num()), where
    elif isinstance(ours, dict):
        assert set(ours) == set(theirs), where
        for key in ours:
            same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            same(a, b, f"{where}[{i}]")
    elif isinstance(ours, float) and math.isnan(ours):
        assert isinstance(theirs, float) and math.isnan(theirs), where
    else:
        assert ours == theirs, where


@pytest.mark.slow  # litdata's preprocessing spawns a process per split, then two LitGPT runs: about 2 minutes
def test_litgpt_text_pretraining_with_the_automatic_remedy_resumes_exactly(tmp_path):
    """torch.compile is switched off (``TORCHDYNAMO_DISABLE``) for both runs alike: LitGPT compiles the model, which
    takes minutes on a CPU and has nothing to do with what is checked here."""
    pytest.importorskip("litdata")  # TextFiles' preprocessing and streaming
    from litgpt_worker import SAVE_EVERY, TEXT_STEPS

    env = {"LIGHTNING_STALE": "auto", "LIGHTNING_STALE_LOG_EVERY": "4", "TORCHDYNAMO_DISABLE": "1"}
    data, full, resumed = tmp_path / "data", tmp_path / "full", tmp_path / "resumed"
    full_log = run_worker(str(full), "text", str(data), **env)
    resumed_log = run_worker(str(resumed), "text", str(data), str(full / f"step-{SAVE_EVERY:08d}" / "lit_model.pth"),
                             **env)

    decisions = re.compile(r"remedy: weight write-back .* from step (\d+) for (\d+) parameter\(s\).*\(e\.g\. '([^']+)'")
    taken = [(int(step), int(n), name) for step, n, name in decisions.findall(full_log)]
    assert taken[0][0] <= SAVE_EVERY < taken[-1][0]  # decisions before the interruption and after it
    assert all("." in name and not name.startswith("opt0") for *_, name in taken)  # named as the model names them
    later = [(int(step), int(n), name) for step, n, name in decisions.findall(resumed_log)]
    assert later == [d for d in taken if d[0] > SAVE_EVERY + 1]  # decided again from scratch, none; later, the same
    assert f"resuming from the state carried in the optimizer's state dict: AdamW at optimizer step {SAVE_EVERY}" \
        in resumed_log

    rows, resumed_rows = stale_rows(full), stale_rows(resumed)
    assert [int(r["step"]) for r in rows] == list(range(4, TEXT_STEPS + 1, 4))
    assert resumed_rows == [r for r in rows if int(r["step"]) > SAVE_EVERY]  # the steps and every value

    ours = torch.load(resumed / "final" / "lit_model.pth", weights_only=True)
    theirs = torch.load(full / "final" / "lit_model.pth", weights_only=True)
    for name, weight in theirs["model"].items():
        assert weight.dtype == torch.bfloat16 and torch.equal(ours["model"][name], weight), name
    state = theirs["optimizer"]["param_groups"][0]["lightning_stale"]  # windows, ledger, remedy choices, clock
    assert state["front_end"] == {"steps": TEXT_STEPS} and state["optimizers"][0]["steps"] == TEXT_STEPS
    same(ours["optimizer"]["param_groups"][0]["lightning_stale"], state)
    same(ours["optimizer"]["state"], theirs["optimizer"]["state"])  # moments and compensation buffers
