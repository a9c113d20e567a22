"""A Fabric loop with StaleStateFabricCallback that saves with ``fabric.save`` and continues, or loads and continues;
writes its weights, reset steps and logged rows. Run as a fresh process for each part:

    python tests/fabric_resume_worker.py OUT_DIR full [KIND]     # steps 1..TOTAL, saves at SAVE_AT
    python tests/fabric_resume_worker.py OUT_DIR resumed [KIND]  # loads OUT_DIR/ckpt (from `full`), SAVE_AT+1..TOTAL

KIND: ``bnb`` (default; bitsandbytes AdamW8bit, fp32 weights), ``bf16`` (a bf16-true model under torch AdamW with
``weights="compensated"``) or ``bf16auto`` (the same model with ``remedy="auto"``, which takes the weights over with
compensated summation, instead of periodic resets).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import bitsandbytes as bnb
import lightning as L
import torch
from lightning.fabric.loggers import Logger
from torch import nn

from lightning_stale.fabric import StaleStateFabricCallback

SAVE_AT, TOTAL, LOG_EVERY = 30, 45, 5


class Rows(Logger):
    """Keeps what ``fabric.log_dict`` sends."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []

    name = "rows"
    version = 0

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.rows.append({"step": step, **metrics})

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def main(out: Path, part: str, kind: str = "bnb") -> None:
    bf16 = kind.startswith("bf16")
    chosen = {"remedy": "auto"} if kind == "bf16auto" else \
        {"reset": "periodic", "every": 10, "warmup_steps": 3, "weights": "compensated" if bf16 else None}
    callback = StaleStateFabricCallback(log_every_n_steps=LOG_EVERY, **chosen)
    logger = Rows()
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[callback], loggers=logger,
                      precision="bf16-true" if bf16 else "32-true")
    torch.manual_seed(0)
    with fabric.init_module():
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))
    if bf16:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=256)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "stale": callback}
    start = 0
    if part == "resumed":
        fabric.load(out / "ckpt", state)
        start = SAVE_AT
    resets: list[int] = []
    for step in range(start + 1, TOTAL + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 32, generator=g).to(next(model.parameters()).dtype)
        prediction = model(x)  # fp32: Fabric's bf16-true returns outputs in the default dtype
        # The target in the output's dtype (what promotion gives anyway): torch 2.6's mse_loss backward fails on an
        # fp32 input with a bf16 target ("Found dtype BFloat16 but expected Float").
        fabric.backward(nn.functional.mse_loss(prediction, x[:, :8].to(prediction.dtype)))
        optimizer.step()
        optimizer.zero_grad()
        if len(callback.monitors) == 1 and not resets and not hasattr(main, "listening"):
            next(iter(callback.monitors.values())).add_reset_listener(lambda event: resets.append(event.step))
            main.listening = True
        if part == "full" and step == SAVE_AT:
            fabric.save(out / "ckpt", state)
    torch.save([p.detach().clone() for p in model.parameters()], out / f"{part}_weights.pt")
    monitor = next(iter(callback.monitors.values()))
    (out / f"{part}.json").write_text(json.dumps({"resets": resets, "rows": logger.rows,
                                                  "compensation_bytes": monitor.weight_buffer_bytes()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], *sys.argv[3:4])
