"""Every example in ``examples/`` runs (with fewer steps) and produces stale-state metrics."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_trainer_quickstart(tmp_path):
    metrics = load("trainer_quickstart").main(steps=40, root=str(tmp_path))
    assert 0.0 <= metrics["stale/v/frac"] <= 1.0 and "stale/v/predicted" in metrics
    assert {"stale/remedy/guard", "stale/remedy/reset"} <= set(metrics)  # remedy="auto" reports what it did


def test_plain_loop():
    metrics = load("plain_loop").main(steps=100)
    assert 0.0 <= metrics["stale/v/frac"] <= 1.0 and metrics["stale/resets"] == 1.0


def test_fabric_loop(tmp_path):
    load("fabric_loop").main(steps=60, root=str(tmp_path))
    rows = (tmp_path / "fabric" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "stale/v/frac" in rows[0] and len(rows) == 1 + 60 // 50
    assert (tmp_path / "fabric" / "checkpoint.pt").exists()


def test_qlora_paged8bit():
    pytest.importorskip("peft")
    metrics = load("qlora_paged8bit").main(steps=20)
    assert 0.0 <= metrics["stale/v/frac"] <= 1.0


def test_hf_trainer():
    pytest.importorskip("transformers")
    rows = load("hf_trainer").main(steps=20)
    assert len(rows) == 2 and all(0.0 <= r["stale/v/frac"] <= 1.0 for r in rows)


def test_lightningcli_yaml():
    cli = load("lightningcli_main").main(["fit", "--config", str(EXAMPLES / "lightningcli.yaml"),
                                          "--trainer.max_steps=30"])
    assert 0.0 <= float(cli.trainer.callback_metrics["stale/v/frac"]) <= 1.0


def test_torchmetrics_window(tmp_path):
    example = load("torchmetrics_window")
    metrics = example.main(steps=40, root=str(tmp_path))
    assert 0.0 <= metrics["stale/v/frac"] <= 1.0 and metrics["mse"] > 0  # one MetricCollection, logged together
    assert 0.0 <= example.plain_loop(steps=40)["stale/v/frac"] <= 1.0
