"""The monitor's window as a torchmetrics Metric: in a LightningModule's MetricCollection, logged with ``log_dict``,
and in a plain loop, computed, synced and reset by hand.

``monitor.metric`` (and ``StaleStateCallback(...).metric`` once the fit starts) is a ``torchmetrics.Metric``: the
optimizer's step hooks feed it, ``compute()`` gives the row the callback would log (summed across processes in one
all-reduce), ``reset()`` starts the next window.

Run: ``python examples/torchmetrics_window.py`` (CSV logs in ./stale-examples/torchmetrics).
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanSquaredError, MetricCollection

from lightning_stale import StaleStateMonitor
from lightning_stale.optim import QuantizedAdamW

LOG_EVERY = 20


class Regression(L.LightningModule):
    """Logs its own metric and the stale-state window side by side, from one MetricCollection."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
        self.mse = MeanSquaredError()
        self.monitor: StaleStateMonitor | None = None
        self.metrics: MetricCollection | None = None

    def on_train_start(self) -> None:
        # A monitor on the Trainer's optimizer (sums across ranks with torch.distributed under DDP); its window joins
        # the module's own metrics.
        self.monitor = StaleStateMonitor(self.trainer.optimizers[0], names=self, coverage_steps=LOG_EVERY)
        self.metrics = MetricCollection({"mse": self.mse, "stale": self.monitor.metric}, compute_groups=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.net(x)
        self.metrics.update(prediction, y)  # the stale-state metric takes nothing here: the optimizer feeds it
        return nn.functional.mse_loss(prediction, y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % LOG_EVERY == 0:
            self.log_dict(self.metrics.compute())  # {"mse": ..., "stale/v/frac": ..., ...}: every rank at once
            self.metrics.reset()  # both windows start again

    def on_train_end(self) -> None:
        self.monitor.close()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(4096, 64, generator=g), torch.randn(4096, 8, generator=g)),
                          batch_size=32, shuffle=True)

    def configure_optimizers(self):
        return QuantizedAdamW(self.parameters(), lr=1e-3, state_format="bf16")


def plain_loop(steps: int = 60) -> dict[str, float]:
    """The same metric in a loop of your own: compute and reset it every 20 steps; ``sync_context`` shows the summed
    state it computes from (the window's per-moment sums; on one process, this process's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    optimizer = QuantizedAdamW(model.parameters(), lr=1e-3, state_format="bf16")
    monitor = StaleStateMonitor(optimizer, names=model, coverage_steps=20)
    metric, row = monitor.metric, {}
    for step in range(1, steps + 1):
        x = torch.randn(32, 64)
        nn.functional.mse_loss(model(x), x[:, :8]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0:
            with metric.sync_context():  # summed across processes inside, this process's own again after
                print(step, "window sums:", metric.window.tolist()[:4], "...")
            row = metric.compute()
            metric.reset()
    monitor.close()
    return row


def main(steps: int = 200, root: str = "stale-examples") -> dict[str, float]:
    trainer = L.Trainer(max_steps=steps, logger=CSVLogger(root, name="torchmetrics"), log_every_n_steps=LOG_EVERY,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression())
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


if __name__ == "__main__":
    print(main())
    print(plain_loop())
