"""Lightning Fabric loop (LitGPT's shape) with bitsandbytes AdamW8bit: the Fabric callback logs through
``fabric.log_dict``. Without code changes, ``LIGHTNING_STALE=1`` adds the same callback through Fabric's
callbacks-factory entry point (what a LitGPT run would use).

Run: ``python examples/fabric_loop.py`` (CSV logs in ./stale-examples/fabric).
"""

from __future__ import annotations

import bitsandbytes as bnb
import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger
from torch import nn

from lightning_stale.fabric import StaleStateFabricCallback


def main(steps: int = 200, root: str = "stale-examples") -> dict[str, float]:
    callback = StaleStateFabricCallback(log_every_n_steps=50, reset="theory")
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[callback], loggers=CSVLogger(root, name="fabric"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    for _ in range(steps):
        x = torch.randn(32, 64)
        fabric.backward(nn.functional.mse_loss(model(x), x[:, :8]))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(f"{root}/fabric/checkpoint.pt", {"model": model, "optimizer": optimizer, "stale": callback})
    for logger in fabric.loggers:
        logger.finalize("success")
    return callback.compute()


if __name__ == "__main__":
    print(main())
