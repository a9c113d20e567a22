"""The ``lightning-stale demo``: a small LLaMA-style byte-level LM trained with several optimizer-state formats.

:mod:`~lightning_stale.demo.model` holds the LightningModule, :mod:`~lightning_stale.demo.data` the offline corpus,
and :mod:`~lightning_stale.demo.runner` trains the configurations and writes the table, logs and figure.
"""

from __future__ import annotations

from lightning_stale.demo.data import ByteCorpus, load_corpus
from lightning_stale.demo.model import DecoderConfig, LanguageModel, OptimizerSpec
from lightning_stale.demo.runner import CONFIGS, DEFAULT_CONFIGS, DemoSettings, RunConfig, RunResult, run_demo

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
