"""The lr outlook: a scheduler run ahead gives the lrs a twin scheduler really sets, and is left as found; the weights'
fit-start report says from which step the schedule keeps the lr below where the median bf16 weight stops moving."""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as sched

from lightning_stale import StaleStateMonitor
from lightning_stale.decide.lr_outlook import below_from, lr_path


def _warmup_cosine(total: int):
    return lambda step: min(1.0, (step + 1) / 10) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))


SCHEDULES = {
    "lambda": lambda opt: sched.LambdaLR(opt, _warmup_cosine(60)),
    "onecycle": lambda opt: sched.OneCycleLR(opt, max_lr=1e-3, total_steps=80),  # sets beta1 too
    "cosine": lambda opt: sched.CosineAnnealingLR(opt, T_max=50),  # chainable: reads the groups' lr
    "sequential": lambda opt: sched.SequentialLR(opt, [sched.LinearLR(opt, 0.1, total_iters=5),
                                                       sched.CosineAnnealingLR(opt, T_max=40)], milestones=[5]),
}


def _opt(tensor_lr: bool = False) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    lr = torch.tensor(1e-3) if tensor_lr else 1e-3
    return torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": lr / 2}], lr=lr)


def _hyper(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            for g in opt.param_groups]


def _real_steps(opt: torch.optim.Optimizer, scheduler, steps: int) -> list[list[float]]:
    rows = [[float(g["lr"]) for g in opt.param_groups]]
    for _ in range(steps):
        opt.step()
        scheduler.step()
        rows.append([float(g["lr"]) for g in opt.param_groups])
    return rows


@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_the_path_is_what_the_scheduler_sets_and_it_is_left_as_found(kind, tensor_lr):
    opt, twin = _opt(tensor_lr), _opt(tensor_lr)
    scheduler, reference = SCHEDULES[kind](opt), SCHEDULES[kind](twin)
    _real_steps(opt, scheduler, 3)
    expected = _real_steps(twin, reference, 3)[3:] + _real_steps(twin, reference, 30)[1:]
    lr_tensors = [g["lr"] for g in opt.param_groups]
    hyper, state = _hyper(opt), scheduler.state_dict()

    path = lr_path(scheduler, 30)

    assert path.shape == (31, 2) and path == pytest.approx(np.array(expected), rel=1e-6)
    assert _hyper(opt) == hyper and scheduler.state_dict().keys() == state.keys()
    assert all(a is b for a, b in zip(lr_tensors, (g["lr"] for g in opt.param_groups)))  # the same objects
    # stepping on after the look-ahead sets what it foresaw
    assert np.array(_real_steps(opt, scheduler, 5)) == pytest.approx(path[:6], rel=1e-6)


def _shared_lr_tensors(opt: torch.optim.Optimizer, scheduler) -> None:
    """What torch <= 2.8 builds for a tensor lr: the group's ``lr``, its ``initial_lr`` and every scheduler's base lr
    are one tensor, so each step's in-place lr write moves the base lrs too (later versions clone them)."""
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]
    for each in [scheduler, *getattr(scheduler, "_schedulers", [])]:
        if hasattr(each, "base_lrs"):
            each.base_lrs = [group["lr"] for group in opt.param_groups]


@pytest.mark.parametrize("lrs", [False, True])
def test_a_look_ahead_keeps_the_tensors_a_schedule_shares(lrs):
    """On torch <= 2.8 the groups and SequentialLR's schedulers share each tensor lr: after the look-ahead they still
    do (values written back into the same tensors, never replaced), so the schedule goes on exactly as without it."""
    def run(look: bool) -> list[list[float]]:
        opt = _opt(tensor_lr=True)
        scheduler = SCHEDULES["sequential"](opt)
        _shared_lr_tensors(opt, scheduler)
        rows = _real_steps(opt, scheduler, 3)
        if look:
            held = [float(g["lr"]) for g in opt.param_groups]
            if lrs:  # a step in progress holds another lr in the groups
                for group in opt.param_groups:
                    group["lr"].fill_(0.0)
            assert lr_path(scheduler, 30, lrs=[torch.tensor(v) for v in held] if lrs else None) is not None
            if lrs:
                assert [float(g["lr"]) for g in opt.param_groups] == [0.0, 0.0]
                for group, value in zip(opt.param_groups, held):
                    group["lr"].fill_(value)
            shared = [g["lr"] for g in opt.param_groups]
            assert all(g["initial_lr"] is lr for g, lr in zip(opt.param_groups, shared))
            assert all(base is lr for s in scheduler._schedulers for base, lr in zip(s.base_lrs, shared))
        return rows + _real_steps(opt, scheduler, 20)

    assert run(look=True) == run(look=False)  # exactly: every lr of the run, bit for bit


def test_a_path_from_other_current_lrs_puts_the_groups_back():
    """A step in progress may hold other values in the groups (the weight write-back zeroes the lr): the path starts
    from the real ones given, and the groups get their held values back."""
    opt = _opt()
    scheduler = sched.CosineAnnealingLR(opt, T_max=20)
    for group in opt.param_groups:
        group["lr"] = 0.0
    path = lr_path(scheduler, 4, lrs=[1e-3, 5e-4])
    assert path[0].tolist() == [1e-3, 5e-4] and path[1, 0] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 20)))
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]


def test_a_scheduler_that_needs_a_metric_or_fails_is_not_followed():
    opt = _opt()
    assert lr_path(sched.ReduceLROnPlateau(opt), 10) is None

    class Broken(sched.LambdaLR):
        def get_lr(self):
            if self.last_epoch > 2:
                raise RuntimeError("cannot look ahead")
            return super().get_lr()

    broken = Broken(opt, lambda step: 1.0)
    assert lr_path(broken, 10) is None
    assert broken.last_epoch == 0 and [g["lr"] for g in opt.param_groups] == [1e-3, 5e-4]


def test_below_from_is_the_decay_crossing_after_a_warm_up():
    path = np.array([1.0, 3.0, 5.0, 4.0, 2.0, 1.0, 0.5])
    assert below_from(path, 2.5) == 4  # below at the start too, but the warm-up climbs back over it
    assert below_from(path, 10.0) == 0 and below_from(path, 0.1) is None


def _bf16_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)).bfloat16()


def test_the_weight_report_says_from_which_step_the_schedule_keeps_lr_below_the_stop(caplog):
    model, twin = _bf16_model(), torch.optim.AdamW(torch.nn.Linear(1, 1).parameters(), lr=2e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = sched.LambdaLR(opt, _warmup_cosine(3000))
    reference = sched.LambdaLR(twin, _warmup_cosine(3000))
    monitor = StaleStateMonitor(opt, names=model)
    monitor.follow_schedule(scheduler, 3000)
    with caplog.at_level(logging.INFO):
        model(torch.randn(8, 64).bfloat16()).float().pow(2).mean().backward()
        opt.step()
    monitor.close()
    found = re.search(r"stops moving below lr ([0-9.e+-]+) .*the lr schedule stays below it from step (\d+)",
                      caplog.text)
    assert found, caplog.text
    stop, step = float(found.group(1)), int(found.group(2))
    lrs = [row[0] for row in _real_steps(twin, reference, 3000)]  # lrs[k]: the lr of optimizer step k + 1
    assert lrs[step - 1] < stop * 1.001 and lrs[step - 2] >= stop * 0.999  # step `step` is the first one below
    assert scheduler.last_epoch == 0 and opt.param_groups[0]["lr"] == pytest.approx(2e-4)


def test_following_a_scheduler_of_another_optimizer_is_a_configuration_error():
    model = _bf16_model()
    monitor = StaleStateMonitor(torch.optim.AdamW(model.parameters(), lr=1e-3))
    other = sched.LambdaLR(_opt(), lambda step: 1.0)
    with pytest.raises(ValueError, match="`scheduler` \\(LambdaLR\\) must step one of the monitor's optimizers"):
        monitor.follow_schedule(other, 100)
    with pytest.raises(ValueError, match="`last_step`"):
        monitor.follow_schedule(other, -1)
    monitor.close()


def test_the_trainer_follows_its_step_scheduler(caplog):
    import lightning.pytorch as pl

    from lightning_stale import StaleStateCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _bf16_model().float()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=2e-3)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched.LambdaLR(opt, _warmup_cosine(400)),
                                                       "interval": "step"}}

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 64)), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", precision="bf16-true", max_steps=400, limit_train_batches=4,
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[StaleStateCallback()])
    with caplog.at_level(logging.INFO):
        trainer.fit(Tiny(), data)
    report = next(line for line in caplog.text.splitlines() if "weights (4 parameter(s))" in line)
    assert re.search(r"the lr schedule stays below it from step \d+", report), report
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 4  # stepped by the Trainer only


def test_the_hugging_face_trainer_follows_its_scheduler(tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    from lightning_stale.hf import add_stale_callback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=64, vocab_size=96,
                                                                 n_positions=16)).to(torch.bfloat16)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (32, 16))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=200, per_device_train_batch_size=8,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                          learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    add_stale_callback(trainer)

    class StopAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 3

    trainer.add_callback(StopAt())
    with caplog.at_level(logging.INFO):
        trainer.train()
    report = next(line for line in caplog.text.splitlines() if "bf16 weights" in line)
    found = re.search(r"stops moving below lr ([0-9.e+-]+) .*stays below it from step (\d+)", report)
    assert found, report
    stop, step = float(found.group(1)), int(found.group(2))
    def lr(k: int) -> float:  # transformers' linear decay to 0: the lr of optimizer step k
        return 1e-3 * (201 - k) / 200

    assert lr(step) < stop * 1.001 and lr(step - 1) >= stop * 0.999
    assert trainer.lr_scheduler.last_epoch == 3


def test_fabric_follows_a_scheduler_given_before_the_first_step(caplog):
    import lightning as L

    from lightning_stale.fabric import StaleStateFabricCallback

    callback = StaleStateFabricCallback(log_every_n_steps=0)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true", callbacks=[callback])
    model = _bf16_model()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, opt = fabric.setup(model, opt)
    scheduler = sched.LambdaLR(opt, _warmup_cosine(3000))  # built on Fabric's wrapper, as LitGPT-style loops do
    callback.follow_schedule(scheduler, 3000)
    with pytest.raises(ValueError, match="`every`"):
        callback.follow_schedule(scheduler, 3000, every=0)
    with caplog.at_level(logging.INFO):
        fabric.backward(model(torch.randn(8, 64)).float().pow(2).mean())
        opt.step()
        scheduler.step()
    report = next(line for line in caplog.text.splitlines() if "bf16 weights" in line)
    assert re.search(r"the lr schedule stays below it from step \d+", report), report
    assert scheduler.last_epoch == 1


def test_following_a_schedule_leaves_training_bit_identical():
    """The look-ahead runs the user's scheduler (OneCycleLR also sets beta1) and puts it back: the same run with and
    without it ends with the same weights, optimizer state and scheduler state."""
    def run(follow: bool) -> tuple[list[torch.Tensor], dict, dict]:
        model = _bf16_model()
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        scheduler = sched.OneCycleLR(opt, max_lr=2e-3, total_steps=100)
        # the write-back on every parameter reads the betas OneCycleLR sets (remedy="auto" would decide differently
        # with the schedule's peak ahead than with its first lr)
        monitor = StaleStateMonitor(opt, weights="compensated", names=model)
        if follow:
            monitor.follow_schedule(scheduler, 100)
        gen = torch.Generator().manual_seed(0)
        for _ in range(20):
            opt.zero_grad()
            model(torch.randn(8, 64, generator=gen).bfloat16()).float().pow(2).mean().backward()
            opt.step()
            scheduler.step()
        monitor.close()
        return [p.detach().clone() for p in model.parameters()], opt.state_dict(), scheduler.state_dict()

    (weights, opt_state, sched_state), (followed, opt_followed, sched_followed) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(weights, followed))
    assert opt_state["param_groups"] == opt_followed["param_groups"] and sched_state == sched_followed
    assert all(torch.equal(opt_state["state"][k]["exp_avg_sq"], opt_followed["state"][k]["exp_avg_sq"])
               for k in opt_state["state"])
