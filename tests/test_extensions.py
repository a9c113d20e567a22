"""Extending the monitor from outside the package: a policy defined in this file works end to end, one registered here
under a name with an argument of its own is accepted by the options and the ``LIGHTNING_STALE`` factory, and the
Trainer callback's signature stays the options' fields (so an option added to ``MonitorOptions`` cannot be forgotten
there)."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lightning_stale import MonitorOptions, StaleStateCallback, StaleStateMonitor
from lightning_stale.decide.ledger import LedgerRow
from lightning_stale.decide.registry import POLICY_SHORTCUTS, register_policy
from lightning_stale.policies import PeriodicReset, ResetPolicy
from lightning_stale.vocab import MOMENTS, check_int, check_moments


class EveryThirdOfWeights(PeriodicReset):
    """A toy policy: a built-in's subclass that overrides only ``should_reset`` (weights only, every ``every`` steps)."""

    def should_reset(self, unit: LedgerRow, step: int) -> bool:
        return unit.param.dim() > 1 and unit.age >= self.every


class Never(ResetPolicy):
    """A toy policy on the base class."""

    def should_reset(self, unit: LedgerRow, step: int) -> bool:
        return False


class AfterPatience(ResetPolicy):
    """A toy third-party policy with an argument of its own: reset a parameter once it is ``patience`` steps old."""

    def __init__(self, patience: int, moments: tuple[str, ...] = MOMENTS) -> None:
        super().__init__(moments)
        self.patience = patience

    def should_reset(self, unit: LedgerRow, step: int) -> bool:
        return unit.age >= self.patience


def check_patience(patience: int) -> int:
    return check_int("patience", patience, unit="optimizer steps")


@pytest.fixture
def patient() -> Iterator[None]:
    """``reset="patient"`` registered for one test: the one-file extension (a class and this call)."""
    register_policy("patient", AfterPatience, {"patience": check_patience, "moments": check_moments},
                    required={"patience": "a positive int number of optimizer steps"})
    yield
    del POLICY_SHORTCUTS["patient"]


def _train(policy: ResetPolicy | str, steps: int = 9, **options: object) -> list[tuple[int, int]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = StaleStateMonitor(optimizer, reset=policy, names=model, **options)
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


def test_a_registered_policy_takes_its_own_argument_by_name(patient: None) -> None:
    assert _train("patient", policy_args={"patience": 3}) == [(3, 8), (6, 8), (9, 8)]
    assert _train("patient", policy_args={"patience": 4}, moments=("v",)) == [(4, 4), (8, 4)]
    options = MonitorOptions(reset="patient", policy_args={"patience": 5})
    assert isinstance(options.policy, AfterPatience) and options.policy.patience == 5


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"reset": "patient"}, "needs `patience`"),
    ({"reset": "patient", "policy_args": {"patience": 0}}, "`patience` must be a positive int"),
    ({"reset": "theory", "policy_args": {"patience": 3}}, r"`patience` is only used with reset='patient'"),
    ({"reset": "patient", "policy_args": {"patience": 3, "every": 2}}, "pass `every` as its own option"),
    ({"reset": "patient", "policy_args": {"grace": 3}}, "no registered reset or remedy takes"),
    ({"reset": "unknown"}, r"`reset` must be None, one of \('periodic', 'theory', 'adaptive', 'drift', 'patient'\)"),
])
def test_a_registered_policy_is_validated_like_a_built_in(patient: None, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MonitorOptions(**kwargs)


def test_the_environment_variable_accepts_a_registered_policy(patient: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_stale.integrations.factory import ENV_VAR, options_from_env

    monkeypatch.setenv(ENV_VAR, "patient:7")
    assert options_from_env() == {"reset": "patient", "policy_args": {"patience": 7}}
    monkeypatch.setenv(ENV_VAR, "patient")
    with pytest.raises(ValueError, match="drift, periodic:<every> or patient:<patience>"):
        options_from_env()


def _example(monkeypatch: pytest.MonkeyPatch) -> object:
    """examples/custom_optimizer_adapter.py: a third-party optimizer (int8 momentum codes) and its live adapter."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "custom_optimizer_adapter.py"
    spec = importlib.util.spec_from_file_location("custom_optimizer_adapter", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_inspect_reads_a_registered_third_party_optimizer(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_stale.adapters import saved_state
    from lightning_stale.commands.inspect import build_report

    example = _example(monkeypatch)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = example.Int8MomentumSGD(model.parameters())
    for _ in range(3):
        model(torch.randn(16, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path / "sgd.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    with pytest.raises(ValueError, match="a known family"):
        build_report(str(path))

    def read_param(index: int, entry: dict, group: dict, shape: tuple[int, ...] | None) -> saved_state.SavedParam:
        shape = tuple(entry["codes"].shape)
        slot = example.Int8Slot(saved_state.stand_in(shape), "m", None, "int8 linear, per-tensor scale", "codes",
                                stored=entry["codes"], scale=entry["scale"])
        return saved_state.SavedParam(index, [slot], None, shape)

    saved_state.register_saved_reader("example", lambda entries, groups: all("codes" in e for e in entries.values()),
                                      read_param)
    try:
        report = build_report(str(path))
    finally:
        del saved_state._READERS[0]
    [optimizer_report] = report.optimizers
    assert optimizer_report.family == "example"
    assert [row.name for row in optimizer_report.params] == ["weight", "bias"]
