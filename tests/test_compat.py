"""Every private API we reach lives in ``lightning_stale._compat``: each access is checked against the installed
packages (so an upstream rename fails here, in CI, not inside a training run) and its fallback is checked too."""

from __future__ import annotations

import types

import lightning as L
import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_stale import _compat


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", **kwargs)


def test_the_private_lightning_attributes_still_exist():
    trainer = _trainer(log_every_n_steps=5)
    assert isinstance(trainer._logger_connector.should_update_logs, bool)
    assert isinstance(trainer.fit_loop.epoch_loop._batches_that_stepped, int)
    assert callable(trainer.fit_loop.epoch_loop._should_accumulate)
    assert _compat.lightning_logger_step(trainer) == 0


def test_lightning_fallbacks_follow_the_public_rule():
    stand_in = types.SimpleNamespace(log_every_n_steps=5, global_step=9)  # none of the private attributes
    assert _compat.lightning_logger_step(stand_in) == 9
    assert _compat.lightning_should_log(stand_in)  # (9 + 1) % 5 == 0, Lightning 2.x's rule
    stand_in.global_step = 10
    assert not _compat.lightning_should_log(stand_in)
    assert not _compat.lightning_accumulating(stand_in)  # unknown: treated as a stepping batch


def test_unwrap_lightning_optimizer():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert _compat.unwrap_lightning_optimizer(LightningOptimizer(opt)) is opt
    assert _compat.unwrap_lightning_optimizer(opt) is opt


def test_inductor_cxx_and_its_fallback():
    import torch._inductor.config as inductor_config

    assert _compat.inductor_cxx() == inductor_config.cpp.cxx[1]  # the setting as torch spells it today
    with inductor_config.patch({"cpp.cxx": ()}):  # an unexpected shape of the setting: no compiler name, no error
        assert _compat.inductor_cxx() is None


def test_torchao_classes_and_their_fallback(monkeypatch):
    adam = pytest.importorskip("torchao.optim.adam")
    import torchao.optim as ao

    assert _compat.torchao_optimizer_classes() == (adam._AdamBase,)
    monkeypatch.delattr(adam, "_AdamBase")
    fallback = _compat.torchao_optimizer_classes()
    assert ao.AdamW8bit in fallback and ao.AdamWFp8 in fallback and ao.AdamW4bit in fallback
