"""One CPU-DDP training run (2 processes, gloo) with StaleStateCallback; every rank writes what it saw to a JSON file.

Run by ``tests/test_distributed.py`` in a subprocess: ``python tests/ddp_worker.py OUT_DIR RESET STEPS [CKPT]`` with
RESET in {adaptive, theory, auto, weights, weights-auto} (auto: ``remedy="auto"``; weights-auto also checkpoints every
10 steps, and CKPT resumes from one); Lightning's DDP launcher re-runs this script for rank 1. The model has two layers trained in
manual optimization by two optimizers: bitsandbytes AdamW8bit and QuantizedAdamW (fp8, stochastic rounding), so one
launch covers both. Each rank samples its stall measurement with its own seed and, for the adaptive policy, uses its
own staleness tolerance s0, so the ranks' local decisions differ and only the callback's cross-rank reduction keeps
the resets in step (tested: without the reduction rank 1 does not reset when rank 0 does).

Per rank, ``rank<R>.json`` holds: the global steps of every reset with a hash of each optimizer-state tensor right
after it, the same hashes (and parameter hashes) at the end, the reset periods chosen, and the rank's local
(unreduced) stall totals at every log step.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import ResetEvent, StaleStateCallback
from lightning_stale.monitor.metrics import PER_MOMENT
from lightning_stale.vocab import COMPENSATION_KEY, QUANTITIES
from lightning_stale.policies import AdaptiveReset


class TwoOptimizers(L.LightningModule):
    """``first`` (8192 + 256 elements) on bitsandbytes AdamW8bit, ``second`` (1024 + 4) on QuantizedAdamW."""

    def __init__(self, beta2: float = 0.8, by_step: bool = False, spread: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.beta2, self.by_step = beta2, by_step
        self.first = nn.Linear(32, 256)
        self.second = nn.Linear(256, 4)
        # ``spread``: the hidden units' scales span six decades, so the fp8 v of the second layer's weights that read
        # the smallest ones underflows whatever the rounding noise (its per-tensor scale follows the largest)
        self.register_buffer("scales", torch.logspace(-6, 0, 256) if spread else torch.ones(256))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.by_step:  # the data of each step follow the step count, which a resume restores (not the loader's)
            g = torch.Generator().manual_seed(1000 * self.global_rank + self.global_step)
            x, y = torch.randn(8, 32, generator=g).to(x.dtype), torch.randn(8, 4, generator=g).to(y.dtype)
        loss = nn.functional.mse_loss(self.second(torch.relu(self.first(x)) * self.scales), y)
        optimizers = self.optimizers()
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(512, 32, generator=g), torch.randn(512, 4, generator=g))
        return DataLoader(data, batch_size=8, shuffle=False)  # Lightning adds a DistributedSampler: ranks differ

    def configure_optimizers(self):
        import bitsandbytes as bnb

        from lightning_stale.optim import QuantizedAdamW

        betas = (0.9, self.beta2)
        return (
            bnb.optim.AdamW8bit(self.first.parameters(), lr=1e-3, betas=betas),
            QuantizedAdamW(self.second.parameters(), lr=1e-3, betas=betas, state_format="fp8_e4m3",
                           rounding="stochastic", min_quantized_size=256),
        )


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def state_hashes(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """A hash of every tensor in the optimizer state (codes, scales, step counters), keyed by parameter position."""
    out = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for key, value in sorted(optimizer.state[p].items()):
            if isinstance(value, torch.Tensor):
                out[f"{i}.{key}"] = tensor_hash(value)
            else:
                out[f"{i}.{key}"] = repr(value)
    return out


class RecordingCallback(StaleStateCallback):
    """The callback, also remembering this rank's local (unreduced) metric vector at each log step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.local: list[list[float]] = []

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == len(QUANTITIES) * PER_MOMENT:  # the metric vector (the adaptive policy's votes too)
            self.local.append(tensor.tolist())
        return super().reduce_sum(tensor)


def main(out: Path, reset: str, steps: int, resume: str | None = None) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher for rank 1; rank 0 is this process
    if reset == "adaptive":
        # Per-rank staleness tolerance on top of per-rank samples: left alone, rank 1 would hardly ever reset.
        # b2 = 0.8 keeps the EMA's statistical error small, so resets come within a few dozen steps.
        policy = AdaptiveReset(s0=0.02 if rank == 0 else 0.5, min_interval=3)
        callback = RecordingCallback(reset=policy, sample_size=512, seed=rank)
        model = TwoOptimizers(beta2=0.8)
    elif reset == "auto":
        # Per-rank samples see different underflow; only the agreed readings keep the guards (and m) identical.
        callback = RecordingCallback(remedy="auto", sample_size=512, seed=rank)
        model = TwoOptimizers(beta2=0.999, spread=True)
    elif reset in ("weights", "weights-auto"):
        # bf16 weights, per-rank samples: the write-back's stochastic rounding must not depend on the rank, nor the
        # automatic remedy's choices and compensation buffers (rank 0's are the ones a checkpoint keeps).
        chosen = {"weights": "stochastic"} if reset == "weights" else {"remedy": "auto"}
        callback = RecordingCallback(sample_size=512, seed=rank, **chosen)
        model = TwoOptimizers(beta2=0.999, by_step=reset == "weights-auto")
    else:
        # Theory resets need rho-hat >= 1: b2 = 0.995 (at 0.985 the settled 8-bit map has rho-hat
        # 0.66 and never resets); periods come out near 245 (8-bit map) and 145 (fp8) optimizer steps.
        callback = RecordingCallback(reset=reset, sample_size=512, seed=rank)
        model = TwoOptimizers(beta2=0.995)
    resets: list[dict] = []

    def on_reset(event: ResetEvent) -> None:
        index = [id(o) for o in trainer.optimizers].index(id(event.optimizer))
        resets.append({"step": trainer.global_step, "optimizer": index, "state": state_hashes(event.optimizer)})

    callback.add_reset_listener(on_reset)
    saving = reset == "weights-auto"  # Lightning saves rank 0's optimizer state: every rank's, the buffers included
    checkpoint = [ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=10, save_top_k=-1)] if saving else []
    trainer = L.Trainer(
        strategy="ddp", devices=2, accelerator="cpu", max_steps=steps, default_root_dir=out,
        precision="bf16-true" if reset.startswith("weights") else "32-true",
        logger=CSVLogger(out, name="csv", version=1 if resume else 0), log_every_n_steps=1,
        callbacks=[callback, *checkpoint], enable_checkpointing=saving, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path=resume)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "resets": resets,
        "reset_events": callback.reset_events,
        "periods": callback.reset_periods(),
        "final_state": [state_hashes(opt) for opt in trainer.optimizers],
        "final_params": {n: tensor_hash(p) for n, p in model.named_parameters()},
        "local_totals": callback.local,
        "remedies": [[u.remedy for u in callback.monitor.rows(i)] for i in range(len(trainer.optimizers))],
        "underflow": [[u.underflow for u in callback.monitor.rows(i)] for i in range(len(trainer.optimizers))],
        "compensation": [{str(i): tensor_hash(opt.state[p][COMPENSATION_KEY])
                          for i, p in enumerate(q for g in opt.param_groups for q in g["params"])
                          if COMPENSATION_KEY in opt.state[p]} for opt in trainer.optimizers],
    }
    (out / f"{'resumed-' if resume else ''}rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    torch.manual_seed(0)  # same initial weights on both ranks (DDP also broadcasts rank 0's)
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
