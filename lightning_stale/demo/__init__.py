"""The ``lightning-stale demo``: a small LLaMA-style byte-level LM trained with several optimizer-state formats.

:mod:`~lightning_stale.demo.model` holds the LightningModule, :mod:`~lightning_stale.demo.data` the offline corpus,
:mod:`~lightning_stale.demo.configs` the configurations, :mod:`~lightning_stale.demo.training` one run,
:mod:`~lightning_stale.demo.report` the table and figure, and :mod:`~lightning_stale.demo.runner` runs a comparison.
"""

from __future__ import annotations

from lightning_stale.demo.configs import CONFIGS, DEFAULT_CONFIGS, DemoSettings, RunConfig
from lightning_stale.demo.data import ByteCorpus, load_corpus
from lightning_stale.demo.model import DecoderConfig, LanguageModel, OptimizerSpec
from lightning_stale.demo.runner import run_demo
from lightning_stale.demo.training import RunResult

__all__ = [
    "CONFIGS",
    "DEFAULT_CONFIGS",
    "ByteCorpus",
    "DecoderConfig",
    "DemoSettings",
    "LanguageModel",
    "OptimizerSpec",
    "RunConfig",
    "RunResult",
    "load_corpus",
    "run_demo",
]
