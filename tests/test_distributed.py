"""CPU DDP (2 processes, gloo): identical reset decisions and bit-identical optimizer states on every rank, and
logged stall fractions that are global (sum of stalled over sum of counted across ranks).

Each case launches ``tests/ddp_worker.py`` in a subprocess (Lightning re-launches it for rank 1) and compares the
JSON files the two ranks write.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import bitsandbytes as bnb
import lightning as L
import pytest
import torch
from ddp_worker import TwoOptimizers

from lightning_stale import StaleStateCallback
from lightning_stale.monitor.metrics import PER_MOMENT, V_COUNTED, V_STALLED  # layout of the reduced vector
from lightning_stale.vocab import MOMENTS, QUANTITIES

WORKER = Path(__file__).with_name("ddp_worker.py")
# Optimizer steps per rank (global_step); two optimizers step once per batch, so half as many batches.
STEPS = {"adaptive": 60, "theory": 520, "auto": 60, "weights": 40, "weights-auto": 40}


def run_worker(tmp_path: Path, reset: str, resume: Path | None = None) -> tuple[dict, dict, list[dict[str, str]]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), reset, str(STEPS[reset]),
                           *([str(resume)] if resume else [])], env=env, capture_output=True, text=True, timeout=300)
    ranks = [tmp_path / f"{'resumed-' if resume else ''}rank{r}.json" for r in (0, 1)]
    written = all(p.exists() for p in ranks)
    # CPU DDP sometimes aborts at interpreter exit ("terminate called without an active exception", rc 134) after
    # the run finished: tolerated only when both ranks wrote their results.
    if proc.returncode != 0 and not (proc.returncode in (134, -6) and written):
        pytest.fail(f"DDP worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    assert written, f"a rank wrote no results:\n{proc.stderr[-5000:]}"
    rank0, rank1 = (json.loads(p.read_text()) for p in ranks)
    with (tmp_path / "csv" / f"version_{1 if resume else 0}" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    return rank0, rank1, rows


def local_counts(totals: list[float], moment: str) -> tuple[float, float]:
    """(stalled, counted) of one moment in a rank's local totals vector."""
    base = PER_MOMENT * QUANTITIES.index(moment)
    return totals[base + V_STALLED], totals[base + V_COUNTED]


@pytest.mark.slow
@pytest.mark.parametrize("reset", ["adaptive", "theory"])
def test_ddp_ranks_reset_together_and_stay_bit_identical(tmp_path, reset):
    rank0, rank1, rows = run_worker(tmp_path, reset)
    assert (rank0["rank"], rank1["rank"], rank0["world_size"]) == (0, 1, 2)

    # Same reset decisions: same steps, same optimizers, same periods.
    steps0 = [(r["step"], r["optimizer"]) for r in rank0["resets"]]
    steps1 = [(r["step"], r["optimizer"]) for r in rank1["resets"]]
    assert steps0 == steps1
    assert {o for _, o in steps0} == {0, 1}, f"expected resets of both optimizers, got {steps0}"
    assert rank0["reset_events"] == rank1["reset_events"] == len(steps0)
    assert rank0["periods"] == rank1["periods"]

    # Bit-identical optimizer states (codes, scales, counters) after every reset and at the end.
    for r0, r1 in zip(rank0["resets"], rank1["resets"]):
        assert r0["state"] == r1["state"], f"optimizer states differ across ranks after the reset at step {r0['step']}"
    assert rank0["final_state"] == rank1["final_state"]
    assert rank0["final_params"] == rank1["final_params"]

    # The ranks measured different samples (own seeds), so the reduction had real work to do ...
    local0, local1 = rank0["local_totals"], rank1["local_totals"]
    assert len(local0) == len(local1) == STEPS[reset] // 2  # logged once per batch
    assert any(local_counts(a, "v") != local_counts(b, "v") for a, b in zip(local0, local1))
    # ... and every logged fraction is sum(stalled) / sum(counted) over both ranks, never a per-rank fraction.
    # Log i happens at the end of batch i, the CSV row of logger step i (the first batch has nothing to compare).
    by_step = {int(r["step"]): r for r in rows}
    checked = 0
    for moment in MOMENTS:
        for i, (a, b) in enumerate(zip(local0, local1)):
            (s0, c0), (s1, c1) = local_counts(a, moment), local_counts(b, moment)
            value = by_step.get(i, {}).get(f"stale/{moment}/frac")
            if c0 + c1 == 0:
                assert not value
                continue
            assert float(value) == pytest.approx((s0 + s1) / (c0 + c1), rel=1e-6)
            checked += 1
    assert checked >= 2 * (len(local0) - 1)
    assert [float(r["stale/resets"]) for r in rows if r.get("stale/resets")][-1] == len(steps0)


@pytest.mark.slow
def test_ddp_ranks_apply_the_automatic_remedy_together(tmp_path):
    """Each rank reads underflow on its own sample; the readings are summed before the remedy decides, so both ranks
    guard the same parameters at the same steps and their optimizer states stay bit-identical."""
    rank0, rank1, rows = run_worker(tmp_path, "auto")
    assert rank0["remedies"] == rank1["remedies"] and rank0["underflow"] == rank1["underflow"]
    assert rank0["final_state"] == rank1["final_state"] and rank0["final_params"] == rank1["final_params"]
    guarded = [float(r["stale/remedy/guard"]) for r in rows if r.get("stale/remedy/guard")]
    assert guarded and max(guarded) >= 1, "expected the fp8 optimizer's weight to underflow and be guarded"


def test_theory_periods_do_not_depend_on_the_sample_seed(tmp_path):
    """Ranks may sample with different seeds; the theory period (a grid estimate for 8-bit maps) must still agree,
    because theory resets are not reduced across ranks. Two single-process runs on identical data stand in for two
    ranks."""
    class OneOptimizer(TwoOptimizers):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = True

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.second(torch.relu(self.first(x))), y)

        def configure_optimizers(self):
            return bnb.optim.AdamW8bit(self.parameters(), lr=1e-3, betas=(0.9, 0.99))

    periods = []
    for seed in (0, 1, 2, 3):
        torch.manual_seed(0)
        callback = StaleStateCallback(reset="theory", sample_size=64, seed=seed)
        trainer = L.Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                            callbacks=[callback])
        trainer.fit(OneOptimizer())
        periods.append(callback.reset_periods())
    assert periods[0]["first.weight"] is not None
    assert all(p == periods[0] for p in periods), periods


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "says"), [("model_parallel_bnb", "bitsandbytes#1633"),
                                                ("fsdp", "Use ModelParallelStrategy")])
def test_unsupported_sharded_setups_are_refused_with_a_clear_message(strategy, says):
    """FSDP1 (flattened shards) and bitsandbytes under FSDP2 (no DTensor support upstream) stop the fit before any
    step with a message saying what is supported instead; FSDP2 itself is covered by tests/test_fsdp2.py."""
    proc = subprocess.run([sys.executable, str(WORKER.with_name("sharded_worker.py")), strategy],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert refused, f"the fit was not refused:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert says in refused[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["weights", "weights-auto"])
def test_ddp_weight_write_back_writes_the_same_weights_on_every_rank(tmp_path, kind):
    """bf16-true DDP with ``weights="stochastic"`` and per-rank sample seeds: the rounding noise is keyed by step and
    parameter, not by rank, so both ranks keep bit-identical weights and states; with ``remedy="auto"`` (compensated
    summation) both ranks also take over the same parameters and keep bit-identical compensation buffers in their
    optimizer state, so the state rank 0 saves is every rank's: a run resumed from step 20 ends bit-identical to the
    uninterrupted one, buffers included."""
    rank0, rank1, rows = run_worker(tmp_path, kind)
    if kind == "weights-auto":
        resumed = run_worker(tmp_path, kind, resume=tmp_path / "ckpt" / "epoch=0-step=20.ckpt")
        for ours in resumed[:2]:
            assert ours["final_params"] == rank0["final_params"] and ours["final_state"] == rank0["final_state"]
            assert ours["compensation"] == rank0["compensation"]
    assert rank0["final_params"] == rank1["final_params"]
    assert rank0["final_state"] == rank1["final_state"]
    assert rank0["compensation"] == rank1["compensation"]
    assert all(c for c in rank0["compensation"]) == (kind == "weights-auto")
    taken = [float(r["stale/remedy/weights"]) for r in rows if r.get("stale/remedy/weights")]
    assert taken and taken[-1] == 4.0  # both Linear layers' weights and biases
    assert any(r.get("stale/w/frac") for r in rows)
