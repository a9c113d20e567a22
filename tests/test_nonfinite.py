"""A run that goes non-finite: said once (the steps, the parameters whose weights and states went NaN/Inf, that the
stall metrics stop meaning anything), and every row from there on logs NaN for the stall metrics instead of
"healthy" values computed from NaN."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers import Regression, fit, logged, read_metrics
from torch import nn

from lightning_stale import StaleStateCallback, StaleStateMonitor

NAN_AT = 12  # the optimizer step whose batch holds a NaN
EVERY = 5  # logging interval


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]


@pytest.mark.parametrize(("dtype", "track"), [(torch.float32, "sample"), (torch.bfloat16, "exact")])
def test_a_nan_batch_in_a_plain_loop_is_said_once_and_nans_the_rows(caplog, dtype, track):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = StaleStateMonitor(opt, names=model, coverage_steps=EVERY, track=track)
    gen = torch.Generator().manual_seed(0)
    rows = {}
    with caplog.at_level(logging.INFO):
        for step in range(1, 31):
            opt.zero_grad()
            x = torch.randn(16, 64, generator=gen).to(dtype)
            if step == NAN_AT:
                x[0, 0] = math.nan
            model(x).float().pow(2).mean().backward()
            opt.step()
            if step % EVERY == 0:
                rows[step] = monitor.compute()
                monitor.reset_window()
    monitor.close()
    lines = _lines(caplog)
    assert len(lines) == 1, lines
    line = lines[0]
    assert "between optimizer steps 11 and 15" in line
    assert all(f"'{name}' (and its exp_avg, exp_avg_sq)" in line for name in ("0.weight", "0.bias", "2.weight"))
    assert "4 parameter(s)" in line and "the stall metrics mean nothing" in line and "logged as NaN" in line
    for step, row in rows.items():
        stall = {k: v for k, v in row.items() if not k.endswith(("/resets", "/since_reset"))}
        if step < NAN_AT:
            assert stall and all(math.isfinite(v) for v in stall.values()), (step, row)
        else:  # the keys a healthy row has, each NaN: no 0% stale or drift 1.0 from NaN states
            assert set(stall) >= {"stale/frac", "stale/v/frac", "stale/v/drift", "stale/m/frac"}, (step, row)
            assert all(math.isnan(v) for v in stall.values()), (step, row)
            assert row["stale/resets"] == 0.0
    if dtype == torch.bfloat16:
        assert math.isnan(rows[15]["stale/w/frac"])


def test_finite_runs_say_nothing_and_keep_their_rows(caplog):
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = StaleStateMonitor(opt, coverage_steps=EVERY)
    with caplog.at_level(logging.INFO):
        for _ in range(10):
            model(torch.randn(4, 32)).pow(2).mean().backward()
            opt.step()
    row = monitor.compute()
    assert not _lines(caplog) and all(math.isfinite(v) for v in row.values())
    assert int(monitor._pipelines[0].engine.nonfinite().sum()) == 0


class Diverging(Regression):
    """The regression with a NaN in the inputs of one training batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step + 1 == NAN_AT:
            x = x.clone()
            x[0, 0] = math.nan
        return nn.functional.mse_loss(self(x), y)


def test_the_trainer_says_it_once_and_logs_nan(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        trainer = fit(tmp_path, Diverging("torch_bf16"), StaleStateCallback(), steps=25, log_every_n_steps=EVERY)
    lines = _lines(caplog)
    assert len(lines) == 1 and "between optimizer steps 11 and 15" in lines[0], lines
    assert "'net.0.weight' (and its exp_avg, exp_avg_sq)" in lines[0]
    steps = [int(r["step"]) for r in read_metrics(trainer) if r.get("stale/frac")]
    fracs = logged(trainer, "stale/frac")
    assert len(steps) == len(fracs) == 5
    for step, frac, w in zip(steps, fracs, logged(trainer, "stale/w/frac")):
        assert math.isnan(frac) == math.isnan(w) == (step + 1 >= 15), (step, frac, w)  # rows at steps 5..25
