"""Stale weights through the monitor: bf16 weights measured (exact and sampled) against an independent count,
predicted, taken over by ``weights=`` and ``remedy="auto"``, saved and resumed exactly, left alone in fp32."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from lightning_stale import StaleStateCallback, StaleStateMonitor

warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def _model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)).to(dtype)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    x = torch.randn(32, 64, generator=gen).to(next(model.parameters()).dtype)
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("track,tolerance", [("exact", 1e-12), ("sample", 0.05)])
def test_weight_stall_equals_an_independent_count(track, tolerance):
    """``stale/w/frac``: stored bf16 weights unchanged by a step although their gradient was non-zero and finite,
    against a count of every element made outside the package over the same logged window."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    monitor = StaleStateMonitor(opt, track=track, sample_size=256, names=model)
    gen = torch.Generator().manual_seed(1)
    stalled = counted = 0
    for step in range(40):
        before = [p.detach().clone() for p in model.parameters()]
        _step(model, opt, gen)
        if step == 19:
            monitor.reset_window()  # the logged window is steps 20-39
        if step >= 20:
            for old, p in zip(before, model.parameters()):
                moved = (old.view(torch.int16) != p.detach().view(torch.int16))
                nonzero = (p.grad != 0) & p.grad.isfinite()
                stalled += int((~moved & nonzero).sum())
                counted += int(nonzero.sum())
    row = monitor.compute()
    monitor.close()
    assert row["stale/w/frac"] == pytest.approx(stalled / counted, abs=tolerance)
    assert 0.2 < stalled / counted < 0.99  # at lr 1e-4 a share of the bf16 weights stalls, not all
    assert row["stale/w/predicted"] == pytest.approx(row["stale/w/frac"], abs=0.1)
    assert row["stale/frac"] != row["stale/w/frac"]  # the overall fraction stays the optimizer states'


def test_fp32_weights_are_not_measured_and_auto_changes_nothing():
    reference, model = _model(torch.float32), _model(torch.float32)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = StaleStateMonitor(opt, remedy="auto", names=model)
    for seed in range(5):
        _step(reference, plain, torch.Generator().manual_seed(seed))
        _step(model, opt, torch.Generator().manual_seed(seed))
    row = monitor.compute()
    assert not [k for k in row if "/w/" in k or k.endswith("/weights")]
    assert monitor.resident_bytes() > 0 and all(t.writeback is None for t in monitor._pipelines)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))


@pytest.mark.parametrize(("family", "said"), [
    ("torch", "compensated summation of the weights and stochastic rounding of the moments from step"),
    # bitsandbytes keeps its own (8-bit) moments: the weights alone
    ("bitsandbytes", "compensated summation from step"),
    # Lion moves each weight by lr: at 1e-5 no bf16 weight here moves under nearest rounding
    ("lion", "compensated summation from step"),
    ("sgd", "compensated summation of the weights and stochastic rounding of the moments from step"),
])
def test_auto_takes_over_stalling_weights_and_logs_it(caplog, family, said):
    model = _model()
    if family == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # below every weight's half gap: nearest stalls them all
    elif family == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-5, momentum=0.9)
    else:
        bnb = pytest.importorskip("bitsandbytes")
        make = bnb.optim.AdamW8bit if family == "bitsandbytes" else bnb.optim.Lion8bit
        opt = make(model.parameters(), lr=1e-5, min_8bit_size=256)
    with caplog.at_level("INFO"):
        monitor = StaleStateMonitor(opt, remedy="auto", names=model)
        _step(model, opt, torch.Generator().manual_seed(1))
    assert f"weight write-back with {said}" in caplog.text
    gen = torch.Generator().manual_seed(0)
    start = [p.detach().float() for p in model.parameters()]
    for _ in range(30):
        _step(model, opt, gen)
    row = monitor.compute()
    assert row["stale/remedy/weights"] == 4.0  # every bf16 parameter, chosen at fit start from the threshold
    writeback = monitor._pipelines[0].writeback
    moments = "stochastic" if family in ("torch", "sgd") else "nearest"
    elements = sum(p.numel() for p in model.parameters())
    assert (writeback.rounding, writeback.moments) == ("compensated", moments)
    # the buffers live in the optimizer's state, 2 B per bf16 element, and not among the monitor's own bytes
    assert monitor.weight_buffer_bytes() == writeback.buffer_bytes() == 2 * elements
    # what the weights hold (with the compensated residual) moved where nearest rounding would have stalled them
    held = [p.float() + opt.state[p]["lightning_stale.compensation"].float() for p in model.parameters()]
    moved = sum(int((a != b).sum()) for a, b in zip(start, held))
    assert moved > 0.2 * elements
    monitor.close()
    assert opt.param_groups[0]["lr"] == 1e-5


def test_a_stochastic_checkpoint_continues_under_compensated_auto_and_not_the_reverse():
    """A checkpoint of ``weights="stochastic+moments"`` (no buffers) continues under the automatic remedy
    (compensated summation from a zero residual, the same parameters taken over, no line about missing buffers);
    the reverse would drop the residuals and is refused, naming both roundings."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    monitor = StaleStateMonitor(opt, weights="stochastic+moments", names=model)
    for seed in range(3):
        _step(model, opt, torch.Generator().manual_seed(seed))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "stale": monitor.state_dict()})
    monitor.close()

    resumed = _model()
    resumed.load_state_dict(saved["model"])
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-5)
    opt.load_state_dict(saved["opt"])
    monitor = StaleStateMonitor(opt, remedy="auto", names=resumed)
    monitor.load_state_dict(saved["stale"])
    writeback = monitor._pipelines[0].writeback
    assert writeback.rounding == "compensated" and writeback.handled == 4
    _step(resumed, opt, torch.Generator().manual_seed(3))
    assert monitor.weight_buffer_bytes() == 2 * sum(p.numel() for p in resumed.parameters())
    compensated = copy.deepcopy(monitor.state_dict())
    monitor.close()

    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-5)
    monitor = StaleStateMonitor(opt, weights="stochastic+moments", names=resumed)
    with pytest.raises(ValueError, match="rounding 'compensated', this is 'stochastic'"):
        monitor.load_state_dict(compensated)
    monitor.close()


def test_weights_choice_on_an_unsupported_optimizer_is_a_configuration_error():
    model = _model()
    with pytest.raises(ValueError, match="`weights`='stochastic'.*Adagrad"):
        StaleStateMonitor(torch.optim.Adagrad(model.parameters(), lr=0.1), weights="stochastic")
    with pytest.raises(ValueError, match="`weights` must be one of"):
        StaleStateCallback(weights="kahan")
    from lightning_stale.optim import QuantizedAdamW

    with pytest.raises(ValueError, match="`weights`='stochastic\\+moments'.*moments in the parameter's dtype"):
        StaleStateMonitor(QuantizedAdamW(model.parameters(), state_format="bf16"), weights="stochastic+moments")
    monitor = StaleStateMonitor(torch.optim.Adagrad(model.parameters(), lr=0.1), remedy="auto")
    assert all(t.writeback is None for t in monitor._pipelines)  # auto: the weights stay the optimizer's own
    monitor.close()


def test_compensated_write_back_resumes_bit_exactly_from_the_monitor_state():
    gen_steps = [torch.Generator().manual_seed(s) for s in range(20)]
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    monitor = StaleStateMonitor(opt, weights="compensated", names=model)
    for gen in gen_steps[:10]:
        _step(model, opt, gen)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "stale": monitor.state_dict()})
    assert monitor.weight_buffer_bytes() == 2 * sum(p.numel() for p in model.parameters())  # in the optimizer state
    for gen in gen_steps[10:]:
        _step(model, opt, torch.Generator().manual_seed(gen.initial_seed()))
    monitor.close()

    resumed = _model()
    resumed.load_state_dict(saved["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=3e-4, weight_decay=0.1)
    resumed_opt.load_state_dict(saved["opt"])
    resumed_monitor = StaleStateMonitor(resumed_opt, weights="compensated", names=resumed)
    resumed_monitor.load_state_dict(saved["stale"])
    for gen in gen_steps[10:]:
        _step(resumed, resumed_opt, torch.Generator().manual_seed(gen.initial_seed()))
    resumed_monitor.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


@pytest.mark.parametrize("weights", ["stochastic", "stochastic+moments"])
def test_trainer_bf16_true_logs_weight_stall_and_writes_weights(weights):
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(torch.float32)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 64)), batch_size=8)
    callback = StaleStateCallback(weights=weights)
    trainer = pl.Trainer(accelerator="cpu", precision="bf16-true", max_steps=8, log_every_n_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback])
    trainer.fit(Tiny(), data)
    metrics = trainer.callback_metrics
    assert 0.0 <= float(metrics["stale/w/frac"]) <= 1.0 and float(metrics["stale/remedy/weights"]) == 4.0
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1e-4  # the real lr outside the step
    assert all(float(s["step"]) == 8.0 for s in trainer.optimizers[0].state.values())


@pytest.mark.parametrize("weights", ["compensated", "stochastic+moments", "auto"])
def test_trainer_resume_with_the_write_back_equals_the_uninterrupted_run(tmp_path, weights):
    """bf16-true with ``weights="compensated"``: the compensation buffers travel in the Trainer checkpoint (the
    optimizer's state), so a run resumed at step 6 ends with the uninterrupted run's weights, bit for bit; with
    ``"stochastic+moments"`` the moments the write-back rounds are the optimizer's own state, and its noise is keyed
    by step; ``remedy="auto"`` takes the weights over with compensated summation (and the moments with stochastic
    rounding) at fit start, and its choices and buffers resume too."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class ByIndex(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(torch.float32)
            gen = torch.Generator().manual_seed(3)
            self.x = torch.randn(12, 16, 64, generator=gen)

        def training_step(self, batch, batch_idx):
            return self.net(self.x[batch_idx].to(self.dtype)).float().pow(2).mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(12)), batch_size=None)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)

    def fit(root, ckpt_path=None, save=False):
        model = ByIndex()
        callbacks = [StaleStateCallback(**({"remedy": "auto"} if weights == "auto" else {"weights": weights}))]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1))
        trainer = pl.Trainer(accelerator="cpu", precision="bf16-true", max_steps=12, log_every_n_steps=4,
                             logger=False, enable_checkpointing=save, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=callbacks, default_root_dir=root)
        trainer.fit(model, ckpt_path=ckpt_path)
        writeback = callbacks[0].monitor._pipelines[0].writeback
        assert writeback.handled == 4 and (writeback.buffer_bytes() > 0) == weights.startswith(("comp", "auto"))
        return model

    full = fit(tmp_path / "full", save=True)
    resumed = fit(tmp_path / "resumed", ckpt_path=tmp_path / "full" / "ckpt" / "epoch=0-step=6.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters()))
