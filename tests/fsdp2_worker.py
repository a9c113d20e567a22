"""One FSDP2 training run (Lightning's ModelParallelStrategy, 2 CPU processes, gloo) with StaleStateCallback; every
rank writes what it saw to a JSON file. Run by ``tests/test_fsdp2.py``:

    python tests/fsdp2_worker.py OUT_DIR KIND STEPS [RESUME_CKPT]

KIND is ``torch`` (torch.optim.AdamW on bf16 parameters: DTensor bf16 states), ``torch-wsr``/``torch-wsrm``/
``torch-wkahan`` (the same with ``weights="stochastic"``/``"stochastic+moments"``/``"compensated"``), ``torch-auto``
(the same with ``remedy="auto"`` instead of periodic resets) or ``torchao`` (torchao AdamW8bit: DTensor-wrapped 8-bit
states). Every layer has an even number of rows, so the shards are even (torchao's compiled step
fails on uneven shards with torch 2.13). Each rank records, per optimizer step, an independent count over its own
shards of the second-moment codes left unchanged where the gradient is finite and non-zero, the reset steps, the
periods, and a hash of every optimizer-state shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale.vocab import COMPENSATION_KEY as KEY

from lightning_stale import StaleStateCallback
from lightning_stale._compat import shard_flat_start

BETAS = (0.9, 0.985)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def codes(buf) -> torch.Tensor:
    """The comparable stored codes of one state shard (8-bit codes, or the raw bits of a float tensor)."""
    buf = local(buf)
    if hasattr(buf, "codes"):
        return buf.codes.reshape(-1).clone()
    return buf.reshape(-1).view(torch.int16 if buf.element_size() == 2 else torch.int32).clone()


class Probe:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps: list[tuple[int, int]] = []
        self.before: dict = {}
        optimizer.register_step_pre_hook(self.pre)
        optimizer.register_step_post_hook(self.post)

    def pre(self, opt, args, kwargs):
        self.before = {p: codes(s["exp_avg_sq"]) for p, s in opt.state.items() if s}

    def post(self, opt, args, kwargs):
        if self.before:
            stalled = counted = 0
            for p, old in self.before.items():
                grad = local(p.grad).reshape(-1)
                mask = (grad != 0) & torch.isfinite(grad)
                stalled += int(((codes(opt.state[p]["exp_avg_sq"]) == old) & mask).sum())
                counted += int(mask.sum())
            self.steps.append((stalled, counted))


class Sharded(L.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 8))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.kind.startswith("torch"):
            self.net.bfloat16()
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        # Batch i is chosen by batch_idx (and rank): Lightning resumes mid-epoch at the right batch_idx but restarts a
        # plain DataLoader from its first batch.
        g = torch.Generator().manual_seed(1000 * batch_idx + self.global_rank)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)
        return nn.functional.mse_loss(self.net(x.to(self.net[0].weight.dtype)).float(), y)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(1024)), batch_size=None)

    def configure_optimizers(self):
        if self.kind.startswith("torch"):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3, betas=BETAS)
        else:
            from torchao.optim import AdamW8bit

            opt = AdamW8bit(self.parameters(), lr=1e-3, betas=BETAS)
        self.probe = Probe(opt)
        return opt


def state_hashes(optimizer) -> dict[str, str]:
    out = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for key, value in sorted(optimizer.state[p].items()):
            data = codes(value).view(torch.uint8) if isinstance(value, torch.Tensor) and value.dim() else value
            blob = data.numpy().tobytes() if isinstance(data, torch.Tensor) else repr(float(data)).encode()
            out[f"{i}.{key}"] = hashlib.sha256(blob).hexdigest()[:16]
    return out


def main(out: Path, kind: str, steps: int, resume: str | None) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    weights = {"torch-wsr": "stochastic", "torch-wsrm": "stochastic+moments",
               "torch-wkahan": "compensated"}.get(kind)
    chosen = {"remedy": "auto"} if kind == "torch-auto" else {"reset": "periodic", "every": 6, "weights": weights}
    callback = StaleStateCallback(track="exact", seed=rank, **chosen)
    resets: list[dict] = []
    callback.add_reset_listener(lambda event: resets.append({"step": event.step, "state": state_hashes(event.optimizer)}))
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), devices=2, accelerator="cpu",
        max_steps=steps, default_root_dir=out, logger=CSVLogger(out, name="csv", version=1 if resume else 0),
        log_every_n_steps=3, callbacks=[callback, checkpoint], enable_progress_bar=False, enable_model_summary=False,
    )
    model = Sharded(kind)
    trainer.fit(model, ckpt_path=resume)
    params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
    result = {
        "rank": trainer.global_rank,
        "weights": hashlib.sha256(b"".join(codes(p).numpy().tobytes() for p in params)).hexdigest()[:16],
        "shard_starts": [shard_flat_start(p) for p in params],
        "shard_sizes": [local(p).numel() for p in params],
        "probe": model.probe.steps,
        "resets": resets,
        "periods": callback.reset_periods(),
        "final_state": state_hashes(trainer.optimizers[0]),
        "steps": callback.monitor.steps,
        "writeback": [t.writeback.describe() if t.writeback else None for t in callback.monitor._pipelines],
        "taken_over": [t.writeback.handled if t.writeback else 0 for t in callback.monitor._pipelines],
        # the compensation buffers in this rank's optimizer state: (type, elements of this rank's shard) per parameter
        "buffers": [(type(s[KEY]).__name__, local(s[KEY]).numel())
                    for s in (trainer.optimizers[0].state[p] for p in params) if KEY in s],
    }
    (out / f"{'resumed' if resume else 'full'}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
