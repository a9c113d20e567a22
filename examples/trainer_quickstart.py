"""Lightning Trainer + bitsandbytes AdamW8bit + StaleStateCallback: the one-line adoption.

Run: ``python examples/trainer_quickstart.py`` (CSV logs in ./stale-examples/trainer).
"""

from __future__ import annotations

import bitsandbytes as bnb
import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import StaleStateCallback


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(4096, 64, generator=g), torch.randn(4096, 8, generator=g)),
                          batch_size=32, shuffle=True)

    def configure_optimizers(self):
        return bnb.optim.AdamW8bit(self.parameters(), lr=1e-3)


def main(steps: int = 200, root: str = "stale-examples") -> dict[str, float]:
    trainer = L.Trainer(max_steps=steps, log_every_n_steps=20, logger=CSVLogger(root, name="trainer"),
                        callbacks=[StaleStateCallback(remedy="auto")],  # the only line this example adds
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Regression())
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("stale/")}


if __name__ == "__main__":
    print(main())
