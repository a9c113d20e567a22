"""torch.optim.Adafactor on a 2-layer MLP (for-loop and foreach): every state tensor of every parameter is measured
and reset, a reset restores a fresh optimizer's state (and so its next update), and the factors' stalls are counted
as each element of the matrix reads them."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

from lightning_stale import StaleStateMonitor
from lightning_stale.adapters import adapter_for
from lightning_stale.adapters.sampling import choose_sample

LR = 1e-2
FORMS = {"for-loop": False, "foreach": True}


def _mlp(device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3)).to(device, dtype)


def _backward(model: nn.Sequential, seed: int) -> None:
    """Gradients of a fixed regression batch (``seed`` picks it) in every parameter's ``grad``."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 12, generator=gen), torch.randn(32, 3, generator=gen)
    first = next(model.parameters())
    model.zero_grad()
    nn.functional.mse_loss(model(x.to(first)), y.to(first)).backward()


def _train(model: nn.Sequential, opt: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        _backward(model, seed)
        opt.step()


def _step_size(model: nn.Sequential, opt: torch.optim.Optimizer) -> float:
    """Largest |update| / lr of one optimizer step on the gradients already in place."""
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    return max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before)) / LR


@pytest.mark.parametrize("form", FORMS)
def test_every_state_tensor_is_measured_and_announced(device: torch.device, form: str, caplog) -> None:
    """Each state tensor but ``step`` (which resets with them) is a slot in the per-parameter metrics, the matrices'
    ``row_var`` and ``col_var`` included; the fit-start report counts them."""
    model = _mlp(device)
    opt = torch.optim.Adafactor(model.parameters(), lr=LR, foreach=FORMS[form])
    with caplog.at_level(logging.INFO), StaleStateMonitor(opt, names=model, log_per_param=True) as monitor:
        _train(model, opt, range(4))
        metrics = monitor.compute()
    for name, p in model.named_parameters():
        keys = set(opt.state[p]) - {"step"}
        assert keys == ({"row_var", "col_var"} if p.dim() > 1 else {"variance"})
        for key in keys:
            assert f"stale/{name}/{key}/frac" in metrics, (name, key)
    assert "v fp32 (beta=None) x6 (" in caplog.text  # two factors per matrix, one variance per bias


@pytest.mark.parametrize("form", FORMS)
def test_periodic_reset_restores_a_fresh_optimizer_on_every_parameter(device: torch.device, form: str) -> None:
    """The monitor's reset after step 5 zeroes both factors and ``step`` of the matrices too (before, it reset only
    the biases and the weights' ``step`` read 6 after step 6), in place; from there the optimizer takes a fresh
    optimizer's steps on a copy of the model, bit for bit, and its first update is a fresh one's (within a small
    multiple of the update just before the reset)."""
    model = _mlp(device)
    opt = torch.optim.Adafactor(model.parameters(), lr=LR, foreach=FORMS[form])
    with StaleStateMonitor(opt, reset="periodic", every=5) as monitor:
        _train(model, opt, range(4))
        _backward(model, 4)
        tensors = {(p, key): value for p in model.parameters() for key, value in opt.state[p].items()}
        before = _step_size(model, opt)  # step 5; the reset follows it
        assert monitor.reset_events == 1
        for (p, key), value in tensors.items():
            assert opt.state[p][key] is value and not value.any(), key  # zeroed in place, step included
        twin = copy.deepcopy(model)
        fresh = torch.optim.Adafactor(twin.parameters(), lr=LR, foreach=FORMS[form])
        _backward(model, 4)
        _backward(twin, 4)
        after, first = _step_size(model, opt), _step_size(twin, fresh)
        _train(model, opt, range(5, 8))  # steps 7 to 9, before the next reset
        _train(twin, fresh, range(5, 8))
    assert after == first and after <= 2 * before
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == fresh.state[q].keys()
        for key, value in opt.state[p].items():
            assert torch.equal(value, fresh.state[q][key]), key
        assert int(opt.state[p]["step"]) == 4


def test_factor_stalls_are_counted_per_element_of_the_matrix() -> None:
    """In bf16, late in the beta2 schedule (weight 1000**-0.8 = 0.004, under half a bf16 ulp for most updates), the
    factors stall; the logged fraction of a factor is the share of the matrix's elements (with a non-zero gradient)
    whose row's (column's) factor did not move, counted exactly."""
    model = _mlp(torch.device("cpu"), torch.bfloat16)
    opt = torch.optim.Adafactor(model.parameters(), lr=LR)
    weight = model[0].weight
    with StaleStateMonitor(opt, names=model, track="exact", log_per_param=True) as monitor:
        _train(model, opt, range(1))
        for state in opt.state.values():
            state["step"].fill_(1000.0)
        monitor.reset_window()
        state = opt.state[weight]
        _backward(model, 1)
        old = {key: state[key].clone() for key in ("row_var", "col_var")}
        opt.step()
        metrics = monitor.compute()
    counted = weight.grad != 0
    for key in ("row_var", "col_var"):
        kept = torch.broadcast_tensors(state[key] == old[key], counted)[0]
        expected = float((kept & counted).sum()) / float(counted.sum())
        assert 0.0 < expected < 1.0, key  # some factors moved, some did not
        assert metrics[f"stale/0.weight/{key}/frac"] == pytest.approx(expected, abs=1e-12), key


def test_a_factor_that_does_not_spread_over_its_matrix_is_not_read_and_warned_once() -> None:
    model = _mlp(torch.device("cpu"))
    opt = torch.optim.Adafactor(model.parameters(), lr=LR)
    _train(model, opt, range(1))
    opt.state[model[2].weight]["col_var"] = torch.zeros(2, 24)  # as a shard cut elsewhere could hold it
    adapter = adapter_for(opt)
    with pytest.warns(UserWarning, match=r"parameter 2 \(shape \(3, 24\)\): its col_var here has shape \(2, 24\)"):
        slots = adapter.slots()
    assert [s.key for s in slots if s.param is model[2].weight] == ["row_var"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapter.slots()  # warned once


@pytest.mark.parametrize("size", [None, 64], ids=["full", "runs"])
def test_sampled_factor_codes_are_those_of_the_sampled_elements(device: torch.device, size: int | None) -> None:
    """The engine's sample of a factor (gathered, not a view) reads, for each sampled element of the matrix, the code
    of its row's or column's factor, in the sample's shape."""
    model = _mlp(device)
    opt = torch.optim.Adafactor(model.parameters(), lr=LR)
    _train(model, opt, range(2))
    for slot in adapter_for(opt).slots():
        sample = choose_sample(slot.key, slot.param.shape, size, seed=3)
        codes = slot.sampled_codes(sample)
        assert codes.shape == sample.view(torch.empty(slot.param.shape)).shape
        assert torch.equal(codes.reshape(-1), slot.codes().reshape(-1)[sample.positions(device)]), slot.key


def test_inspect_reads_the_factors_of_a_saved_state_as_the_live_monitor_does(tmp_path) -> None:
    """``lightning-stale inspect`` on a saved Adafactor state: every state tensor the live monitor measures, the
    factors included (as matrix-shaped v slots), with the parameter's shape and the zero shares of the saved tensors."""
    from lightning_stale.commands.inspect import build_report

    model = _mlp(torch.device("cpu"))
    opt = torch.optim.Adafactor(model.parameters(), lr=LR)
    with StaleStateMonitor(opt, names=model) as monitor:
        _train(model, opt, range(3))
        next(iter(opt.state.values()))["row_var"][0] = 0.0  # one stored zero: a row whose 12 elements read it
        live = {(e.unit.key, e.slot.key): e.slot for e in monitor.engines()[0].entries.values()}
    path = tmp_path / "adafactor.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    report = build_report(str(path))
    params = report.optimizers[0].params
    rows = {(p.unit, m.key): (p, m) for p in params for m in p.moments}
    assert set(rows) == set(live)
    assert [p.shape for p in params] == [list(p.shape) for p in model.parameters()]
    for (unit, key), (param, row) in rows.items():
        assert row.moment == "v" and row.format == live[unit, key].format == "fp32"
        assert row.elements == live[unit, key].numel == param.shape[0] * (param.shape[1] if len(param.shape) > 1 else 1)
    assert rows["opt0.0", "row_var"][1].zero == pytest.approx(1 / 24)  # one of 24 rows: 12 of the 288 elements
    assert rows["opt0.0", "col_var"][1].zero == 0.0
