"""FSDP2 (Lightning's ModelParallelStrategy, 2 CPU processes, gloo): stall fractions counted on each rank's shards and
summed across ranks equal an independent count over both ranks' shards; both ranks reset at the same steps with the
same periods (torchao's grid estimates are agreed across ranks); a resume mid reset cycle gives the same resets and
bit-identical shards. Each case launches ``tests/fsdp2_worker.py`` (Lightning re-launches it for rank 1)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import torch_older_than

pytestmark = pytest.mark.skipif(torch_older_than("2.7"), reason="FSDP2 on CPU needs torch 2.7 or newer: torch 2.6's "
                                "FSDP2 calls Stream.record_event, which its CPU streams lack")

WORKER = Path(__file__).with_name("fsdp2_worker.py")
STEPS, LOG_EVERY = 14, 3


def launch(out: Path, kind: str, resume: Path | None = None, expect_failure: bool = False) -> tuple[dict, dict] | str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, str(WORKER), str(out), kind, str(STEPS)] + ([str(resume)] if resume else [])
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    prefix = "resumed" if resume else "full"
    files = [out / f"{prefix}-rank{r}.json" for r in (0, 1)]
    if expect_failure:
        assert proc.returncode != 0
        return proc.stderr
    if not all(f.exists() for f in files):
        pytest.fail(f"FSDP2 worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return tuple(json.loads(f.read_text()) for f in files)


def logged(out: Path, version: int) -> dict[int, float]:
    with (out / "csv" / f"version_{version}" / "metrics.csv").open() as f:
        return {int(r["step"]): float(r["stale/v/frac"]) for r in csv.DictReader(f) if r.get("stale/v/frac")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torch", "torchao"], ids=["torch-adamw-bf16", "torchao-adamw8bit"])
def test_fsdp2_counts_sum_over_shards_and_ranks_reset_together(tmp_path, kind):
    if kind == "torchao":
        pytest.importorskip("torchao")
    rank0, rank1 = launch(tmp_path, kind)
    assert [r["step"] for r in rank0["resets"]] == [r["step"] for r in rank1["resets"]] == [6, 12]
    assert rank0["periods"] == rank1["periods"] and set(rank0["periods"].values()) == {6}
    both = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(rank0["probe"], rank1["probe"])]  # per step, both shards
    expected = []
    for end in range(LOG_EVERY, STEPS + 1, LOG_EVERY):
        window = both[max(0, end - LOG_EVERY - 1):end - 1]  # the first step has nothing to compare
        expected.append(sum(s for s, _ in window) / sum(c for _, c in window))
    assert list(logged(tmp_path, 0).values()) == pytest.approx(expected, rel=1e-6)
    assert rank0["final_state"] != rank1["final_state"]  # really different shards


@pytest.mark.slow
def test_fsdp2_resume_mid_cycle_is_exact(tmp_path):
    full = launch(tmp_path, "torch")
    resumed = launch(tmp_path, "torch", resume=tmp_path / "ckpt" / "epoch=0-step=8.ckpt")
    for f, r in zip(full, resumed):
        assert [x["step"] for x in r["resets"]] == [s["step"] for s in f["resets"] if s["step"] > 8] == [12]
        assert r["final_state"] == f["final_state"]  # bit-identical shards on each rank
        assert r["periods"] == f["periods"] and r["steps"] == f["steps"] == [STEPS]
    before, after = logged(tmp_path, 0), logged(tmp_path, 1)
    # The first row after the resume covers only the steps since the resume (the open window's counts of the other
    # rank are not in rank 0's checkpoint); every later row equals the uninterrupted run's.
    later = sorted(after)[1:]
    assert later and all(after[s] == pytest.approx(before[s], rel=1e-9) for s in later)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torch-wsrm", "torch-wkahan"])
def test_fsdp2_weight_write_back_writes_each_shard_and_resumes_exactly(tmp_path, kind):
    """The write-back on FSDP2 bf16 shards: each rank writes its own shard (noise keyed by the element's place in the
    whole parameter: rank 1's shards start where rank 0's end), the weights differ from nearest rounding's, and a
    resume mid-run through the distributed checkpoint ends on bit-identical shards, states and (``"compensated"``)
    compensation buffers, which live in the optimizer's state as DTensors sharded like their parameters."""
    nearest = launch(tmp_path / "nearest", "torch")
    full = launch(tmp_path, kind)
    resumed = launch(tmp_path, kind, resume=tmp_path / "ckpt" / "epoch=0-step=8.ckpt")
    rank0, rank1 = full
    assert rank0["shard_starts"] == [0] * len(rank0["shard_sizes"])
    assert rank1["shard_starts"] == rank0["shard_sizes"]  # even dim-0 shards: rank 1's start after rank 0's
    for n, f, r in zip(nearest, full, resumed):
        assert f["weights"] != n["weights"]  # the write-back wrote these shards
        assert r["weights"] == f["weights"] and r["final_state"] == f["final_state"]
        assert f["buffers"] == r["buffers"] == ([["DTensor", size] for size in f["shard_sizes"]]
                                                 if kind == "torch-wkahan" else [])
    weights_taken = [row for row in csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open())
                     if row.get("stale/remedy/weights")]
    assert weights_taken and all(float(row["stale/remedy/weights"]) == 6 for row in weights_taken)


@pytest.mark.slow
def test_fsdp2_auto_writes_sharded_weights_with_compensated_summation_and_resumes_exactly(tmp_path):
    """``remedy="auto"`` on FSDP2 bf16 shards: compensated summation, its buffers in each rank's optimizer state (the
    distributed checkpoint saves and loads every rank's shards); both ranks take over the same parameters and a
    resume mid-run ends on bit-identical shards, states and buffers."""
    full = launch(tmp_path, "torch-auto")
    resumed = launch(tmp_path, "torch-auto", resume=tmp_path / "ckpt" / "epoch=0-step=8.ckpt")
    assert full[0]["taken_over"] == full[1]["taken_over"] == resumed[0]["taken_over"] == resumed[1]["taken_over"]
    for f, r in zip(full, resumed):
        assert f["writeback"] == r["writeback"] == [
            "compensated summation of the weights and stochastic rounding of the moments"]
        assert r["weights"] == f["weights"] and r["final_state"] == f["final_state"]
        assert f["buffers"] == [["DTensor", size] for size in f["shard_sizes"]]
    taken = [row["stale/remedy/weights"] for row in csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv")
                                                                   .open()) if row.get("stale/remedy/weights")]
    assert taken and float(taken[-1]) > 0
