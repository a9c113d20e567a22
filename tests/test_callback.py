"""StaleStateCallback inside real Lightning Trainers with real optimizers."""

from __future__ import annotations

import importlib.util

import lightning as L
import pytest
import torch

from helpers import Regression, fit, logged
from lightning_stale import StaleStateCallback
from lightning_stale.policies import AdaptiveReset, PeriodicReset, ResetPolicy

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


class ResetRecorder:
    """Collects the global steps at which the callback reset something."""

    def __init__(self, callback: StaleStateCallback) -> None:
        self.steps: list[int] = []
        self.callback = callback
        callback.add_reset_listener(lambda event: self.steps.append(event.step))


KINDS = ["torch_bf16", "bnb", "qadamw:int8_dynamic", "qadamw:fp8_e4m3"] + (["torchao"] if HAS_TORCHAO else [])


@pytest.mark.parametrize("kind", KINDS)
def test_keys_reach_the_csv_logger_and_callback_metrics(tmp_path, kind):
    trainer = fit(tmp_path, Regression(kind), StaleStateCallback(), steps=12)
    for key in ("stale/v/frac", "stale/m/frac", "stale/frac", "stale/v/drift", "stale/v/underflow"):
        values = logged(trainer, key)
        assert values, f"{key} never logged for {kind}"
        assert all(0.0 <= v <= 1.0 for v in values) or key == "stale/v/drift"
    assert "stale/v/frac" in trainer.callback_metrics
    if kind != "torch_fp32":
        assert logged(trainer, "stale/v/predicted"), "no theory prediction for a low-precision v"


class CloneCompare:
    """Independent probe: snapshot every v state tensor before the step, count unchanged non-zero-grad elements."""

    def __init__(self, optimizer: torch.optim.Optimizer, key: str) -> None:
        self.key, self.before, self.fractions = key, {}, []
        optimizer.register_step_pre_hook(self.pre)
        optimizer.register_step_post_hook(self.post)

    def pre(self, opt, args, kwargs):
        self.before = {p: s[self.key].clone() for p, s in opt.state.items() if self.key in s}

    def post(self, opt, args, kwargs):
        stalled = counted = 0
        for p, old in self.before.items():
            mask = p.grad.reshape(-1) != 0
            same = opt.state[p][self.key].reshape(-1) == old.reshape(-1)
            stalled += int((same & mask).sum())
            counted += int(mask.sum())
        if self.before:
            self.fractions.append(stalled / counted)


class ProbedRegression(Regression):
    def configure_optimizers(self):
        opt = super().configure_optimizers()
        self.probe = CloneCompare(opt, "exp_avg_sq" if self.kind == "torch_bf16" else "state2")
        return opt


@pytest.mark.parametrize("kind", ["torch_bf16", "bnb"])
def test_exact_mode_equals_an_independent_clone_and_compare(tmp_path, kind):
    model = ProbedRegression(kind)
    trainer = fit(tmp_path, model, StaleStateCallback(track="exact"), steps=15)
    fractions = logged(trainer, "stale/v/frac")
    assert len(fractions) == len(model.probe.fractions) == 14  # the first step has nothing to compare against
    assert fractions == pytest.approx(model.probe.fractions, abs=1e-6)
    assert max(fractions) > 0.0  # the comparison is not trivially all-moving


def test_sample_mode_is_within_binomial_tolerance_of_exact(tmp_path):
    exact = fit(tmp_path / "exact", Regression("bnb", width=1024), StaleStateCallback(track="exact"), steps=30)
    sample = fit(tmp_path / "sample", Regression("bnb", width=1024), StaleStateCallback(sample_size=1024), steps=30)
    e = logged(exact, "stale/v/frac")
    s = logged(sample, "stale/v/frac")
    assert len(e) == len(s)
    # the last 10 steps: stall fraction well inside (0, 1); each sample has >= ~1000 elements per slot
    for fe, fs in zip(e[-10:], s[-10:]):
        sigma = (fe * (1 - fe) / 1024) ** 0.5
        assert abs(fe - fs) <= 5 * sigma + 1e-3


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (PeriodicReset(5), [5, 10, 15, 20]),
        (PeriodicReset(7, moments=("v",)), [7, 14]),
    ],
)
def test_periodic_resets_happen_after_the_step_completing_the_period(tmp_path, policy, expected):
    cb = StaleStateCallback(reset=policy)
    recorder = ResetRecorder(cb)
    fit(tmp_path, Regression("qadamw:fp8_e4m3"), cb, steps=20)
    assert recorder.steps == expected
    assert cb.reset_events == len(expected)


def test_periodic_shortcut_and_reset_state_is_fresh(tmp_path):
    cb = StaleStateCallback(reset="periodic", every=6)
    model = Regression("qadamw:int8_dynamic")
    fit(tmp_path, model, cb, steps=6)
    opt = model.trainer.optimizers[0]
    for p, state in opt.state.items():
        for moment in ("m", "v"):
            assert torch.count_nonzero(opt.moment_format(p, moment).dequantize(opt.moment_state(p, moment))) == 0
        assert float(state["step_m"]) == 0 and float(state["step_v"]) == 0


def test_theory_resets_at_the_theory_period(tmp_path):
    from lightning_stale import theory

    k_star = theory.reset_period(theory.format_rho_hat("fp4_e2m2", 0.95), 0.95, 0.6)
    assert 2 <= k_star <= 30
    cb = StaleStateCallback(reset="theory")
    recorder = ResetRecorder(cb)
    # b2 = 0.95 makes fp4's K* (rho-hat 1.7) short enough for a unit test
    fit(tmp_path, Regression("qadamw:fp4", betas=(0.9, 0.95), min_quantized_size=1), cb, steps=3 * k_star + 1)
    assert recorder.steps == [k_star, 2 * k_star, 3 * k_star]
    assert set(cb.reset_periods().values()) == {k_star}


def test_theory_does_not_reset_states_that_keep_moving(tmp_path):
    cb = StaleStateCallback(reset="theory")
    # bf16 at b2 = 0.99: rho-hat 0.27, most updates move the state
    fit(tmp_path, Regression("qadamw:bf16", betas=(0.9, 0.99), min_quantized_size=1), cb, steps=5)
    assert set(cb.reset_periods().values()) == {None}


def test_adaptive_resets_a_stale_state_and_not_an_fp32_control(tmp_path):
    # b2 = 0.95 keeps E(k) small after a few dozen steps; fp4's v (rho-hat 1.7) stalls ~90% of the time
    stale = StaleStateCallback(reset=AdaptiveReset(min_interval=5))
    fit(tmp_path / "stale", Regression("qadamw:fp4", betas=(0.9, 0.95)), stale, steps=60)
    control = StaleStateCallback(reset=AdaptiveReset(min_interval=5))
    fit(tmp_path / "fp32", Regression("qadamw:fp32", betas=(0.9, 0.95)), control, steps=60)
    assert stale.reset_events >= 1
    assert control.reset_events == 0


def test_custom_policy_decision_method_is_used(tmp_path):
    class EveryThird(ResetPolicy):
        needs_sync = False

        def should_reset(self, unit, step):
            return step % 3 == 0

    cb = StaleStateCallback(reset=EveryThird(moments=("v",)))
    recorder = ResetRecorder(cb)
    fit(tmp_path, Regression("qadamw:bf16"), cb, steps=9)
    assert recorder.steps == [3, 6, 9]


def test_fitting_twice_does_not_double_register_hooks(tmp_path):
    class CountHooks(Regression):
        def training_step(self, batch, batch_idx):
            self.hook_counts.append(len(self.trainer.optimizers[0]._optimizer_step_post_hooks))
            return super().training_step(batch, batch_idx)

    model = CountHooks("bnb")
    model.hook_counts = []
    cb = StaleStateCallback(track="exact")
    first = fit(tmp_path / "a", model, cb, steps=5).optimizers[0]
    assert not first._optimizer_step_post_hooks and not first._optimizer_step_pre_hooks  # removed at teardown
    second = fit(tmp_path / "b", model, cb, steps=5).optimizers[0]
    assert model.hook_counts == [1] * 10
    assert not second._optimizer_step_post_hooks and not second._optimizer_step_pre_hooks


def test_post_reset_warmup_scales_the_first_updates(tmp_path):
    class Snapshots(L.Callback):
        def __init__(self):
            self.weights = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.weights.append(pl_module.net[0].weight.detach().clone())

    runs = {}
    for warmup in (0, 4):
        snaps = Snapshots()
        cb = StaleStateCallback(reset="periodic", every=5, warmup_steps=warmup)
        trainer = L.Trainer(default_root_dir=tmp_path, max_steps=8, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, snaps])
        trainer.fit(Regression("qadamw:fp32"))
        runs[warmup] = snaps.weights
    plain, warm = runs[0], runs[4]
    assert torch.equal(plain[4], warm[4])  # identical up to the reset after step 5
    full, scaled = plain[5] - plain[4], warm[5] - warm[4]
    assert full.abs().max() > 0
    torch.testing.assert_close(scaled, full / 4, rtol=1e-4, atol=1e-7)  # step 6: the first of 4 warm-up steps
    with pytest.raises(ValueError, match="`warmup_steps` must be"):
        StaleStateCallback(warmup_steps=-1)
