"""Ways to switch the callback on without code: the callbacks_factory entry point and LightningCLI YAML."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_stale import StaleStateCallback
from lightning_stale.factory import ENV_VAR, callbacks_from_env, options_from_env
from lightning_stale.messages import StaleStateWarning
from lightning_stale.policies import AdaptiveReset, DriftReset, PeriodicReset, TheoryReset


def stale_callbacks(trainer: L.Trainer) -> list[StaleStateCallback]:
    return [cb for cb in trainer.callbacks if isinstance(cb, StaleStateCallback)]


def test_entry_point_is_inactive_without_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert stale_callbacks(L.Trainer(default_root_dir=tmp_path, logger=False)) == []
    monkeypatch.setenv(ENV_VAR, "0")
    assert stale_callbacks(L.Trainer(default_root_dir=tmp_path, logger=False)) == []


@pytest.mark.parametrize(
    ("spec", "policy_type"),
    [("1", type(None)), ("theory", TheoryReset), ("adaptive", AdaptiveReset), ("periodic:250", PeriodicReset),
     ("drift", DriftReset), ("auto", type(None))],
)
def test_entry_point_adds_the_callback_when_the_variable_is_set(monkeypatch, tmp_path, spec, policy_type):
    monkeypatch.setenv(ENV_VAR, spec)
    found = stale_callbacks(L.Trainer(default_root_dir=tmp_path, logger=False))  # through the real entry point
    assert len(found) == 1
    assert isinstance(found[0].policy, policy_type)
    if spec.startswith("periodic"):
        assert found[0].policy.every == 250
    assert found[0].options.remedy == ("auto" if spec == "auto" else None)


@pytest.mark.parametrize("spec", ["sometimes", "periodic", "periodic:0", "periodic:x"])
def test_entry_point_declines_an_unknown_spec_in_one_line_with_the_allowed_values(monkeypatch, tmp_path, spec):
    """The variable is set for whole clusters: a value it does not understand must not stop a Trainer or Fabric."""
    monkeypatch.setenv(ENV_VAR, spec)
    with pytest.raises(ValueError, match="auto, theory, adaptive, drift or periodic"):
        options_from_env()  # the parser itself says what it expects
    with pytest.warns(StaleStateWarning) as caught:
        trainer = L.Trainer(default_root_dir=tmp_path, logger=False)
        fabric = L.Fabric(accelerator="cpu", devices=1)
    lines = [str(w.message) for w in caught if issubclass(w.category, StaleStateWarning)]
    assert len(set(lines)) == 1 and "auto, theory, adaptive, drift or periodic:<every>" in lines[0], lines
    assert f"{ENV_VAR}={spec!r}: the value is not understood; training goes on without lightning_stale" in lines[0]
    assert stale_callbacks(trainer) == [] and callbacks_from_env() == []
    assert not any(type(cb).__name__ == "StaleStateFabricCallback" for cb in fabric._callbacks)


def test_an_explicit_callback_wins_over_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, "theory")
    explicit = StaleStateCallback(reset="periodic", every=3)
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, max_steps=4, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[explicit])
    trainer.fit(BoringModel())  # no "more than one stateful callback" error from Lightning
    from_env = [cb for cb in stale_callbacks(trainer) if cb.from_environment]
    assert len(from_env) == 1 and from_env[0].monitor is None  # stepped aside
    assert explicit.monitor is not None and explicit.monitor.steps == [4]


def test_lightning_cli_builds_the_callback_from_yaml(tmp_path):
    config = tmp_path / "stale.yaml"
    config.write_text(
        "trainer:\n"
        "  logger: false\n"
        "  callbacks:\n"
        "    - class_path: lightning_stale.StaleStateCallback\n"
        "      init_args:\n"
        "        reset: periodic\n"
        "        every: 300\n"
        "        moments: [v]\n"
        "        track: exact\n"
    )
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None)
    (cb,) = stale_callbacks(cli.trainer)
    assert isinstance(cb.policy, PeriodicReset) and cb.policy.every == 300 and cb.policy.moments == ("v",)
    assert cb.options.track == "exact"


def test_lightning_cli_rejects_a_bad_track_value_at_parse_time(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_stale.StaleStateCallback\n"
        "      init_args:\n        track: everything\n"
    )
    with pytest.raises(SystemExit):
        LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None)
