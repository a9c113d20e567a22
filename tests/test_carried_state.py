"""The monitor's state travels inside each watched optimizer's own ``state_dict()``: a loop that saves and loads only
its model and optimizer (``torch.save(optimizer.state_dict())``) resumes the monitor exactly, whether it loads before
the monitor attaches or after; a checkpoint that also holds the front-end's state applies that one, once; the carried
state loads with ``torch.load(weights_only=True)``; torch's distributed state-dict functions do not carry it."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from helpers import make_optimizer
from lightning_stale import StaleStateMonitor
from lightning_stale.monitor.carried import KEY

STEPS, SAVE_AT, EVERY = 30, 17, 5  # the save falls inside a logging window and inside a reset cycle
KINDS = {
    "bnb": ({"reset": "periodic", "every": 7}, {"min_8bit_size": 256}),  # bitsandbytes' load runs no load hooks
    "qadamw": ({"reset": "periodic", "every": 7}, {"compile": False}),  # its stochastic stream is optimizer state
    "bf16auto": ({"remedy": "auto"}, {}),  # bf16 weights: the write-back's choices and compensation buffers
}


def build(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))
    if kind == "bf16auto":
        model = model.to(torch.bfloat16)
    optimizer = make_optimizer({"bnb": "bnb", "qadamw": "qadamw:fp8_e4m3:stochastic"}.get(kind, "torch"),
                               model.parameters(), lr=1e-3, **KINDS[kind][1])
    return model, optimizer


def round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def run(kind: str, resume: dict | None = None, load: str = "before"):
    """STEPS steps of a plain loop (from ``resume``'s step when given, its model and optimizer state loaded ``before``
    or ``after`` the monitor is created); saves model and optimizer only at SAVE_AT. Returns (rows, reset steps,
    weights, the checkpoint)."""
    model, optimizer = build(kind)
    start = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        start = resume["step"]
        if load == "before":
            optimizer.load_state_dict(resume["optimizer"])
    monitor = StaleStateMonitor(optimizer, names=model, coverage_steps=EVERY, **KINDS[kind][0])
    if resume is not None and load == "after":
        optimizer.load_state_dict(resume["optimizer"])
    resets, rows, saved = [], [], None
    monitor.add_reset_listener(lambda event: resets.append(event.step))
    for step in range(start + 1, STEPS + 1):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(next(model.parameters()).dtype)
        nn.functional.mse_loss(model(x), x[:, :8]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % EVERY == 0:
            rows.append({"step": step, **monitor.compute()})
            monitor.reset_window()
        if step == SAVE_AT:
            saved = round_trip({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step})
    monitor.close()
    return rows, resets, [p.detach().clone() for p in model.parameters()], saved


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_loop_that_saves_only_its_optimizer_resumes_the_monitor_exactly(kind):
    rows, resets, weights, saved = run(kind)
    assert KEY in saved["optimizer"]["param_groups"][0]  # carried, and it passed torch.load(weights_only=True)
    assert resets or rows[-1].get("stale/remedy/weights", 0) > 0
    for load in ("before", "after"):  # a fresh copy each: torch's load keeps the checkpoint's step tensors
        resumed_rows, resumed_resets, resumed_weights, _ = run(kind, resume=round_trip(saved), load=load)
        assert resumed_rows == [row for row in rows if row["step"] > SAVE_AT], load  # every number, counters included
        assert resumed_resets == [step for step in resets if step > SAVE_AT], load
        assert all(torch.equal(a, b) for a, b in zip(resumed_weights, weights)), load


def test_without_the_carried_state_the_resume_differs():
    """The negative control: the same resume with the carried state removed from the checkpoint starts over."""
    rows, resets, weights, saved = run("bnb")
    del saved["optimizer"]["param_groups"][0][KEY]
    resumed_rows, resumed_resets, _, _ = run("bnb", resume=saved)
    assert resumed_resets != [step for step in resets if step > SAVE_AT] or \
        resumed_rows != [row for row in rows if row["step"] > SAVE_AT]


def test_an_explicit_state_wins_over_the_carried_one_and_is_applied_once():
    """A checkpoint holding both (the Trainer's: the callback's state and the optimizers'): the explicit state is
    loaded, the carried one is taken out of the optimizer and dropped, whatever step each is from."""
    model, optimizer = build("bnb")
    monitor = StaleStateMonitor(optimizer, reset="periodic", every=7)
    for step in range(1, 12):
        model(torch.randn(4, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 5:
            explicit = round_trip(monitor.state_dict())
    carried_checkpoint = round_trip(optimizer.state_dict())
    monitor.close()
    assert carried_checkpoint["param_groups"][0][KEY]["optimizers"][0]["steps"] == 11
    fresh_model, fresh = build("bnb")
    fresh.load_state_dict(carried_checkpoint)
    assert KEY in fresh.param_groups[0]  # waiting for a monitor
    resumed = StaleStateMonitor(fresh, reset="periodic", every=7, state=explicit)
    assert resumed.restored and resumed.steps == [5] and KEY not in fresh.param_groups[0]
    fresh_model(torch.randn(4, 32)).square().mean().backward()
    fresh.step()
    assert resumed.steps == [6]  # the dropped carried state was not applied at the step either
    carried = StaleStateMonitor(build("bnb")[1], reset="periodic", every=7)
    assert not carried.restored and carried.steps == [0]


def test_a_later_load_is_taken_before_the_next_step_and_a_bad_carried_state_is_skipped_with_a_warning():
    model, optimizer = build("bnb")
    monitor = StaleStateMonitor(optimizer)
    for _ in range(3):
        model(torch.randn(4, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint = round_trip(optimizer.state_dict())
    later = StaleStateMonitor(build("bnb")[1])
    later.close()
    other_model, other = build("bnb")
    monitor2 = StaleStateMonitor(other)
    other.load_state_dict(checkpoint)
    other_model(torch.randn(4, 32)).square().mean().backward()
    other.step()
    assert monitor2.steps == [4] and KEY not in other.param_groups[0]
    checkpoint["param_groups"][0][KEY]["version"] = 99  # a newer lightning_stale's
    third_model, third = build("bnb")
    third.load_state_dict(checkpoint)
    with pytest.warns(UserWarning, match="carried in the state dict of AdamW8bit could not be used.*version 99"):
        monitor3 = StaleStateMonitor(third)
    assert not monitor3.restored and KEY not in third.param_groups[0]


def test_torch_distributed_state_dicts_do_not_carry_it():
    """``get_optimizer_state_dict`` builds the load template from a fresh optimizer and refuses checkpoint keys it
    lacks: those checkpoints are left as torch writes them (the front-ends save the monitor's state beside them)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, optimizer = build("bf16auto")
    monitor = StaleStateMonitor(optimizer, remedy="auto")
    model(torch.randn(4, 32, dtype=torch.bfloat16)).square().mean().backward()
    optimizer.step()
    assert KEY in optimizer.state_dict()["param_groups"][0]
    assert all(KEY not in group for group in get_optimizer_state_dict(model, optimizer)["param_groups"])
    monitor.close()
    assert KEY not in optimizer.state_dict()["param_groups"][0]  # a closed monitor carries nothing
