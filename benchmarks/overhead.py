"""StaleStateCallback overhead: training-step time and extra memory, with and without the callback.

A ~4.2M-parameter MLP trains in real Lightning Trainers on CPU (random regression, batch 64). Per round, every
configuration (no callback, default sample mode, exact mode, ``track_every=10``, the underflow guard) runs once, in
a rotating order, for each optimizer (after one discarded warm-up run of each); a run's step time is the median over its steps after a warm-up (batch start to batch end, so
the callback's step hooks and its logging, every 10 steps, are inside), as wall time and as process CPU time (less sensitive to other
load on a shared machine). The reported ratios are medians over rounds of (run / no-callback run of the same round).
Because A/B ratios of a few percent drown in the noise of a busy machine, the time spent inside the callback's own hooks
is also measured directly (mean per step, so the logging steps count) and divided by the no-callback median step time
of the same round.

Extra memory counts the callback's own tensors (sample indices, shadow EMAs, and the code snapshot held during a
measured step) against the optimizer's state bytes, for the timed model and for a larger one (memory only). Run:

    .venv/bin/python benchmarks/overhead.py --rounds 5 --steps 30 --threads 2
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import StaleStateCallback
from lightning_stale.optim import QuantizedAdamW

SIZES = [1024, 1024, 1024, 1024, 1024]  # four 1024x1024 layers: 4.2M parameters
LOG_EVERY = 10  # the callback logs every 10 steps (Lightning's default is 50): its logging cost is inside the timing
CONFIGS: dict[str, dict | None] = {
    "no callback": None,
    "default (sample 4096)": {},
    "exact": {"track": "exact"},
    "track_every=10": {"track_every": 10},
    "underflow_guard": {"underflow_guard": True},
}


def optimizers() -> dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]]:
    import bitsandbytes as bnb

    return {
        "bnb AdamW8bit": lambda p: bnb.optim.AdamW8bit(p, lr=1e-3),
        "QuantizedAdamW int8_dynamic": lambda p: QuantizedAdamW(p, lr=1e-3, state_format="int8_dynamic"),
    }


class MLP(L.LightningModule):
    def __init__(self, make_optimizer: Callable, batches: int, sizes: list[int] = SIZES) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sizes = sizes
        layers: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])
        self.make_optimizer = make_optimizer
        self.batches = batches

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64 * self.batches, self.sizes[0], generator=g)
        y = torch.randn(64 * self.batches, self.sizes[-1], generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=64)

    def configure_optimizers(self):
        return self.make_optimizer(list(self.parameters()))


class StepTimer(L.Callback):
    """Wall and CPU time from batch start to batch end (forward, backward, optimizer step, every callback's batch
    end)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._start = (0.0, 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])


class TimedStaleStateCallback(StaleStateCallback):
    """The callback with a stopwatch around its per-step work (step hooks and batch-end logging)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds: list[float] = []  # per batch

    def _timed(self, method, *args):
        start = time.perf_counter()
        method(*args)
        self.seconds[-1] += time.perf_counter() - start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seconds.append(0.0)

    def _before_step(self, *args):
        self._timed(super()._before_step, *args)

    def _after_step(self, *args):
        self._timed(super()._after_step, *args)

    def on_train_batch_end(self, *args):
        self._timed(super().on_train_batch_end, *args)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every distinct tensor in the optimizer state (bitsandbytes' shared maps counted once)."""
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                inner = [getattr(value, n) for n in value.__tensor_flatten__()[0]] if hasattr(
                    value, "__tensor_flatten__") and type(value) is not torch.Tensor else [value]
                for t in inner:
                    seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def callback_bytes(callback: StaleStateCallback) -> tuple[int, int]:
    """(resident bytes kept between steps, bytes of the code snapshot held during a measured step)."""
    kept: dict[int, int] = {}  # by data pointer: the moments of a parameter share their sample index
    snapshot = 0
    for tracked in callback._tracked:
        for record in tracked.tracker.records.values():
            for t in (record.index, record.shadow, record.totals, record.last_step):
                if t is not None:
                    kept[t.data_ptr()] = t.numel() * t.element_size()
            codes = record.slot.codes()
            snapshot += (codes.numel() if record.exact else record.index.numel()) * codes.element_size()
    return sum(kept.values()), snapshot


def run(make_optimizer: Callable, config: dict | None, steps: int, warmup: int, root: str,
        sizes: list[int] = SIZES) -> dict:
    """One fit; medians over the steps after ``warmup`` and the memory counts at the end."""
    timer = StepTimer()
    callback = None if config is None else TimedStaleStateCallback(**config)
    trainer = L.Trainer(max_steps=steps, default_root_dir=root, logger=L.pytorch.loggers.CSVLogger(root),
                        log_every_n_steps=LOG_EVERY,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", callbacks=[c for c in (callback, timer) if c is not None])
    trainer.fit(MLP(make_optimizer, steps, sizes))  # the timer last: it sees the callback's batch end
    return {
        "wall": statistics.median(timer.wall[warmup:]),
        "cpu": statistics.median(timer.cpu[warmup:]),
        "inside": statistics.mean(callback.seconds[warmup:]) if callback else 0.0,  # mean: logging steps count
        "memory": callback_bytes(callback) if callback else (0, 0),
        "state": state_bytes(trainer.optimizers[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-sizes", type=int, nargs="+", default=[4096] * 4,
                        help="layer widths of the larger model measured for memory only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(f"model: MLP {SIZES} ({n_params(SIZES) / 1e6:.2f}M parameters), batch 64, {args.steps} steps per run "
          f"({args.warmup} warm-up), {args.rounds} rounds, {args.threads} threads, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as root:
        for opt_name, make in optimizers().items():
            for config in CONFIGS.values():  # discarded: first-run allocation and library start-up costs
                run(make, config, args.warmup + 2, args.warmup, root)
            results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
            names = list(CONFIGS)
            for r in range(args.rounds):
                for config_name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order each round
                    results[config_name].append(run(make, CONFIGS[config_name], args.steps, args.warmup, root))
            state = results["no callback"][0]["state"]
            print(f"\n{opt_name}: optimizer state {state / 2**20:.2f} MiB")
            print("| configuration | step, wall (ms) | wall ratio | CPU-time ratio | inside the callback (ms/step, % "
                  "of step) | extra memory: resident | + snapshot during a step |")
            print("|---|---|---|---|---|---|---|")
            base = results["no callback"]
            for config_name, runs in results.items():
                wall = statistics.median(r["wall"] / b["wall"] for r, b in zip(runs, base))
                cpu = statistics.median(r["cpu"] / b["cpu"] for r, b in zip(runs, base))
                inside = statistics.median(r["inside"] / b["wall"] for r, b in zip(runs, base))
                resident, snapshot = runs[-1]["memory"]
                print(f"| {config_name} | {1e3 * statistics.median(r['wall'] for r in runs):.1f} | {wall:.3f}x | "
                      f"{cpu:.3f}x | {1e3 * statistics.median(r['inside'] for r in runs):.1f} ({100 * inside:.1f}%) | "
                      f"{100 * resident / state:.2f}% | {100 * (resident + snapshot) / state:.2f}% |")
            big = run(make, {}, 2, 0, root, args.memory_sizes)
            resident, snapshot = big["memory"]
            print(f"memory at {n_params(args.memory_sizes) / 1e6:.1f}M parameters (MLP {args.memory_sizes}), default "
                  f"mode: resident {100 * resident / big['state']:.2f}%, with the step's snapshot "
                  f"{100 * (resident + snapshot) / big['state']:.2f}% of {big['state'] / 2**20:.1f} MiB state")


def n_params(sizes: list[int]) -> int:
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


if __name__ == "__main__":
    main()
