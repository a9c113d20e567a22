"""``remedy="auto"``'s weight decision follows the lr the parameters will train at: at fit start the lr a followed
schedule settles at after its peak (the lowest non-zero one from the peak on; not lr 0 at a warm-up's start), the
measured stall once the lr has stopped rising; its lines agree with what it does and with what it logs
(``stale/remedy/weights`` and ``/stochastic``)."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from lightning_stale import StaleStateMonitor

CHECK = 10  # coverage_steps: the check interval
TAKE_OVER = re.compile(r"remedy: weight write-back with (.+?) from step (\d+) for (\d+) parameter\(s\) whose stored "
                       r"weights stall \(e\.g\. '[^']+': (.+)\)$")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).bfloat16()


def _warmup(steps: int):
    """Linear warm-up from exactly 0 (LambdaLR, as transformers' and LitGPT's schedules), then constant."""
    return lambda step: min(1.0, step / steps)


def _run(caplog, lr: float, schedule, steps: int, follow: bool = True):
    """A plain loop with bf16 weights and torch AdamW under ``remedy="auto"``; returns (the monitor's lines, the
    row logged at the end, the taken-over steps and counts)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = schedule(opt) if schedule is not None else None
    monitor = StaleStateMonitor(opt, remedy="auto", names=model, coverage_steps=CHECK)
    if follow and scheduler is not None:
        monitor.follow_schedule(scheduler, steps)
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO):
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(16, 64, generator=gen).bfloat16()).float().pow(2).mean().backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
    row = monitor.compute()
    monitor.close()
    lines = [line for line in caplog.text.splitlines() if "[lightning_stale]" in line]
    taken = [(int(m.group(2)), int(m.group(3)), m.group(1), m.group(4)) for m in map(TAKE_OVER.search, lines) if m]
    return lines, row, taken


def _agree(lines: list[str], row: dict[str, float], taken: list) -> None:
    """The lines and the logged counts say the same: every parameter said to be taken over is counted, and torch's
    moments are rounded stochastically exactly for those (the write-back computes them)."""
    assert row["stale/remedy/weights"] == sum(n for _, n, _, _ in taken)
    assert all(how == "compensated summation of the weights and stochastic rounding of the moments"
               for _, _, how, _ in taken)
    assert row["stale/remedy/stochastic"] == row["stale/remedy/weights"]
    assert not any("cannot round stochastically" in line for line in lines)  # the write-back can, for its own
    drift = next(line for line in lines if "predicted drift" in line)
    at_start = sum(n for step, n, _, _ in taken if step == 2)
    assert (f"{at_start} of them have stochastic rounding of their moments from the weight write-back" in drift) \
        == (at_start > 0)
    assert ("rounds them stochastically from the step it takes them over" in drift) == (at_start < 4)


def _report(lines: list[str]) -> str:
    return next(line for line in lines if "bf16 weights (4 parameter(s))" in line)


@pytest.mark.parametrize("schedule", ["lambda", "linear"])
def test_a_warm_up_from_zero_is_judged_at_the_lr_it_settles_at_and_measured_once_it_stops_rising(caplog, schedule):
    make = {"lambda": lambda opt: sched.LambdaLR(opt, _warmup(30)),
            "linear": lambda opt: sched.LinearLR(opt, start_factor=1e-8, end_factor=1.0, total_iters=30)}[schedule]
    lines, row, taken = _run(caplog, 1e-3, make, 60)
    report = _report(lines)
    # judged at the lr the warm-up settles at, not at lr 0 (where every element would be "past the threshold")
    assert re.search(r"at lr 0\.001 \(the lr the lr schedule settles at after its peak, from step 3[01]\) \d+% of "
                     r"their", report)
    assert "at lr 0 " not in report and "100%" not in report
    assert any("leaves 4 bf16/fp16 parameter(s) to the optimizer for now" in line for line in lines)
    waited = [line for line in lines if "while the lr is still rising" in line]
    assert len(waited) == 1 and "at step 10" in waited[0]  # said once, at the first check
    # the measured stall decides once the warm-up is over, at the lr it measured at
    assert taken and all(step > 30 for step, _, _, _ in taken), lines
    assert all(why.endswith("at lr 0.001") for _, _, _, why in taken)
    _agree(lines, row, taken)


def test_a_warm_up_to_an_lr_where_the_weights_stall_takes_them_over_at_fit_start(caplog):
    """Weights past the threshold at the lr the schedule settles at stall all run: taken over at once, with that
    lr."""
    lines, row, taken = _run(caplog, 1e-5, lambda opt: sched.LambdaLR(opt, _warmup(20)), 25)
    assert len(taken) == 1 and taken[0][:2] == (2, 4)
    assert re.fullmatch(r"\d+% of its weights are past the threshold at lr 1e-05, the lr the lr schedule settles at "
                        r"after its peak, from step 2[01]", taken[0][3]), taken
    assert int(taken[0][3].split("%")[0]) > 50
    _agree(lines, row, taken)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_a_constant_or_decaying_lr_is_judged_now_and_measured_at_the_first_check(caplog, schedule):
    make = None if schedule == "constant" else (lambda opt: sched.CosineAnnealingLR(opt, T_max=400))
    lines, row, taken = _run(caplog, 1e-3, make, 30)
    basis = (r"0\.001 \(the current lr\)" if schedule == "constant" else
             r"0\.000\d+ \(the lr the lr schedule settles at after its peak, from step \d+\)")
    assert re.search(f"at lr {basis} ", _report(lines)), _report(lines)
    assert not any("still rising" in line for line in lines)
    assert taken and taken[0][0] == CHECK + 1  # from the step after the first check
    for _, _, _, why in taken:
        measured = re.search(r"did not move since the last check, at lr ([0-9.e-]+)$", why)
        assert measured and float(measured.group(1)) == pytest.approx(1e-3, rel=0.01), why
    _agree(lines, row, taken)


def test_without_a_followed_schedule_lr_zero_is_not_judged_and_the_rise_is_waited_out(caplog):
    """Fabric without follow_schedule, a plain loop: no outlook. At lr 0 nothing is judged; the checks wait while the
    lr rose since the previous one."""
    lines, row, taken = _run(caplog, 1e-3, lambda opt: sched.LambdaLR(opt, _warmup(30)), 60, follow=False)
    report = _report(lines)
    assert "the lr is 0 now and no lr schedule is followed: no share past the threshold is judged at lr 0" in report
    waited = [line for line in lines if "while the lr is still rising" in line]
    assert len(waited) == 1
    assert taken and all(step > 30 for step, _, _, _ in taken)  # the first check after the rise ends
    _agree(lines, row, taken)


def test_the_hugging_face_trainer_with_warm_up_from_zero(tmp_path, caplog):
    """transformers' default schedule under ``warmup_steps``: linear from lr 0, then linear decay."""
    transformers = pytest.importorskip("transformers")
    from lightning_stale.hf import add_stale_callback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=64, vocab_size=96,
                                                                 n_positions=16)).to(torch.bfloat16)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (64, 16))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=40, per_device_train_batch_size=8,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                          learning_rate=1e-3, warmup_steps=20, logging_steps=5)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    add_stale_callback(trainer, remedy="auto")
    with caplog.at_level(logging.INFO):
        trainer.train()
    lines = [line for line in caplog.text.splitlines() if "[lightning_stale]" in line]
    report = next(line for line in lines if "bf16 weights" in line)
    # the linear decay to 0 after the warm-up settles at its last non-zero lr: judged there, not at lr 0
    settled = r"at lr ([0-9.e-]+),? \(?the lr the lr schedule settles at after its peak, from step (39|40)\)?"
    found = re.search(settled, report)
    assert found and 0 < float(found.group(1)) < 1e-4, report
    taken = [(int(m.group(2)), int(m.group(3)), m.group(4)) for m in map(TAKE_OVER.search, lines) if m]
    # at fit start the parameters that stall at that lr; nothing during the rest of the warm-up
    start = [(n, why) for step, n, why in taken if step == 2]
    assert start and all(re.fullmatch(r"\d+% of its weights are past the threshold at lr [0-9.e-]+, the lr the lr "
                                      r"schedule settles at after its peak, from step (39|40)", why) for _, why in start)
    assert all(step == 2 or step > 20 for step, _, _ in taken), lines
    rows = [r for r in trainer.state.log_history if "stale/remedy/weights" in r]
    assert rows and rows[-1]["stale/remedy/weights"] == sum(n for _, n, _ in taken)
    assert rows[-1]["stale/remedy/stochastic"] == rows[-1]["stale/remedy/weights"]
    early = [r for r in rows if r["step"] <= 20]
    assert early and all(r["stale/remedy/weights"] == sum(n for n, _ in start) for r in early)
    assert not math.isnan(rows[-1]["stale/frac"])


def test_the_lightning_trainer_with_a_step_warm_up_from_zero(tmp_path, caplog):
    """The Trainer follows its step-interval scheduler: judged at the lr the warm-up settles at, nothing taken over
    while the lr rises, and the logged counts agree with the lines."""
    from helpers import Regression, fit, logged

    from lightning_stale import StaleStateCallback

    class WarmUp(Regression):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched.LambdaLR(opt, _warmup(20)),
                                                       "interval": "step"}}

    with caplog.at_level(logging.INFO):
        trainer = fit(tmp_path, WarmUp("torch_bf16"), StaleStateCallback(remedy="auto"), steps=40,
                      log_every_n_steps=5)
    lines = [r.getMessage() for r in caplog.records if "[lightning_stale]" in r.getMessage()]
    report = next(line for line in lines if "bf16 weights (4 parameter(s))" in line)
    assert re.search(r"at lr 0\.001 \(the lr the lr schedule settles at after its peak, from step 2[01]\)", report), \
        report
    taken = [(int(m.group(2)), int(m.group(3))) for m in map(TAKE_OVER.search, lines) if m]
    assert taken and all(step > 20 for step, _ in taken), lines
    weights, stochastic = logged(trainer, "stale/remedy/weights"), logged(trainer, "stale/remedy/stochastic")
    assert weights[-1] == sum(n for _, n in taken) and stochastic == weights
    assert weights[:3] == [0.0, 0.0, 0.0]  # the rows through step 15: the warm-up
