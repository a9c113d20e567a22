"""Try StaleStateCallback where it must refuse, on CPU, and print how it failed (run in a subprocess).

``python tests/sharded_worker.py model_parallel_bnb`` uses Lightning's ModelParallelStrategy (FSDP2 ``fully_shard``)
with bitsandbytes AdamW8bit, which has no DTensor support; ``python tests/sharded_worker.py fsdp`` uses FSDPStrategy
(FSDP1), which Lightning itself refuses on CPU unless a subclass sidesteps its accelerator check (torch's FSDP1 then
needs an accelerator anyway, but the callback's ``setup`` runs first). Prints ``REFUSED <message>`` when the callback
raised MisconfigurationException, ``TRAINED`` when the fit went through.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import StaleStateCallback


class CPUFSDPStrategy(FSDPStrategy):
    """FSDPStrategy under another class name: Lightning's CPU check tests ``type(strategy) is FSDPStrategy``."""


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)),
                          batch_size=8)

    def configure_optimizers(self):
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(self.parameters(), lr=1e-3)


def main(kind: str) -> None:
    if kind == "model_parallel_bnb":
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    else:
        strategy = CPUFSDPStrategy(process_group_backend="gloo")
    trainer = L.Trainer(strategy=strategy, devices=1, accelerator="cpu", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[StaleStateCallback()])
    try:
        trainer.fit(Regression())
    except MisconfigurationException as error:
        print(f"REFUSED {error}", flush=True)
        return
    finally:  # a refused fit leaves its gloo group up; torn down at interpreter exit it can abort the process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    print("TRAINED", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
