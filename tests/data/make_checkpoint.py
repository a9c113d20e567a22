"""Writes ``monitor_v<N>.pt``: a plain-loop run's model, two optimizers and monitor state (state version N) after 12
steps, and what that version logged and trained in the 12 steps after it. Run once with the lightning_stale that wrote
version N: ``PYTHONPATH=<that checkout> python tests/data/make_checkpoint.py tests/data/monitor_v<N>.pt``, version 2
at commit 7cc68ad (lightning_stale 0.1), version 3 at commit bf0fa30; tests/test_state.py loads each file with the
current version and checks that it continues the same way."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import nn

from lightning_stale import StaleStateMonitor
from lightning_stale.optim import QuantizedAdamW

OPTIONS = dict(reset="periodic", every=5, warmup_steps=2, coverage_steps=4)


def setup():
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 8))
    first = QuantizedAdamW(model[0].parameters(), lr=3e-3, state_format="fp8_e4m3", min_quantized_size=256,
                           compile=False)
    second = bnb.optim.AdamW8bit(model[2].parameters(), lr=3e-3, min_8bit_size=256)
    return model, [first, second]


def train(model, opt, monitor, steps: int, start: int) -> list[dict[str, float]]:
    g = torch.Generator().manual_seed(start)
    rows = []
    for step in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        for o in opt:
            o.step()
            o.zero_grad()
        if (step + 1) % 4 == 0:
            rows.append(monitor.compute())
            getattr(monitor, "reset_window", lambda: None)()  # at 7cc68ad compute() started the next window itself
    return rows


if __name__ == "__main__":
    model, opt = setup()
    monitor = StaleStateMonitor(opt, names=model, **OPTIONS)
    train(model, opt, monitor, 12, start=0)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizers": [o.state_dict() for o in opt],
                           "stale": monitor.state_dict()})  # state_dicts hold the live tensors: keep step 12's
    rows = train(model, opt, monitor, 12, start=12)
    saved["expected"] = {"rows": rows, "weights": [p.detach().clone() for p in model.parameters()],
                         "reset_events": monitor.reset_events, "remedy_resets": monitor.remedy_resets}
    torch.save(saved, Path(sys.argv[1]))
