"""StaleStateCallback overhead at realistic tensor counts: step time and resident memory, side by side in one run.

Models are residual stacks of ``LayerNorm -> Linear`` blocks (4 parameter tensors per block) sized to about the same
total (~3M parameters) at 16, 128, 512 and 1024 tensors. Each configuration trains in a real Lightning Trainer
(``log_every_n_steps=50``, the default, so the logging step is inside the timing) with bitsandbytes AdamW8bit, torch
AdamW and ``QuantizedAdamW(int8_dynamic)``, with no callback, the default callback, ``track="exact"`` and
``reset="theory"``. Runs alternate within each round (the order rotates), a run's step time is the lower quartile of
its step times after a warm-up (batch start to batch end: forward, backward, optimizer step with the callback's hooks,
logging), and a ratio is the median over rounds of (run / no-callback run of the same round). Because A/B ratios of a
few percent drown in the noise of a shared CPU, the time spent inside the callback (its step hooks and its
batch-end logging, mean per step so the logging step counts) is also measured directly, as a share of the
no-callback step time of the same round: that is the number the 3% target is checked against.

The opt-in ``guard`` mode (``underflow_guard=True``) adds ``QuantizedAdamW`` with fp8 (one scale per tensor) and bf16
states to the optimizers and a second table: the guard's own time (around each guard pass) against the optimizer's
update (from ``on_before_optimizer_step``, after the backward pass, to the monitor's post-step hook), median per step,
in the same runs. At 160 tensors the model has 40 weights of 274 x 274 = 75,076 elements (the guard's in-place size
is 65,536).

The opt-in ``weights`` modes (with ``--precision bf16-true``) take the weight write over (``weights="stochastic"``,
``"compensated"``, ``"stochastic+moments"`` and ``"compensated+moments"``: torch.optim only); the opt-in ``auto`` mode
is ``remedy="auto"``, whose write-back takes over the parameters whose weights stall. The write-back's own step hooks
and its step of the parameters it takes over (inside the closure) are timed too (their mean per step as a share of
the no-callback step: the direct cost), beside its A/B cost: the step ratio of the weights mode less the default
mode's (which includes what the write-back saves: the optimizer's own update of the parameters it takes over).
``--model demo`` trains the demo decoder of the long plan instead (dim 64, hidden 176, 17 tensors, 133k parameters;
batch 16 x 64 bytes).

Memory: the engine's resident bytes (device tensors kept between steps, plus host arrays) against the optimizer's
state bytes, for the timed models and for ~12M-parameter models (memory only; residual models). Run:

    .venv/bin/python benchmarks/overhead.py --rounds 2 --steps 60 --threads 1
    .venv/bin/python benchmarks/overhead.py --rounds 2 --steps 60 --threads 1 \\
        --tensors 128 160 512 1024 --modes default guard
    .venv/bin/python benchmarks/overhead.py --precision bf16-true --optimizers "torch AdamW" --modes default weights
    .venv/bin/python benchmarks/overhead.py --precision bf16-true --optimizers "torch AdamW" "bnb AdamW8bit" \
        --model demo --modes default weights weights-moments
    .venv/bin/python benchmarks/overhead.py --paired --rounds 7 --steps 50 --threads 1

``--paired``: monitor + guard on a 4 x 1024x1024 MLP with bitsandbytes AdamW8bit and torch AdamW (fp32
states), each against the same model unmonitored, trained side by side in one process with their steps interleaved,
so that load from other processes falls on both; a run's ratio is total step time monitored / unmonitored (the
logging steps included), the table gives the median over runs and the time inside the monitor (``--cpu-time``: the
thread's CPU time).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.act.guard import GuardPlan
from lightning_stale.act.writeback import WeightWriteBack
from lightning_stale.demo.model import Decoder, DecoderConfig
from lightning_stale.monitor.pipeline import OptimizerPipeline
from lightning_stale.optim import QuantizedAdamW

TENSOR_COUNTS = (16, 128, 512, 1024)
TOTAL_PARAMS = 3_000_000
MODES: dict[str, dict | None] = {
    "no callback": None,
    "default": {},
    "exact": {"track": "exact"},
    "theory": {"reset": "theory"},
    "guard": {"underflow_guard": True},  # opt-in: not in the default sweep (--modes default guard)
    # opt-in, with --precision bf16-true: the weight write-back (its own step hooks count in the step time)
    "weights": {"weights": "stochastic"},
    "weights-compensated": {"weights": "compensated"},
    "weights-moments": {"weights": "stochastic+moments"},  # torch.optim only
    "weights-compensated-moments": {"weights": "compensated+moments"},  # torch.optim only
    "auto": {"remedy": "auto"},  # on bf16 weights: the write-back it attaches, over the parameters it takes over
}
TORCH_ONLY = ("weights-moments", "weights-compensated-moments")
BATCH = 32
clock = time.perf_counter  # --cpu-time: time.thread_time
DEMO = DecoderConfig(dim=64, hidden=176)  # the long plan's decoder
DEMO_BATCH = 16
MLP_LOG_EVERY = 50  # --paired: compute() every this many steps (Lightning's default log_every_n_steps)


def optimizers(device: str) -> dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]]:
    import bitsandbytes as bnb

    return {
        "bnb AdamW8bit": lambda p: bnb.optim.AdamW8bit(p, lr=1e-3),
        "torch AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
        "QuantizedAdamW int8": lambda p: QuantizedAdamW(p, lr=1e-3, state_format="int8_dynamic"),
        "QuantizedAdamW fp8": lambda p: QuantizedAdamW(p, lr=1e-3, state_format="fp8_e4m3"),
        "QuantizedAdamW bf16": lambda p: QuantizedAdamW(p, lr=1e-3, state_format="bf16"),
    }


GUARD_ONLY = ("QuantizedAdamW fp8", "QuantizedAdamW bf16")  # in the default choice only with the guard mode


def writes_weights(mode: str) -> bool:
    """Whether a mode attaches the weight write-back (on bf16 weights)."""
    return bool((MODES[mode] or {}).get("weights")) or (MODES[mode] or {}).get("remedy") == "auto"


def applies(optimizer: str, mode: str) -> bool:
    """Whether a mode runs on an optimizer (the write-back computes torch.optim's moments only)."""
    return mode not in TORCH_ONLY or optimizer.startswith("torch")


class Residual(L.LightningModule):
    """``tensors / 4`` blocks ``x + Linear(LayerNorm(x))`` of width chosen so the model holds ~``total`` parameters."""

    def __init__(self, tensors: int, make_optimizer: Callable, batches: int, total: int = TOTAL_PARAMS) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = tensors // 4
        self.width = max(8, round(math.sqrt(total / blocks)))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(self.width), nn.Linear(self.width, self.width)) for _ in range(blocks))
        self.make_optimizer = make_optimizer
        self.batches = batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH * self.batches, self.width, generator=g)
        return DataLoader(TensorDataset(x, torch.randn(x.shape, generator=g)), batch_size=BATCH)

    def configure_optimizers(self):
        return self.make_optimizer(list(self.parameters()))


class DemoDecoder(L.LightningModule):
    """The demo decoder of the long plan on random byte sequences (``batches`` batches of 16 x 64 bytes)."""

    def __init__(self, make_optimizer: Callable, batches: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Decoder(DEMO)
        self.make_optimizer = make_optimizer
        self.batches = batches

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, DEMO.vocab_size, (DEMO_BATCH * self.batches, DEMO.context + 1), generator=g)
        return DataLoader(TensorDataset(tokens), batch_size=DEMO_BATCH)

    def configure_optimizers(self):
        return self.make_optimizer(list(self.parameters()))


class TimedCallback(StaleStateCallback):
    """The callback with a stopwatch around its per-step work (the monitor's step hooks and the batch-end logging),
    around each guard pass, around the weight write-back's step hooks, and around the optimizer's own update
    (``on_before_optimizer_step`` runs after the backward pass, inside the optimizer's step; the monitor's post-step
    hook right after the update)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds: list[float] = []  # per batch
        self.guard: list[float] = []  # per batch
        self.update: list[float] = []  # per batch
        self.writeback: list[float] = []  # per batch
        self._update_start = 0.0
        self._guard_run = GuardPlan.run
        self._writeback_hooks = WeightWriteBack._pre_hook, WeightWriteBack._post_hook, WeightWriteBack._write

    def _timed(self, function, *args):
        start = clock()
        out = function(*args)
        self.seconds[-1] += clock() - start
        return out

    def _timed_writeback(self, function, *args):
        start = clock()
        out = function(*args)
        self.writeback[-1] += clock() - start
        return out

    def on_train_start(self, trainer, pl_module):
        # the write-back registers its hooks when the monitor attaches, next; its step runs between them, right
        # after the closure
        pre, post, ahead = self._writeback_hooks
        WeightWriteBack._pre_hook = lambda wb, *args: self._timed_writeback(pre, wb, *args)
        WeightWriteBack._post_hook = lambda wb, *args: self._timed_writeback(post, wb, *args)
        WeightWriteBack._write = lambda wb: self._timed_writeback(ahead, wb)
        super().on_train_start(trainer, pl_module)
        before, after = OptimizerPipeline.before_step, OptimizerPipeline.after_step

        def timed_after(pipeline):
            self.update[-1] += clock() - self._update_start
            return self._timed(after, pipeline)

        def timed_guard(plan, *args, **kwargs):
            start = clock()
            out = self._guard_run(plan, *args, **kwargs)
            self.guard[-1] += clock() - start
            return out

        # the monitor's step hooks are its pipelines' before_step and after_step: timed for this run
        OptimizerPipeline.before_step = lambda pipeline: self._timed(before, pipeline)
        OptimizerPipeline.after_step = timed_after
        GuardPlan.run = timed_guard
        self._hooks = before, after

    def on_train_end(self, trainer, pl_module):
        GuardPlan.run = self._guard_run
        WeightWriteBack._pre_hook, WeightWriteBack._post_hook, WeightWriteBack._write = self._writeback_hooks
        OptimizerPipeline.before_step, OptimizerPipeline.after_step = self._hooks
        super().on_train_end(trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._update_start = clock()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seconds.append(0.0)
        self.guard.append(0.0)
        self.update.append(0.0)
        self.writeback.append(0.0)

    def on_train_batch_end(self, *args):
        self._timed(super().on_train_batch_end, *args)


class StepTimer(L.Callback):
    """Wall time from batch start to batch end (forward, backward, optimizer step, every callback's batch end)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.wall.append(clock() - self._start)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every distinct tensor in the optimizer state (bitsandbytes' shared maps counted once)."""
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                inner = ([getattr(value, n) for n in value.__tensor_flatten__()[0]]
                         if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor else [value])
                for t in inner:
                    seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def lower_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4)[0]


def run(tensors: int, make: Callable, config: dict | None, steps: int, warmup: int, root: str, device: str,
        total: int = TOTAL_PARAMS, precision: str = "32-true", shape: str = "residual") -> dict:
    timer = StepTimer()
    callback = None if config is None else TimedCallback(**config)
    trainer = L.Trainer(max_steps=steps, default_root_dir=root, logger=L.pytorch.loggers.CSVLogger(root),
                        log_every_n_steps=50, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator=device, devices=1, precision=precision,
                        callbacks=[c for c in (callback, timer) if c is not None])
    model = DemoDecoder(make, steps) if shape == "demo" else Residual(tensors, make, steps, total)
    trainer.fit(model)
    resident = callback.monitor.resident_bytes() if callback is not None else 0
    timed = callback is not None and steps > warmup
    return {"step": lower_quartile(timer.wall[warmup:]) if steps > warmup + 4 else math.nan,
            "inside": statistics.mean(callback.seconds[warmup:]) if timed else 0.0,
            "guard": statistics.median(callback.guard[warmup:]) if timed else 0.0,
            "update": statistics.median(callback.update[warmup:]) if timed else 0.0,
            "writeback": statistics.mean(callback.writeback[warmup:]) if timed else 0.0,
            "resident": resident, "state": state_bytes(trainer.optimizers[0]),
            "params": sum(p.numel() for p in model.parameters()), "tensors": len(list(model.parameters()))}


class HookClock:
    """Seconds (``clock``) inside the monitor (its pipelines' step hooks, ``compute()`` and ``reset_window()``) and,
    of those, inside the guard's passes, while the context is open."""

    PATCHED = ((OptimizerPipeline, "before_step", "monitor"), (OptimizerPipeline, "after_step", "monitor"),
               (StaleStateMonitor, "compute", "monitor"), (StaleStateMonitor, "reset_window", "monitor"),
               (GuardPlan, "run", "guard"))

    def __init__(self) -> None:
        self.monitor = 0.0
        self.guard = 0.0

    def _clocked(self, function: Callable, field: str) -> Callable:
        def clocked(*args, **kwargs):
            start = clock()
            out = function(*args, **kwargs)
            setattr(self, field, getattr(self, field) + clock() - start)
            return out

        return clocked

    def __enter__(self) -> HookClock:
        self._saved = [getattr(owner, name) for owner, name, _ in self.PATCHED]
        for (owner, name, field), function in zip(self.PATCHED, self._saved):
            setattr(owner, name, self._clocked(function, field))
        return self

    def __exit__(self, *exc: object) -> None:
        for (owner, name, _), function in zip(self.PATCHED, self._saved):
            setattr(owner, name, function)


class MlpCopy:
    """One copy of the paired MLP (4 x ``Linear(1024, 1024)`` with ReLU, batch 32) with its optimizer, monitored
    with the underflow guard on (``compute()`` and ``reset_window()`` every ``MLP_LOG_EVERY`` steps, as the callback
    logs) or not; each call is one training step."""

    def __init__(self, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], monitored: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(BATCH, 1024, generator=g), torch.randn(BATCH, 1024, generator=g)
        torch.manual_seed(0)
        self.model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(1024, 1024), nn.ReLU())])
        self.optimizer = make(list(self.model.parameters()))
        self.monitor = StaleStateMonitor(self.optimizer, underflow_guard=True, coverage_steps=MLP_LOG_EVERY) \
            if monitored else None
        self.steps = 0

    def __call__(self) -> None:
        self.optimizer.zero_grad()
        nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.optimizer.step()
        self.steps += 1
        if self.monitor is not None and self.steps % MLP_LOG_EVERY == 0:
            self.monitor.compute()
            self.monitor.reset_window()


def paired(args: argparse.Namespace) -> None:
    """``--paired``: monitor + guard against no monitor on the paired MLP, each optimizer's two copies trained side by
    side in one process with their steps interleaved (the order alternates every step), so that both see the same
    load; a run's ratio is the monitored copy's total step time over the unmonitored copy's (logging steps
    included), and the table gives the median over runs."""
    makers = optimizers(args.device)
    print(f"torch {torch.__version__}, {args.threads} thread(s); the paired MLP (4 x Linear(1024, 1024), batch "
          f"{BATCH}), plain loop; StaleStateMonitor(underflow_guard=True) with compute() every {MLP_LOG_EVERY} "
          f"steps against no monitor, steps interleaved; {args.rounds} runs of {args.steps} steps after "
          f"{args.warmup} warm-up steps; {'thread CPU' if clock is time.thread_time else 'wall'} time")
    print("\n| optimizer | unmonitored step (ms) | monitor + guard / unmonitored (median) | runs, min-max | inside the "
          "monitor (hooks, compute, reset_window), % of the unmonitored step | of which the guard |")
    print("|---|---|---|---|---|---|")
    for name in args.optimizers or ["bnb AdamW8bit", "torch AdamW"]:
        plain, monitored = MlpCopy(makers[name], False), MlpCopy(makers[name], True)
        for _ in range(args.warmup):
            plain()
            monitored()
        ratios, base, inside, guard = [], [], [], []
        for _ in range(args.rounds):
            seconds = [0.0, 0.0]
            with HookClock() as spent:
                for i in range(args.steps):
                    for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                        start = clock()
                        (plain, monitored)[which]()
                        seconds[which] += clock() - start
            ratios.append(seconds[1] / seconds[0])
            base.append(seconds[0] / args.steps)
            inside.append(spent.monitor / seconds[0])
            guard.append(spent.guard / seconds[0])
        print(f"| {name} | {1e3 * statistics.median(base):.1f} | {statistics.median(ratios):.3f}x | "
              f"{min(ratios):.3f}-{max(ratios):.3f} | {100 * statistics.median(inside):.1f}% | "
              f"{100 * statistics.median(guard):.1f}% |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tensors", type=int, nargs="+", default=list(TENSOR_COUNTS))
    parser.add_argument("--optimizers", nargs="+", default=None,
                        help="names from the table (default: all; the QuantizedAdamW fp8 and bf16 ones with guard)")
    parser.add_argument("--modes", nargs="+", default=["default", "exact", "theory"], choices=list(MODES)[1:],
                        help="callback modes besides no callback")
    parser.add_argument("--precision", default="32-true",
                        help="the Trainer's precision (bf16-true: bf16 weights, for --modes weights)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the training thread's CPU time (time.thread_time; with --threads 1 all of the "
                             "step's compute), not wall time: robust to other processes on a loaded machine")
    parser.add_argument("--model", choices=("residual", "demo"), default="residual",
                        help="residual stacks of --tensors tensors, or the long plan's demo decoder (--tensors unused)")
    parser.add_argument("--memory-params", type=int, default=12_000_000,  # 0: no memory section
                        help="total parameters of the memory-only models")
    parser.add_argument("--paired", action="store_true",
                        help="monitor + guard on a 4 x Linear(1024, 1024) MLP, interleaved in one process (--rounds runs of --steps)")
    args = parser.parse_args()
    if args.cpu_time:
        global clock
        clock = time.thread_time
    torch.set_num_threads(args.threads)
    if args.paired:
        paired(args)
        return
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    all_optimizers = optimizers(args.device)
    standard = [k for k in all_optimizers if k not in GUARD_ONLY or "guard" in args.modes]
    chosen = {k: v for k, v in all_optimizers.items() if k in (args.optimizers or standard)}
    demo = args.model == "demo"
    print(f"torch {torch.__version__}, device {args.device}, {args.threads} thread(s), "
          f"{'CPU time of the training thread' if args.cpu_time else 'wall time'}, "
          f"{'demo decoder, batch ' + str(DEMO_BATCH) if demo else 'batch ' + str(BATCH)}, precision {args.precision}, "
          f"{args.steps} steps per run ({args.warmup} warm-up), {args.rounds} rounds, log_every_n_steps=50")
    print("\nstep time ratio to no callback (median over rounds); in brackets the time inside the callback as a share of "
          "the no-callback step")
    print("\n| optimizer | tensors | params | no-callback step (ms) | " + " | ".join(args.modes) + " | resident / state |")
    print("|---|---|---|---|" + "---|" * len(args.modes) + "---|")
    guard_rows, writeback_rows = [], []
    with tempfile.TemporaryDirectory() as root:
        for opt_name, make in chosen.items():
            for tensors in [0] if demo else args.tensors:
                names = ["no callback", *(m for m in args.modes if applies(opt_name, m))]
                for mode in names:  # discarded: first-run allocation and library start-up costs
                    run(tensors, make, MODES[mode], args.warmup + 6, args.warmup, root, args.device,
                        precision=args.precision, shape=args.model)
                results: dict[str, list[dict]] = {m: [] for m in names}
                for r in range(args.rounds):
                    for mode in names[r % len(names):] + names[:r % len(names)]:
                        results[mode].append(run(tensors, make, MODES[mode], args.steps, args.warmup, root,
                                                 args.device, precision=args.precision, shape=args.model))
                base = results["no callback"]
                ratios = {m: statistics.median(x["step"] / b["step"] for x, b in zip(results[m], base))
                          for m in names[1:]}
                inside = {m: statistics.median(x["inside"] / b["step"] for x, b in zip(results[m], base))
                          for m in names[1:]}
                default = results["default"][-1]
                print(f"| {opt_name} | {default['tensors']} | {default['params'] / 1e6:.2f}M | "
                      f"{1e3 * statistics.median(b['step'] for b in base):.1f} | "
                      + " | ".join(f"{ratios[m]:.3f}x ({100 * inside[m]:.1f}%)" if m in ratios else "-"
                                   for m in args.modes)
                      + f" | {100 * default['resident'] / default['state']:.2f}% "
                      f"({default['resident'] / 1024:.0f} KiB) |", flush=True)
                for mode in (m for m in names if writes_weights(m)):
                    hooks = [x["writeback"] for x in results[mode]]
                    writeback_rows.append(
                        f"| {opt_name} | {default['tensors']} | {mode} | {1e3 * statistics.median(hooks):.2f} | "
                        f"{100 * statistics.median(h / b['step'] for h, b in zip(hooks, base)):.1f}% | "
                        f"{100 * (ratios[mode] - ratios['default']):+.1f}% |")
                if "guard" in results:
                    guarded = results["guard"]
                    guard_rows.append(
                        f"| {opt_name} | {default['tensors']} | "
                        f"{1e3 * statistics.median(x['update'] for x in guarded):.1f} | "
                        f"{1e3 * statistics.median(x['guard'] for x in guarded):.2f} | "
                        f"{100 * statistics.median(x['guard'] / x['update'] for x in guarded):.1f}% |")
        if guard_rows:
            print("\nThe guard against the optimizer step (guard mode; median per step, median over rounds):")
            print("| optimizer | tensors | optimizer step (ms) | guard (ms) | guard / optimizer step |")
            print("|---|---|---|---|---|")
            print("\n".join(guard_rows), flush=True)
        if writeback_rows:
            print("\nThe weight write-back (mean per step of its step hooks, median over rounds; share of the "
                  "no-callback step; A/B: the mode's step ratio less the default mode's):")
            print("| optimizer | tensors | mode | write-back hooks (ms) | hooks / step | A/B cost |")
            print("|---|---|---|---|---|---|")
            print("\n".join(writeback_rows), flush=True)
        if demo or not args.memory_params:
            return
        print(f"\nResident memory at ~{args.memory_params / 1e6:.0f}M parameters (default mode, memory only):")
        print("| optimizer | tensors | state (MiB) | resident (KiB) | resident / state |")
        print("|---|---|---|---|---|")
        for opt_name, make in chosen.items():
            for tensors in (args.tensors[0], args.tensors[-1]):
                # long enough for every cohort to be measured once (its batch plan is built then)
                big = run(tensors, make, {}, 60, 0, root, args.device, args.memory_params)
                print(f"| {opt_name} | {big['tensors']} | {big['state'] / 2**20:.1f} | {big['resident'] / 1024:.0f} | "
                      f"{100 * big['resident'] / big['state']:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
