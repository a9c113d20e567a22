"""Shared fixtures and helpers: the device every device-parametrized test runs on (``cpu`` always, ``cuda`` when
present), and, after Lightning's BoringModel, the optimizer factory, regression module, Trainer and CSV reader that
the Trainer tests share (``from conftest import ...``; the ``*_worker.py`` subprocess scripts stay self-contained)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def fresh_bitsandbytes_overrides():
    """bitsandbytes keeps per-parameter overrides in a process-wide singleton keyed by (group, position): the
    Hugging Face Trainer registers 32-bit embeddings there, which would silently give the first parameter of every
    later bitsandbytes optimizer fp32 states. Each test starts and ends with no overrides."""
    try:
        from bitsandbytes.optim import GlobalOptimManager
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        yield
        return
    GlobalOptimManager.get_instance().initialize()
    yield
    GlobalOptimManager.get_instance().initialize()


# -- shared helpers --------------------------------------------------------------------------------------------------


def make_optimizer(kind: str, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                   **options: Any) -> torch.optim.Optimizer:
    """The optimizer of a test ``kind``, so every file names the same optimizers the same way.

    ``torch``, ``torch_fp32``, ``torch_bf16``: torch AdamW (the state dtype follows the parameters'); ``bnb``:
    bitsandbytes AdamW8bit; ``torchao``: torchao AdamW8bit; ``qadamw:<format>[:<rounding>]``: QuantizedAdamW with
    ``min_quantized_size=256`` unless given. ``options`` go to the constructor as they are (``fused``,
    ``min_8bit_size``, ``seed``, ``compile``, ...); ``lr`` and ``betas`` are every library's defaults.
    """
    if kind in ("torch", "torch_fp32", "torch_bf16"):
        return torch.optim.AdamW(params, lr=lr, betas=betas, **options)
    if kind == "bnb":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, **options)
    if kind == "torchao":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=lr, betas=betas, **options)
    if kind.startswith("qadamw:"):
        from lightning_stale.optim import QuantizedAdamW

        _, fmt, *rounding = kind.split(":")
        options.setdefault("min_quantized_size", 256)
        return QuantizedAdamW(params, lr=lr, betas=betas, state_format=fmt,
                              rounding=rounding[0] if rounding else "nearest", **options)
    raise ValueError(f"unknown optimizer kind {kind!r}")


class Regression(L.LightningModule):
    """Linear -> ReLU -> Linear on a fixed random regression: the same initial weights and batches in every run.

    The defaults (32 -> 256 -> 4, 256 samples in batches of 8) give the first weight 8192 elements, 8-bit state in
    every library. The parameters are bf16 for ``torch_bf16`` unless ``dtype`` says otherwise; ``betas`` and
    ``optimizer_options`` go to :func:`make_optimizer`.
    """

    def __init__(self, kind: str = "torch_fp32", *, width: int = 256, in_features: int = 32, out_features: int = 4,
                 betas: tuple[float, float] = (0.9, 0.999), data_size: int = 256, batch_size: int = 8,
                 dtype: torch.dtype | None = None, **optimizer_options: Any) -> None:
        super().__init__()
        torch.manual_seed(0)  # identical initial weights in every run of a test
        self.kind, self.betas, self.optimizer_options = kind, betas, optimizer_options
        self.in_features, self.out_features = in_features, out_features
        self.data_size, self.batch_size = data_size, batch_size
        dtype = dtype or (torch.bfloat16 if kind == "torch_bf16" else torch.float32)
        self.net = nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, out_features)).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net[0].weight.dtype)).float()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def dataset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, drawn from their own generator so that they never depend on the global seed."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.data_size, self.in_features, generator=g)
        return x, torch.randn(self.data_size, self.out_features, generator=g)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self.dataset()), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        return make_optimizer(self.kind, self.parameters(), betas=self.betas, **self.optimizer_options)


def trainer_for(tmp_path: Path, callbacks: list, steps: int, **kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer that logs every step to a CSV file under ``tmp_path``; ``kwargs`` override any default."""
    defaults = dict(log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, accelerator="cpu")
    if "logger" not in kwargs:
        kwargs["logger"] = CSVLogger(tmp_path)
    return L.Trainer(default_root_dir=tmp_path, max_steps=steps, callbacks=callbacks, **{**defaults, **kwargs})


def fit(tmp_path: Path, model: L.LightningModule, callback: L.Callback, steps: int, **kwargs: Any) -> L.Trainer:
    """Fit ``model`` for ``steps`` optimizer steps with one callback (see :func:`trainer_for`); return the Trainer."""
    trainer = trainer_for(tmp_path, [callback], steps, **kwargs)
    trainer.fit(model)
    return trainer


def read_metrics(trainer: L.Trainer) -> list[dict[str, str]]:
    """Every row the Trainer's CSVLogger wrote, as strings (a column absent from a row is an empty string)."""
    with (Path(trainer.logger.log_dir) / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def logged(trainer: L.Trainer, key: str) -> list[float]:
    """The values logged under ``key``, in step order, skipping the rows that do not have it."""
    return [float(r[key]) for r in read_metrics(trainer) if r.get(key)]
