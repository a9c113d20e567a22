"""Writes ``writeback_released.pt``: a plain loop's bf16 model, torch AdamW state and monitor state after 6 steps with
``weights="compensated"``, as lightning_stale 0.1 at commit bf0fa30 saved it: the write-back's compensation buffers in
the monitor's state (by parameter index), none in the optimizer's. Run once with that version
(``PYTHONPATH=<that checkout> python tests/data/make_writeback_checkpoint.py``); tests/test_writeback.py loads it with
the current version, whose buffers live in the optimizer's state."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_stale import StaleStateMonitor

STEPS = 6


def setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)).bfloat16()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def batches(count: int, start: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    data = [torch.randn(16, 32, generator=gen).bfloat16() for _ in range(start + count)]
    return data[start:]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> None:
    for x in data:
        optimizer.zero_grad()
        model(x).float().pow(2).mean().backward()
        optimizer.step()


if __name__ == "__main__":
    model, optimizer = setup()
    monitor = StaleStateMonitor(optimizer, weights="compensated", names=model, coverage_steps=2)
    train(model, optimizer, batches(STEPS))
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "monitor": monitor.state_dict()},
               Path(__file__).with_name("writeback_released.pt"))
