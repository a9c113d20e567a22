"""Helpers the test files share, imported as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``).

The one optimizer factory every test names its optimizers with and, after Lightning's BoringModel, the regression
module, Trainer and CSV reader of the Trainer tests, and the torch version check of the cases that need a newer torch
than the package's floor. The ``*_worker.py`` subprocess scripts stay self-contained.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from packaging.version import Version
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ONE_FAMILY_OPTIONS = {"min_8bit_size": "bnb", "min_quantized_size": "qadamw", "compile": "qadamw"}
"""Constructor options that one optimizer family takes: the others never receive them, so a test parametrized over
kinds passes them once (e.g. ``min_8bit_size=256, compile=False``)."""


def torch_older_than(release: str) -> bool:
    """Whether the installed torch is an older release than ``release`` (``"2.7"``); build tags (``+cu124``) and
    pre-release tags of the same release count as that release."""
    return Version(torch.__version__).release < Version(release).release


def make_optimizer(kind: str, params, lr: float = 1e-3, betas: tuple[float, ...] | None = None,
                   **options: Any) -> torch.optim.Optimizer:
    """The optimizer of a test ``kind``, so that every file names the same optimizers the same way.

    ``torch``, ``torch_fp32``, ``torch_bf16``: torch AdamW (the state dtype follows the parameters'), ``torch:<Class>``
    another torch.optim optimizer (``torch:SGD``); ``bnb``:
    bitsandbytes AdamW8bit, ``bnb:<Class>`` another bitsandbytes optimizer (``bnb:Lion8bit``); ``torchao``: torchao
    AdamW8bit, ``torchao:<Class>`` another (``torchao:AdamW4bit``); ``qadamw:<format>[:<rounding>]``: QuantizedAdamW
    with ``<format>`` for both moments or ``<m format>/<v format>``, nearest rounding and ``min_quantized_size=256``
    unless given. ``options`` go to the constructor as they are (``weight_decay``, ``fused``, ``seed``, ...), except
    those of :data:`ONE_FAMILY_OPTIONS`, which only their family gets. ``betas`` is the library's default unless
    given (some optimizers take none, or three).
    """
    family, _, name = kind.partition(":")
    family = "torch" if family in ("torch", "torch_fp32", "torch_bf16") else family
    options = {key: value for key, value in options.items() if ONE_FAMILY_OPTIONS.get(key, family) == family}
    if betas is not None:
        options["betas"] = betas
    if family == "torch":
        return getattr(torch.optim, name or "AdamW")(params, lr=lr, **options)
    if family == "bnb":
        import bitsandbytes as bnb

        return getattr(bnb.optim, name or "AdamW8bit")(params, lr=lr, **options)
    if family == "torchao":
        import torchao.optim

        return getattr(torchao.optim, name or "AdamW8bit")(params, lr=lr, **options)
    if family == "qadamw" and name:
        from lightning_stale.optim import QuantizedAdamW

        formats, _, rounding = name.partition(":")
        m_format, _, v_format = formats.partition("/")
        options.setdefault("min_quantized_size", 256)
        return QuantizedAdamW(params, lr=lr, state_format={"m": m_format, "v": v_format} if v_format else formats,
                              rounding=rounding or "nearest", **options)
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


def stepped(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: int = 2) -> None:
    """``steps`` optimizer steps on fixed random gradients (a generator of its own, in each parameter's dtype)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def twin_guarded(kind: str, count: bool, lr: float = 1e-3) -> list[torch.Tensor]:
    """m codes of a stepped optimizer of ``kind`` (:func:`make_optimizer`; a 65,536 + 4,096-element pair, so the
    guard's compiled pass runs where a compiler exists) after zeroing every 13th v element and guarding, with or
    without counting: the two must agree bit for bit."""
    from lightning_stale.act.guard import guard_underflow
    from lightning_stale.adapters import adapter_for

    torch.manual_seed(0)
    dtype = torch.bfloat16 if kind == "torch_bf16" else torch.float32
    params = [nn.Parameter(torch.randn(256, 256).to(dtype)), nn.Parameter(torch.randn(4096).to(dtype))]
    opt = make_optimizer(kind, params, lr=lr)
    stepped(opt, params)
    slots = adapter_for(opt).slots()
    for s in slots:
        if s.moment == "v":
            mask = torch.zeros(s.numel, dtype=torch.bool)
            mask[::13] = True
            s.zero_elements(mask)
    guard_underflow(slots, count=count)
    return [s.codes().clone() for s in slots if s.moment == "m"]

