"""Hostile inputs (issue 6 item 4): every odd parameter, optimizer or lifecycle a real training run may throw at the
callback either works or fails fast with a message that says what to do."""

from __future__ import annotations

import io
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from helpers import Regression, fit, logged, make_optimizer, trainer_for
from lightning_stale import StaleStateCallback
from lightning_stale.policies import PeriodicReset

LR = 1e-3


class Net(Regression):
    """Linear(32, 128) -> ReLU -> Linear(128, 4) on 64 samples in batches of 4 (the first weight has 4096 elements:
    8-bit state everywhere); ``kind`` picks the optimizer (:func:`helpers.make_optimizer`)."""

    def __init__(self, kind: str = "bnb") -> None:
        super().__init__(kind, width=128, data_size=64, batch_size=4)


def slots(callback: StaleStateCallback, optimizer_index: int = 0):
    return callback.monitor.slots(optimizer_index)


def assert_fractions_valid(trainer: L.Trainer, diverged_from: int | None = None) -> None:
    """Every logged fraction is in [0, 1]; from row ``diverged_from`` on (the weights went NaN/Inf) every one is NaN."""
    for key in ("stale/v/frac", "stale/m/frac", "stale/frac"):
        values = logged(trainer, key)
        assert values, f"{key} never logged"
        healthy, diverged = values[:diverged_from], values[len(values) if diverged_from is None else diverged_from:]
        assert all(0.0 <= v <= 1.0 for v in healthy), f"{key}: {values}"
        assert all(math.isnan(v) for v in diverged), f"{key}: {values}"


# -- gradients -------------------------------------------------------------------------------------------------------


class NonFiniteGrads(Net):
    """Writes NaN, +Inf and -Inf into a few gradient elements of one step; an independent probe counts, on every
    step, the second-moment codes left unchanged among the elements whose gradient is finite and non-zero."""

    INJECT_AT = 4

    def on_before_optimizer_step(self, optimizer):
        if self.trainer.global_step == self.INJECT_AT:
            for p in self.parameters():
                flat = p.grad.view(-1)
                flat[0], flat[-1] = float("nan"), float("inf")
                flat[flat.numel() // 2] = -float("inf")

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        self.fractions = []
        key = {"bnb": "state2", "torch": "exp_avg_sq"}.get(self.kind, "exp_avg_sq")

        def codes(o, p):
            return o.state[p][key].reshape(-1).clone()

        def pre(o, args, kwargs):
            self.before = {p: codes(o, p) for p in o.state if key in o.state[p]}

        def post(o, args, kwargs):
            stalled = counted = 0
            for p, old in self.before.items():
                mask = (torch.isfinite(p.grad) & (p.grad != 0)).reshape(-1)
                stalled += int(((codes(o, p) == old) & mask).sum())
                counted += int(mask.sum())
            if self.before:
                self.fractions.append(stalled / counted)

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
        return opt


@pytest.mark.parametrize("kind", ["bnb", "torch", "qadamw:int8_dynamic"])
def test_non_finite_gradient_elements_are_not_counted_and_do_not_crash(tmp_path, kind, caplog):
    model = NonFiniteGrads(kind)
    with caplog.at_level("INFO"):
        trainer = fit(tmp_path, model, StaleStateCallback(track="exact"), steps=NonFiniteGrads.INJECT_AT + 1)
    # the injected step writes NaN into the weights it updates: its row is NaN (the run diverged), said once
    assert_fractions_valid(trainer, diverged_from=-1)
    assert sum("non-finite weights" in r.getMessage() for r in caplog.records) == 1
    # exact mode counts exactly what the probe counts, NaN/Inf elements left out, until the weights go NaN
    assert logged(trainer, "stale/v/frac")[:-1] == pytest.approx(model.fractions[:-1], rel=1e-6)  # logged as float32
    assert all(math.isfinite(v) for v in logged(trainer, "stale/v/drift")[:-1])


# -- parameters ------------------------------------------------------------------------------------------------------


class FrozenAndUnused(Net):
    """A frozen layer (in the optimizer, no grad), an unused trainable layer (grad stays None), an empty tensor."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(64, 64)
        self.empty = nn.Parameter(torch.zeros(0, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(self.frozen(x)), y) + self.empty.sum()


@pytest.mark.parametrize("kind", ["bnb", "qadamw:int8_dynamic"])
def test_frozen_unused_and_zero_element_parameters(tmp_path, kind):
    model = FrozenAndUnused(kind)
    cb = StaleStateCallback(reset="periodic", every=2, log_per_param=True)
    trainer = fit(tmp_path, model, cb, steps=5)
    assert_fractions_valid(trainer)
    tracked = {id(s.param) for s in slots(cb)}
    assert id(model.frozen.weight) not in tracked and id(model.unused.weight) not in tracked
    assert id(model.net[0].weight) in tracked
    assert cb.reset_events == 2
    empty = [s for s in slots(cb) if s.param is model.empty]
    assert all(s.numel == 0 for s in empty)  # tracked when the optimizer keeps state for it, harmlessly


@pytest.mark.parametrize("kind", ["bnb", "qadamw:int8_dynamic"])
def test_tiny_parameters_with_fp32_states(tmp_path, kind):
    class Tiny(Net):
        def __init__(self, kind):
            super().__init__(kind)
            self.net = nn.Sequential(nn.Linear(32, 7), nn.ReLU(), nn.Linear(7, 4))  # all below 4096 / 256 elements

    cb = StaleStateCallback(track="exact", reset="theory")
    trainer = fit(tmp_path, Tiny(kind), cb, steps=6)
    assert {s.format for s in slots(cb)} == {"fp32"}
    assert max(logged(trainer, "stale/v/frac")) < 0.05  # fp32 states barely stall
    assert set(cb.reset_periods().values()) == {None}  # the theory never resets fp32 states
    assert cb.reset_events == 0


class LateGroup(Net):
    """Adds a second param group (a new head) after two steps."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.head = nn.Linear(4, 4)
        self.with_head = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        return nn.functional.mse_loss(self.head(out) if self.with_head else out, y)

    def configure_optimizers(self):
        return make_optimizer(self.kind, self.net.parameters())

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == 2 and not self.with_head:
            self.trainer.optimizers[0].add_param_group({"params": self.head.parameters()})
            self.with_head = True


@pytest.mark.parametrize("kind", ["bnb", "qadamw:int8_dynamic"])
def test_add_param_group_mid_training(tmp_path, kind):
    model = LateGroup(kind)
    cb = StaleStateCallback(reset=PeriodicReset(3))
    resets: list[tuple[int, int]] = []
    cb.add_reset_listener(lambda event: resets.append((event.step, len(event.slots))))
    trainer = fit(tmp_path, model, cb, steps=8)
    assert_fractions_valid(trainer)
    assert id(model.head.weight) in {id(s.param) for s in slots(cb)}
    # net params reset after optimizer steps 3 and 6; the head (first stepped in step 3) after 5 and 8
    head_slots = 2 * len(list(model.head.parameters()))
    net_slots = 2 * len(list(model.net.parameters()))
    assert resets == [(3, net_slots), (5, head_slots), (6, net_slots), (8, head_slots)]


def test_several_param_groups_with_different_betas(tmp_path):
    from lightning_stale import theory

    class TwoGroups(Net):
        def configure_optimizers(self):
            from lightning_stale.optim import QuantizedAdamW

            return QuantizedAdamW([
                {"params": self.net[0].parameters(), "betas": (0.9, 0.999), "name": "first"},
                {"params": self.net[2].parameters(), "betas": (0.8, 0.9999), "name": "second"},
            ], lr=LR, state_format="bf16", min_quantized_size=1)

    model = TwoGroups()
    cb = StaleStateCallback(reset="theory")
    fit(tmp_path, model, cb, steps=3)
    betas = {(id(s.param), s.moment): s.beta for s in slots(cb)}
    assert betas[(id(model.net[0].weight), "m")] == 0.9 and betas[(id(model.net[0].weight), "v")] == 0.999
    assert betas[(id(model.net[2].weight), "m")] == 0.8 and betas[(id(model.net[2].weight), "v")] == 0.9999
    periods = cb.reset_periods()
    for name, b2 in (("net.0.weight", 0.999), ("net.2.weight", 0.9999)):
        assert theory.format_rho_hat("bf16", b2) >= 1  # stale enough for the theory to reset
        assert periods[name] == theory.reset_period(theory.format_rho_hat("bf16", b2), b2, 0.6)
    assert periods["net.0.weight"] != periods["net.2.weight"]


def test_bitsandbytes_param_groups_with_different_betas(tmp_path):
    class TwoGroups(Net):
        def configure_optimizers(self):
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit([
                {"params": self.net[0].parameters(), "betas": (0.9, 0.95)},
                {"params": self.net[2].parameters(), "betas": (0.8, 0.99)},
            ], lr=LR)

    model = TwoGroups()
    cb = StaleStateCallback()
    fit(tmp_path, model, cb, steps=3)
    betas = {(id(s.param), s.moment): s.beta for s in slots(cb)}
    for layer, (b1, b2) in ((model.net[0], (0.9, 0.95)), (model.net[2], (0.8, 0.99))):
        for p in layer.parameters():
            assert (betas[(id(p), "m")], betas[(id(p), "v")]) == (b1, b2)


# -- optimizers and lifecycle ----------------------------------------------------------------------------------------


class TwoOptimizers(Net):
    """Manual optimization: bitsandbytes for the first layer, QuantizedAdamW for the second, stepped every other
    batch (as a GAN's discriminator might be)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        first.step()
        if batch_idx % 2 == 0:
            second.step()

    def configure_optimizers(self):
        return make_optimizer("bnb", self.net[0].parameters()), make_optimizer("qadamw:int8_dynamic",
                                                                             self.net[2].parameters())


def test_two_optimizers_in_manual_optimization(tmp_path):
    cb = StaleStateCallback(reset=PeriodicReset(2), log_per_param=True)
    resets: list[str] = []
    cb.add_reset_listener(lambda event: resets.append(type(event.optimizer).__name__))
    model = TwoOptimizers()
    trainer = trainer_for(tmp_path, [cb], steps=12, limit_train_batches=8, max_epochs=1)
    trainer.fit(model)
    assert_fractions_valid(trainer)
    assert cb.monitor.steps == [8, 4]
    assert resets.count("AdamW8bit") == 4 and resets.count("QuantizedAdamW") == 2
    keys = set(cb.reset_periods())
    assert keys == {"opt0/net.0.weight", "opt0/net.0.bias", "opt1/net.2.weight", "opt1/net.2.bias"}


def test_same_callback_instance_for_two_fits_and_a_replaced_optimizer(tmp_path):
    cb = StaleStateCallback(reset=PeriodicReset(4))
    first = Net("bnb")
    t1 = fit(tmp_path / "a", first, cb, steps=5)
    old_opt = t1.optimizers[0]
    assert not old_opt._optimizer_step_pre_hooks and not old_opt._optimizer_step_post_hooks  # removed at teardown
    assert cb.monitor.steps == [5]

    second = Net("torch")  # a new model and a different optimizer family, same callback
    t2 = fit(tmp_path / "b", second, cb, steps=5)
    assert_fractions_valid(t2)
    assert cb.monitor.optimizers == [t2.optimizers[0]]
    assert cb.monitor.steps == [5]  # counting restarted with the new optimizer
    assert {s.format for s in slots(cb)} == {"fp32"}
    assert {id(s.param) for s in slots(cb)} <= {id(p) for p in second.parameters()}
    assert cb.reset_events == 1  # one reset (after step 4) in this fit: the count restarts with each fit
    assert logged(t2, "stale/resets")[-1] == 1


def test_optimizer_state_from_a_checkpoint_saved_without_the_callback(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer_for(tmp_path / "plain", [ckpt], steps=4, enable_checkpointing=True).fit(Net("bnb"))
    path = tmp_path / "ckpt" / "last.ckpt"
    assert "StaleStateCallback" not in str(torch.load(path, weights_only=False)["callbacks"].keys())

    cb = StaleStateCallback(track="exact", reset=PeriodicReset(3))
    resets: list[int] = []
    cb.add_reset_listener(lambda event: resets.append(trainer.global_step + 1))  # event.step counts from 1 here
    trainer = trainer_for(tmp_path / "resumed", [cb], steps=8)
    trainer.fit(Net("bnb"), ckpt_path=path)
    assert_fractions_valid(trainer)
    assert cb.monitor.steps == [4]  # steps seen by this callback: the resumed ones only
    # the restored state is 4 optimizer steps old, not fresh: overdue at once (step 5), then every 3 steps
    assert resets == [5, 8]
    drift = logged(trainer, "stale/v/drift")
    assert drift and abs(drift[0] - 1.0) < 0.2  # the shadow started from the restored state, not from zero


def test_checkpoint_with_a_different_number_of_optimizers_fails_with_advice(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = trainer_for(tmp_path / "two", [StaleStateCallback(), ckpt], steps=4, enable_checkpointing=True,
                          limit_train_batches=2, max_epochs=2)
    trainer.fit(TwoOptimizers())

    class OneOptimizer(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            x, y = batch
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.net(x), y))
            opt.step()

        def configure_optimizers(self):  # the first optimizer alone: Lightning loads its state, the callback's fails
            return make_optimizer("bnb", self.net[0].parameters())

    resumed = trainer_for(tmp_path / "one", [StaleStateCallback()], steps=8)
    with pytest.raises(MisconfigurationException, match="Resume with the same optimizers"):
        resumed.fit(OneOptimizer(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")


def test_unsupported_optimizer_fails_fast_with_advice_and_strict_false_falls_back(tmp_path):
    class Rprop(Net):
        def configure_optimizers(self):
            return torch.optim.Rprop(self.parameters(), lr=LR)

    with pytest.raises(TypeError, match="no lightning_stale adapter for optimizer torch.optim.rprop.Rprop.*strict=False"):
        fit(tmp_path / "strict", Rprop(), StaleStateCallback(), steps=2)
    with pytest.warns(UserWarning, match="generic adapter"):
        trainer = fit(tmp_path / "lenient", Rprop(), StaleStateCallback(strict=False), steps=3)
    assert logged(trainer, "stale/frac")


class RollsBackOptimizerState(Net):
    """Saves the optimizer state after step 2 and loads it back (a new set of state tensors) before step 5."""

    def on_train_batch_start(self, batch, batch_idx):
        opt = self.trainer.optimizers[0]
        if self.trainer.global_step == 2:
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            self.saved = buffer.getvalue()
        if self.trainer.global_step == 4:
            opt.load_state_dict(torch.load(io.BytesIO(self.saved), weights_only=False))


@pytest.mark.parametrize("kind", ["bnb", "qadamw:int8_dynamic"])
def test_optimizer_state_loaded_mid_training_is_followed(tmp_path, kind):
    model = RollsBackOptimizerState(kind)
    cb = StaleStateCallback(track="exact", underflow_guard=True)
    trainer = fit(tmp_path, model, cb, steps=7)
    assert_fractions_valid(trainer)
    opt = trainer.optimizers[0]
    for slot in slots(cb):  # the engine reads the tensors the optimizer holds now
        state = opt.state[slot.param]
        assert any(slot.codes().data_ptr() == t.data_ptr() for t in _tensors(state)), slot.key
    assert max(logged(trainer, "stale/v/frac")[-2:]) < 1.0  # a stale reference would read "never changes"


def _tensors(state: dict) -> list[torch.Tensor]:
    out = []
    for value in state.values():
        if isinstance(value, torch.Tensor):
            out.append(value)
            if hasattr(value, "codes"):
                out.append(value.codes)
    return out
