"""Fixtures only: the device every device-parametrized test runs on (``cpu`` always, ``cuda`` when present) and a
fresh bitsandbytes override registry per test. The helpers the test files share live in ``helpers.py``."""

from __future__ import annotations

import pytest
import torch

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
