"""The monitor reads the live optimizer state: after resets (which may delete a buffer the optimizer recreates), after
``optimizer.load_state_dict`` (which replaces every state tensor), for every optimizer family."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import make_optimizer
from lightning_stale import StaleStateMonitor
from lightning_stale.adapters import adapter_for

FAMILIES = {  # kind -> options
    "torch": {},
    "torch:SGD": {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1},
    "torch:RMSprop": {},
    "torch:Adagrad": {"lr": 1e-2},
    "bnb": {"min_8bit_size": 256},
    "qadamw:fp8_e4m3": {"compile": False},
    "qadamw:fp4": {"compile": False},
}


def model_and_optimizer(kind: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    return model, make_optimizer(kind, model.parameters(), **FAMILIES[kind])


def train(model, optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        nn.functional.mse_loss(model(x), x[:, :4]).backward()
        optimizer.step()
        optimizer.zero_grad()


def layout(slots) -> list[tuple[int, str, tuple[int, ...]]]:
    return sorted((id(s.param), s.key, tuple(t.data_ptr() for t in s.state_tensors())) for s in slots)


@pytest.mark.parametrize("kind", FAMILIES)
def test_slots_are_the_live_state_after_resets_and_after_load_state_dict(kind):
    model, optimizer = model_and_optimizer(kind)
    monitor = StaleStateMonitor(optimizer, reset="periodic", every=3, coverage_steps=2)
    train(model, optimizer, 7)  # resets after steps 3 and 6, a step after each
    assert monitor.reset_events == 2
    live = layout(adapter_for(optimizer).slots())
    assert layout(monitor.slots()) == live and live
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # every state tensor replaced by a copy
    train(model, optimizer, 1)
    assert layout(monitor.slots()) == layout(adapter_for(optimizer).slots()) != live
    monitor.close()


def test_sgd_momentum_recreated_after_a_reset_is_measured_again():
    model, optimizer = model_and_optimizer("torch:SGD")
    monitor = StaleStateMonitor(optimizer, reset="periodic", every=4, coverage_steps=2, track="exact")
    train(model, optimizer, 4)
    monitor.reset_window()
    train(model, optimizer, 4)  # the reset deleted the buffers; SGD recreated them at step 5
    row = monitor.compute()
    assert row["stale/m/frac"] < 0.5  # a dead tensor never changes: it read 1.0 before the slots were re-bound
    assert [u.resets for u in monitor.rows()] == [2] * 4 and [u.age for u in monitor.rows()] == [0] * 4
