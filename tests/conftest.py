"""Shared fixtures: the device every device-parametrized test runs on (``cpu`` always, ``cuda`` when present)."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)
