"""A 2-process Fabric DDP loop (CPU, gloo) with StaleStateFabricCallback; every rank writes what it saw to JSON.

    python tests/fabric_ddp_worker.py OUT_DIR

Each rank samples with its own seed (so the cross-rank sum has real work to do), records an independent count of
unchanged second-moment codes per optimizer step, the rows its callback computed and the steps of its resets.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import bitsandbytes as bnb
import lightning as L
import torch
from torch import nn

from lightning_stale.fabric import StaleStateFabricCallback

STEPS, EVERY = 14, 4


def main(out: Path) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    callback = StaleStateFabricCallback(log_every_n_steps=0, reset="periodic", every=5, sample_size=256, seed=rank)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", callbacks=[callback])
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 8))
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, betas=(0.9, 0.95), min_8bit_size=256)
    probe: list[tuple[int, int]] = []
    before: dict = {}

    def pre(opt, args, kwargs):
        before.clear()
        before.update({p: s["state2"].clone() for p, s in opt.state.items() if s})

    def post(opt, args, kwargs):
        masks = {p: (p.grad != 0) & torch.isfinite(p.grad) for p in before}
        probe.append((sum(int(((opt.state[p]["state2"] == old) & masks[p]).sum()) for p, old in before.items()),
                      sum(int(m.sum()) for m in masks.values())))

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
    model, optimizer = fabric.setup(model, optimizer)
    rows, resets = [], []
    g = torch.Generator().manual_seed(fabric.global_rank)
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 32, generator=g)
        fabric.backward(nn.functional.mse_loss(model(x), x[:, :8]))
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:  # the callback attaches its monitor at the first optimizer step
            next(iter(callback.monitors.values())).add_reset_listener(lambda event: resets.append(event.step))
        if step % EVERY == 0:
            rows.append(callback.compute())  # a collective: both ranks call it at the same steps
            callback.reset_window()
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(
        {"rank": fabric.global_rank, "rows": rows, "probe": probe, "resets": resets,
         "state": [float(s["state2"].float().sum()) for s in optimizer.optimizer.state.values()]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
