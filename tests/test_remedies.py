"""The automatic remedy and the drift policy: decisions from synthetic signals, then one short real run per remedy."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Regression, fit, logged, make_optimizer
from torch import nn

from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.adapters import adapter_for
from lightning_stale.decide.ledger import Ledger
from lightning_stale.monitor import metrics
from lightning_stale.policies import DriftReset
from lightning_stale.remedies import GUARD, NONE, REMEDIES, RESET, STOCHASTIC, AutoRemedy

GUARD_KEY = metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, REMEDIES[GUARD])
RESET_KEY = metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, REMEDIES[RESET])
SR_KEY = metrics.key(metrics.DEFAULT_PREFIX, metrics.REMEDY, REMEDIES[STOCHASTIC])


def ledger_with(**columns: list[float]) -> Ledger:
    """A ledger whose per-parameter arrays hold the given signals (the other fields at their defaults)."""
    return Ledger.of(len(next(iter(columns.values()))), **columns)


# -- decisions from synthetic signals ---------------------------------------------------------------------------------

def test_auto_remedy_picks_the_remedy_of_each_cause():
    nan = math.nan
    ledger = ledger_with(
        underflow=[0.02, 0.0, 0.0, 0.0, nan, 0.0, 0.05, 0.0],
        drift=[1.0, 1.0, 1.7, 0.6, 1.7, 1.7, 0.5, 1.49],
        age=[100, 100, 100, 100, 100, 10, 100, 100],
    )
    chosen = AutoRemedy(drift_band=1.5, min_interval=50).choose(ledger)
    # underflow -> guard; drifted high or low -> reset; no underflow reading yet still resets on drift; too young
    # for a reset -> nothing; underflow beats drift (an underflowing v reads as drifted low); in band -> nothing
    assert chosen.tolist() == [GUARD, NONE, RESET, RESET, RESET, NONE, GUARD, NONE]


def test_auto_remedy_threshold_and_unread_signals():
    ledger = ledger_with(underflow=[math.nan, 0.001, 0.01], drift=[math.nan] * 3, age=[500] * 3)
    assert AutoRemedy().choose(ledger).tolist() == [NONE, GUARD, GUARD]
    assert AutoRemedy(underflow_threshold=0.005).choose(ledger).tolist() == [NONE, NONE, GUARD]


@pytest.mark.parametrize(("rho", "beta", "rounding", "expected"), [
    (2.71, 0.999, "nearest", True),  # bf16: drifts, and stochastic rounding's noise is 6% of v
    (4.4, 0.999, "nearest", True),  # noise 9.8%
    (4.5, 0.999, "nearest", False),  # noise 10.1%: over the bound
    (43.3, 0.999, "nearest", False),  # fp8 per tensor: noise 97%, left to measurement (its gap is underflow)
    (13.0, 0.999, "nearest", False),  # 8-bit maps: noise 29%
    (0.67, 0.985, "nearest", False),  # rho-hat < 1: the state keeps moving
    (2.71, 0.999, "stochastic", False),  # already unbiased
    (None, 0.999, "nearest", False),  # no theory (fp32)
    (2.71, None, "nearest", False),  # not an EMA
])
def test_foresight_calls_for_stochastic_rounding_where_drift_is_predicted_and_its_noise_is_small(rho, beta, rounding,
                                                                                                  expected):
    reason = AutoRemedy().foresee(rho, beta, rounding)
    assert (reason is not None) == expected
    if expected:
        assert reason.startswith(f"predicted drift (rho-hat {rho:.3g}, nearest rounding")


def test_drift_reset_due_matches_should_reset():
    ledger = ledger_with(drift=[1.0, 1.26, 0.79, math.nan, 2.0], age=[60, 60, 60, 60, 20])
    policy = DriftReset(band=1.25, min_interval=50)
    assert policy.due(ledger, step=60).tolist() == [False, True, True, False, False]


# -- one short real run per remedy ------------------------------------------------------------------------------------

def underflowing_fp8(steps: int, remedy: str | None):
    """QuantizedAdamW with one fp8 scale per tensor where one huge gradient element flushes the others' v to zero
    while their m stays representable (the underflow hazard); returns the monitor and the adapter's slots."""
    from lightning_stale.optim import QuantizedAdamW

    torch.manual_seed(0)
    model = nn.Linear(64, 256)
    opt = QuantizedAdamW(model.parameters(), state_format="fp8_e4m3", min_quantized_size=256)
    monitor = StaleStateMonitor(opt, remedy=remedy, coverage_steps=1, sample_size=4096, names=model)
    for _ in range(steps):
        model.weight.grad = torch.full_like(model.weight, 1e-2)
        model.weight.grad[0, 0] = 1e3
        model.bias.grad = torch.ones_like(model.bias)
        opt.step()
    return monitor, adapter_for(opt).slots(), model


def hazard(slots, param) -> int:
    v, m = (next(s for s in slots if s.param is param and s.moment == k) for k in ("v", "m"))
    return int((v.zero_mask() & ~m.zero_mask()).sum())


def test_auto_guards_the_parameter_whose_v_underflows(caplog):
    monitor, slots, model = underflowing_fp8(steps=3, remedy=None)
    assert hazard(slots, model.weight) > 0  # the hazard is there without the remedy
    with caplog.at_level("INFO"):
        monitor, slots, model = underflowing_fp8(steps=3, remedy="auto")
    units = {u.param is model.weight: u for u in monitor.rows()}
    assert REMEDIES[units[True].remedy] == "guard" and units[True].guard_left > 0 and units[True].underflow > 0.5
    assert REMEDIES[units[False].remedy] == "none"  # the bias never underflows
    assert hazard(slots, model.weight) == 0  # guarded after the check: no element with v zero and m non-zero
    row = monitor.compute()
    assert row[GUARD_KEY] == 1.0 and row[RESET_KEY] == 0.0 and monitor.reset_events == 0
    assert "underflow guard on for 'weight'" in caplog.text


def test_auto_never_guards_a_grid_without_zero():
    """fp4's second-moment map has no zero (its smallest code is a positive value): nothing there can underflow, so
    the automatic remedy must not read its code 0 as underflow."""
    from lightning_stale.optim import QuantizedAdamW

    torch.manual_seed(0)
    model = nn.Linear(64, 256)
    opt = QuantizedAdamW(model.parameters(), state_format="fp4", min_quantized_size=256)
    monitor = StaleStateMonitor(opt, remedy="auto", coverage_steps=1)
    for _ in range(5):
        for p in model.parameters():  # magnitudes over 4 decades: most of each block takes the smallest code
            p.grad = torch.randn_like(p) * 10 ** (-4 * torch.rand_like(p))
        opt.step()
    assert all(u.underflow == 0.0 and REMEDIES[u.remedy] == "none" for u in monitor.rows())


def decaying_bf16(steps: int, kind: str = "qadamw:bf16", **options):
    """bf16 states under nearest rounding with a gradient that drops 100x after 20 steps: the stored v cannot follow
    the decay (each step changes it by 0.1%, under half a bf16 ulp), so it drifts above its fp32 EMA. ``kind``:
    ``qadamw:bf16`` (QuantizedAdamW with bf16 states) or ``torch_bf16`` (torch AdamW on bf16 parameters, no
    stochastic rounding)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)  # one parameter: the logged drift is its drift
    if kind == "torch_bf16":
        model = model.bfloat16()
    opt = make_optimizer(kind, model.parameters(), lr=1e-4, min_quantized_size=256)
    monitor = StaleStateMonitor(opt, coverage_steps=10, **options)
    reset_steps: list[int] = []
    monitor.add_reset_listener(lambda event: reset_steps.append(event.step))
    for step in range(steps):
        scale = 1.0 if step < 20 else 1e-2
        for p in model.parameters():
            p.grad = torch.randn_like(p) * scale
        opt.step()
    return monitor, reset_steps, opt


def test_drift_is_measured_and_nothing_resets_without_a_policy():
    monitor, resets, _ = decaying_bf16(500)
    assert resets == [] and monitor.compute()["stale/v/drift"] > 1.5


def test_drift_policy_resets_when_v_leaves_the_band():
    monitor, resets, _ = decaying_bf16(500, reset="drift")
    # ln(1.5) / (1 - 0.999) = 405 steps of decay after step 20, read at the next check (every 10 steps)
    assert resets and 400 <= resets[0] <= 450
    assert monitor.rows()[0].resets >= 1
    assert monitor.compute()["stale/v/drift"] < 1.5  # restarted: stored v and its shadow agree again


def test_auto_switches_a_drifting_moment_to_stochastic_rounding_where_it_can():
    # no foresight (which would switch bf16 at the first step): the measured drift decides
    monitor, resets, opt = decaying_bf16(500, remedy=AutoRemedy(drift_rho=math.inf))
    assert resets == [] and opt.param_groups[0]["rounding"] == "stochastic"
    assert REMEDIES[monitor.rows()[0].remedy] == "stochastic"
    row = monitor.compute()
    assert row[SR_KEY] == 1.0 and row[RESET_KEY] == 0.0 and row[GUARD_KEY] == 0.0
    again, _, opt = decaying_bf16(1, remedy=AutoRemedy(drift_rho=math.inf))
    again.load_state_dict(monitor.state_dict())
    opt.step()  # the resumed ledger is adopted at the next step
    assert REMEDIES[again.rows()[0].remedy] == "stochastic"


def test_auto_resets_a_drifting_moment_where_rounding_cannot_change():
    # weights="off": without the weight write-back, torch's bf16 moments keep torch's nearest rounding
    monitor, resets, _ = decaying_bf16(500, kind="torch_bf16", remedy="auto", weights="off")
    assert resets and 380 <= resets[0] <= 460
    row = monitor.compute()
    assert row[RESET_KEY] == monitor.remedy_resets >= 1 and row[GUARD_KEY] == 0.0 and row[SR_KEY] == 0.0
    again, _, _ = decaying_bf16(1, kind="torch_bf16", remedy="auto", weights="off")
    again.load_state_dict(monitor.state_dict())
    assert again.remedy_resets == monitor.remedy_resets


def test_auto_write_back_rounds_torchs_bf16_moments_so_they_do_not_drift():
    """The same run with the write-back (auto takes the stalling weights over at fit start): it also computes and
    stochastically rounds the bf16 moments, so v follows its fp32 EMA and no reset is needed."""
    monitor, resets, _ = decaying_bf16(500, kind="torch_bf16", remedy="auto")
    row = monitor.compute()
    assert resets == [] and row["stale/remedy/weights"] == 1.0 and row["stale/v/drift"] < 1.1  # measured: 1.005


def test_auto_leaves_healthy_fp32_training_untouched():
    def run(remedy: str | None) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        monitor = StaleStateMonitor(opt, remedy=remedy, coverage_steps=5) if remedy else None
        data = torch.Generator().manual_seed(1)
        for _ in range(60):
            x = torch.randn(16, 32, generator=data)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if monitor is not None:
            row = monitor.compute()
            assert row[GUARD_KEY] == 0.0 and row[RESET_KEY] == 0.0 and monitor.reset_events == 0
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    assert torch.equal(run(None), run("auto"))


def test_trainer_logs_what_the_automatic_remedy_did(tmp_path):
    model = Regression("qadamw:fp8_e4m3", lr=5e-2)
    trainer = fit(tmp_path, model, StaleStateCallback(remedy="auto"), steps=20, log_every_n_steps=5)
    guarded, resets = logged(trainer, GUARD_KEY), logged(trainer, RESET_KEY)
    # at this learning rate one fp8 weight underflows early: guarded from the first check, its window outlasts the
    # readings that follow, and nothing drifts out of band in 20 steps
    assert len(guarded) == len(resets) == 4 and all(r == 0.0 for r in resets)
    assert guarded[0] >= 1 and guarded == sorted(guarded, reverse=True)


@pytest.mark.parametrize(("kind", "switched", "said"), [
    ("qadamw:bf16", True, "stochastic rounding from step 2 for 1 parameter(s)"),
    ("qadamw:fp8_e4m3", False, None),  # rho-hat 43: its noise would be 97% of v
    # torch keeps its bf16 moments with nearest rounding; the weight write-back rounds them stochastically once it
    # takes a parameter over (here none: 0% of its weights stall at this lr)
    ("torch_bf16", False, "the weight write-back rounds them stochastically from the step it takes them over"),
    ("bnb", False, None),  # 8-bit map, rho-hat over 10
])
def test_auto_foresight_per_family(caplog, kind, switched, said):
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    if kind == "torch_bf16":
        model = model.bfloat16()
    opt = make_optimizer(kind, model.parameters(), min_quantized_size=256, min_8bit_size=256)
    with caplog.at_level("INFO"):
        monitor = StaleStateMonitor(opt, remedy="auto", coverage_steps=5, names=model)
        for _ in range(3):
            model.weight.grad = torch.randn_like(model.weight)
            opt.step()
    rounding = opt.param_groups[0].get("rounding")
    assert (rounding == "stochastic") == switched
    assert (REMEDIES[monitor.rows()[0].remedy] == "stochastic") == switched
    assert ("predicted drift" in caplog.text) == (said is not None)
    if said:
        assert said in caplog.text


def test_reset_parameters_stay_guarded_while_their_v_underflows():
    """A reset restarts v from zero; under one fp8 scale per tensor its small elements round to zero and stay there:
    the post-reset guard must outlast its fixed window while the underflow lasts."""
    from lightning_stale.optim import QuantizedAdamW
    from lightning_stale.policies import ResetPolicy

    class Once(ResetPolicy):
        def should_reset(self, unit, step):
            return step == 3

    torch.manual_seed(0)
    model = nn.Linear(64, 256)
    opt = QuantizedAdamW(model.parameters(), state_format="fp8_e4m3", min_quantized_size=256)
    monitor = StaleStateMonitor(opt, reset=Once(), coverage_steps=5, sample_size=4096)
    for _ in range(60):  # twice the 30-step post-reset window
        model.weight.grad = torch.full_like(model.weight, 1e-2)
        model.weight.grad[0, 0] = 1e3  # flushes the others' v to zero
        model.bias.grad = torch.ones_like(model.bias)
        opt.step()
    weight = next(u for u in monitor.rows() if u.param is model.weight)
    assert weight.resets == 1 and weight.underflow > 0.5 and weight.guard_left > 0
    assert hazard(adapter_for(opt).slots(), model.weight) == 0
