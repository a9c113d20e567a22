"""The custom-optimizer example runs, and its adapter works with the callback in a real Trainer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_stale import StaleStateCallback

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_optimizer_adapter.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_optimizer_adapter", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_example_main_measures_and_resets() -> None:
    result = _load_example().main(steps=20)
    assert 0.0 < result["stalled_fraction"] < 1.0
    assert result["max_after_reset"] == 0.0


def test_example_adapter_in_a_trainer(tmp_path) -> None:
    example = _load_example()

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 2)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return example.Int8MomentumSGD(self.parameters())

    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
    callback = StaleStateCallback(reset="periodic", every=4, track="exact")
    trainer = pl.Trainer(max_steps=8, callbacks=[callback], logger=False, enable_checkpointing=False,
                         log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=16))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("stale")}
    assert "stale/m/frac" in metrics and 0.0 <= metrics["stale/m/frac"] <= 1.0, metrics
    assert callback.reset_events == 2
