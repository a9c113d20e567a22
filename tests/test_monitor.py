"""StaleStateMonitor in a plain PyTorch loop: metrics equal an independent count, close() detaches, state_dict()
round-trips to the same numbers as an uninterrupted run, and an error inside a hook never stops training."""

from __future__ import annotations

import copy

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from helpers import make_optimizer
from lightning_stale import StaleStateMonitor
from lightning_stale.messages import StaleStateInternalWarning
from lightning_stale.optim import QuantizedAdamW


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))
    return model, bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=256)


def train(model, optimizer, steps: int, start: int = 0) -> None:
    g = torch.Generator().manual_seed(1000 + start)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_compute_equals_an_independent_count_over_the_window():
    model, opt = model_and_optimizer()
    stalled = counted = 0
    before = {}

    def pre(o, args, kwargs):
        before.clear()
        before.update({p: o.state[p]["state2"].clone() for p in o.state if o.state[p]})

    def post(o, args, kwargs):
        nonlocal stalled, counted
        for p, old in before.items():
            mask = (p.grad != 0) & torch.isfinite(p.grad)
            stalled += int(((o.state[p]["state2"] == old) & mask).sum())
            counted += int(mask.sum())

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    monitor = StaleStateMonitor(opt, track="exact", names=model, log_per_param=True)
    train(model, opt, 3)
    monitor.compute()
    monitor.reset_window()  # closes the first window
    stalled = counted = 0
    train(model, opt, 7, start=3)
    metrics = monitor.compute()
    assert metrics["stale/v/frac"] == pytest.approx(stalled / counted, rel=1e-12)
    assert 0 < metrics["stale/v/frac"] < 1
    assert {"stale/m/frac", "stale/v/drift", "stale/v/underflow", "stale/v/predicted"} <= set(metrics)
    assert "stale/0.weight/state2/frac" in metrics  # per-parameter keys use the model's names
    assert monitor.compute() == metrics  # a readout: the window is only emptied by reset_window()
    monitor.reset_window()
    assert monitor.compute() == {}  # a window with no step has no row
    monitor.close()


def test_close_detaches_and_the_context_manager_closes():
    model, opt = model_and_optimizer()
    with StaleStateMonitor(opt) as monitor:
        train(model, opt, 2)
    train(model, opt, 3)
    assert monitor.steps == [2]
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_state_dict_resume_gives_the_uninterrupted_numbers():
    def fresh():
        model, opt = model_and_optimizer()
        return model, opt, StaleStateMonitor(opt, reset="periodic", every=4, sample_size=512, names=model)

    model, opt, monitor = fresh()
    train(model, opt, 6)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(monitor.state_dict()))
    train(model, opt, 6, start=6)
    expected = monitor.compute()

    model2, opt2, resumed = fresh()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    resumed.load_state_dict(saved[2])
    train(model2, opt2, 6, start=6)
    assert resumed.compute() == expected
    assert resumed.reset_events == monitor.reset_events == 3


class Broken(torch.optim.SGD):
    """An SGD whose state the registered adapter cannot read (a layout the adapter did not expect)."""


def test_an_error_inside_a_hook_is_reported_once_and_training_continues():
    from lightning_stale import register_adapter
    from lightning_stale.adapters.torch_optim import TorchSGDAdapter

    class BrokenAdapter(TorchSGDAdapter):
        def slots(self):
            raise RuntimeError("unexpected layout")

    register_adapter(Broken, BrokenAdapter)
    model, _ = model_and_optimizer()
    opt = Broken(model.parameters(), lr=0.1, momentum=0.9)
    monitor = StaleStateMonitor(opt)
    weights = model[0].weight.detach().clone()
    with pytest.warns(StaleStateInternalWarning, match="unexpected layout") as record:
        train(model, opt, 3)
    assert len(record) == 1  # once, not per step
    assert not torch.equal(weights, model[0].weight)  # the optimizer kept training
    monitor.close()


def test_resume_with_another_policy_uses_the_new_one_and_says_so(caplog):
    from lightning_stale import theory

    def run(reset, **kwargs):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))
        opt = QuantizedAdamW(model.parameters(), betas=(0.9, 0.95), state_format="fp4", min_quantized_size=1)
        return model, opt, StaleStateMonitor(opt, reset=reset, names=model, **kwargs)

    model, opt, monitor = run("periodic", every=100)
    train(model, opt, 5)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), monitor.state_dict()))
    model2, opt2, resumed = run("theory")
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    resets = []
    resumed.add_reset_listener(lambda event: resets.append(event.step))
    with caplog.at_level("INFO"):
        resumed.load_state_dict(saved[2])
    assert "the checkpoint was saved with PeriodicReset" in caplog.text
    train(model2, opt2, 40, start=5)
    k_star = theory.reset_period(theory.format_rho_hat("fp4_e2m2", 0.95), 0.95, 0.6)
    assert set(resumed.reset_periods().values()) == {k_star}  # the new policy's periods, not every=100
    assert resets[0] == k_star  # ages continued from the checkpoint: the first reset at age K*, step K*


@pytest.mark.parametrize("kind", ["bnb", "torch", "qadamw:int8_dynamic", "qadamw:fp8_e4m3"])
@pytest.mark.parametrize("track", ["sample", "exact"])
def test_monitoring_leaves_training_bit_identical(kind, track):
    """Without a reset policy the monitor only reads: parameters and optimizer state end bit-identical to a run
    without it, logging steps included."""
    def run(monitored: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))
        opt = make_optimizer(kind, model.parameters(), min_8bit_size=256)
        monitor = StaleStateMonitor(opt, track=track) if monitored else None
        for step in range(30):
            train(model, opt, 1, start=step)
            if monitor is not None and step % 10 == 9:
                monitor.compute()
                monitor.reset_window()
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [p.detach().clone() for p in model.parameters()] + [t.clone() for t in state]

    plain, monitored = run(False), run(True)
    assert len(plain) == len(monitored) and all(torch.equal(a, b) for a, b in zip(plain, monitored))
