"""A real client: LitGPT's own pre-training entry point (Fabric, its own loop and CSV logger, bitsandbytes AdamW8bit
from a class path) adopts the monitor with no code change through ``LIGHTNING_STALE=1``, and the stall fractions in
its logger agree with an independent count of the stored codes (sample mode: within sampling error)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("litgpt")
WORKER = Path(__file__).with_name("litgpt_worker.py")
EVERY = 10


@pytest.mark.slow
def test_litgpt_pretraining_logs_stall_fractions_through_the_entry_point(tmp_path):
    env = {**os.environ, "LIGHTNING_STALE": "1", "LIGHTNING_STALE_LOG_EVERY": str(EVERY)}
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with (tmp_path / "out" / "logs" / "csv" / "version_0" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("stale/v/frac")]
    probe = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert len(rows) == len(probe) // EVERY >= 3
    for i, row in enumerate(rows):  # window i: optimizer steps EVERY*i+1 .. EVERY*(i+1), the first has no snapshot
        window = [c for c in probe[EVERY * i:EVERY * (i + 1)] if c[1] > 0]
        exact = sum(s for s, _ in window) / sum(c for _, c in window)
        assert abs(float(row["stale/v/frac"]) - exact) < 0.05, (i, row["stale/v/frac"], exact)
