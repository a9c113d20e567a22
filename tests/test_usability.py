"""What a user meets beyond the main path: a failing reset listener is the user's error and says so, the Trainer
callback given to Fabric says what to use, compiled modules give plain names, a second fit continues the counts,
and the fit-start report names the periods it chose and why."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from helpers import Regression, make_optimizer
from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.act.interventions import ListenerError
from lightning_stale.decide.ledger import RHO_PENDING


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 64, generator=g)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _bnb_model(betas: tuple[float, float] = (0.9, 0.999)):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    return model, make_optimizer("bnb", model.parameters(), betas=betas, min_8bit_size=256)


def test_a_failing_reset_listener_reaches_the_user_with_its_name():
    model, optimizer = _bnb_model()
    monitor = StaleStateMonitor(optimizer, reset="periodic", every=2)

    def old_style(step, optimizer):  # the signature before ResetEvent
        pass

    monitor.add_reset_listener(old_style)
    with pytest.raises(ListenerError, match="reset listener .*old_style raised TypeError"):
        _train(model, optimizer, 3)


def test_the_trainer_callback_given_to_fabric_says_what_to_use():
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[StaleStateCallback()])
    model, optimizer = fabric.setup(*_bnb_model())
    fabric.backward(model(torch.randn(4, 64)).sum())
    with pytest.raises(MisconfigurationException, match="pass lightning_stale.fabric.StaleStateFabricCallback"):
        optimizer.step()
    with pytest.raises(MisconfigurationException, match="StaleStateFabricCallback"):
        fabric.call("on_train_start", fabric, model)


def test_a_compiled_model_gives_the_plain_parameter_names():
    model, optimizer = _bnb_model()
    compiled = torch.compile(model)
    monitor = StaleStateMonitor(optimizer, names=compiled, log_per_param=True, track="exact")
    _train(model, optimizer, 2)
    assert set(monitor.reset_periods()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert "stale/0.weight/state2/frac" in monitor.compute()


def test_a_second_fit_of_the_same_trainer_continues_the_reset_count(tmp_path):
    callback = StaleStateCallback(reset="periodic", every=3)
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=7, callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    model = Regression("bnb", min_8bit_size=256)
    trainer.fit(model)
    assert callback.reset_events == 2
    trainer.fit_loop.epoch_loop.max_steps = 13
    trainer.fit(model)  # configure_optimizers gives fresh optimizers: their state starts over, the count goes on
    assert callback.reset_events == 4


def test_the_fit_start_report_names_the_periods_it_chose(caplog):
    model, optimizer = _bnb_model(betas=(0.9, 0.95))
    with caplog.at_level(logging.INFO):
        monitor = StaleStateMonitor(optimizer, reset="theory", coverage_steps=2, names=model)
        _train(model, optimizer, 12)  # grid estimates settle after 0.5 / (1 - 0.95) = 10 updates
    text = caplog.text
    assert "reset periods: None (fp32 (no staleness)) x1" in text  # the small bias keeps fp32 states
    assert "3 parameter(s) get their rho-hat (and period) from their stored values at check steps" in text
    periods = monitor.reset_periods()
    line = next(line for line in text.splitlines() if "reset periods from the settled grid estimates" in line)
    assert line.count(" x1") == 3  # one entry per estimated parameter: its period (none below rho-hat 1) and why
    for name in ("0.weight", "0.bias", "2.weight"):
        assert f"{periods[name]} (" in line
    assert all(u.rho_state != RHO_PENDING for u in monitor.rows())


@pytest.mark.parametrize("moments", [("m", "v"), ("v",)])
def test_full_resets_of_per_tensor_fp8_states_are_called_out_at_fit_start(caplog, moments):
    """A reset of both moments restarts a per-tensor fp8 v from zero, where its small lanes stay (the report says so
    and what to use instead); a v-only reset restarts v without zeros and gets no note."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = make_optimizer("qadamw:fp8_e4m3", model.parameters())
    with caplog.at_level(logging.INFO):
        StaleStateMonitor(optimizer, reset="theory", moments=moments, names=model)
        _train(model, optimizer, 2)
    note = [line for line in caplog.text.splitlines() if "with one scale per tensor" in line]
    if moments == ("v",):
        assert not note
    else:
        assert len(note) == 1 and "2 parameter(s)" in note[0] and "moments=('v',)" in note[0]
