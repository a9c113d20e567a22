"""Extending the monitor from outside the package: a policy defined in this file works end to end, and the Trainer
callback's signature stays the options' fields (so an option added to ``MonitorOptions`` cannot be forgotten there)."""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from lightning_stale import MonitorOptions, StaleStateCallback, StaleStateMonitor
from lightning_stale.decide.ledger import ResetUnit
from lightning_stale.policies import PeriodicReset, ResetPolicy


class EveryThirdOfWeights(PeriodicReset):
    """A toy policy: a built-in's subclass that overrides only ``should_reset`` (weights only, every ``every`` steps)."""

    def should_reset(self, unit: ResetUnit, step: int) -> bool:
        return unit.param.dim() > 1 and unit.age >= self.every


class Never(ResetPolicy):
    """A toy policy on the base class."""

    def should_reset(self, unit: ResetUnit, step: int) -> bool:
        return False


def _train(policy: ResetPolicy, steps: int = 9) -> list[tuple[int, int]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = StaleStateMonitor(optimizer, reset=policy, names=model)
    events: list[tuple[int, int]] = []
    monitor.add_reset_listener(lambda event: events.append((event.step, len(event.slots))))
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return events


def test_a_subclass_of_a_built_in_overriding_should_reset_is_honoured() -> None:
    assert _train(PeriodicReset(3)) == [(3, 8), (6, 8), (9, 8)]  # 4 parameters, m and v each
    assert _train(EveryThirdOfWeights(3)) == [(3, 4), (6, 4), (9, 4)]  # the 2 weights only


def test_a_policy_on_the_base_class_works() -> None:
    assert _train(Never()) == []


def test_the_callback_signature_is_the_options_fields() -> None:
    fields = [f for f in dataclasses.fields(MonitorOptions) if f.init]
    parameters = list(inspect.signature(StaleStateCallback.__init__).parameters.values())[1:]
    assert [p.name for p in parameters] == [f.name for f in fields]
    assert [p.default for p in parameters] == [f.default for f in fields]
