"""Golden comparison: everything the monitor makes observable, over ~30 small configurations, as exact JSON.

A refactor that must not change behaviour runs this before and after and compares the two files byte for byte:
every logged value (as ``float.hex``), every reset event, the monitor's ``state_dict()`` (tensors hashed bytewise)
after a save/load round trip mid-run, and the optimizer state and parameters (hashed bytewise) at the end. It only
imports public paths (``lightning_stale``, ``lightning_stale.optim``), so the same script runs on both trees. Run:

    .venv/bin/python benchmarks/golden.py --out /tmp/after.json [--compare /tmp/before.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.optim import QuantizedAdamW

STEPS, LOG_EVERY = 120, 10


def digest(value: Any) -> Any:
    """A JSON-able exact image of ``value``: floats as hex, tensors and arrays as dtype/shape/sha256 of their bytes."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return {"tensor": str(data.dtype), "shape": list(data.shape), "sha256": hashlib.sha256(raw).hexdigest()}
    if hasattr(value, "dtype") and hasattr(value, "tobytes"):  # numpy arrays and scalars
        return {"array": str(value.dtype), "shape": list(getattr(value, "shape", ())),
                "sha256": hashlib.sha256(value.tobytes()).hexdigest()}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): digest(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [digest(v) for v in items]
    return repr(value)


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4)).to(dtype)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """``torch``, ``bnb``, or ``q:<format>:<rounding>`` (QuantizedAdamW); a ``/<beta2>`` suffix sets beta2."""
    kind, _, beta2 = kind.partition("/")
    betas = (0.9, float(beta2) if beta2 else 0.999)
    if kind == "torch":
        return torch.optim.AdamW(params, lr=3e-3, betas=betas)
    if kind == "bnb":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=3e-3, betas=betas, min_8bit_size=256)
    _, fmt, rounding = kind.split(":")
    return QuantizedAdamW(params, lr=3e-3, betas=betas, state_format=fmt, rounding=rounding, min_quantized_size=64,
                          compile=False)


def batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, 8, 16, generator=generator) * torch.logspace(-3, 0, 16)
    return [(x[i].to(dtype), x[i, :, :4].sin().to(dtype)) for i in range(STEPS)]


def optimizer_digest(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    return {"params": [digest(p) for p in model.parameters()],
            "state": [digest(dict(optimizer.state[p])) for p in model.parameters() if p in optimizer.state]}


def run_loop(kind: str, dtype: torch.dtype, options: dict[str, Any]) -> dict[str, Any]:
    """The documented plain loop: ``monitor.compute()`` and ``monitor.reset_window()`` every ``LOG_EVERY`` steps, a
    save/load round trip halfway."""
    model = make_model(dtype)
    optimizer = make_optimizer(kind, model.parameters())
    monitor = StaleStateMonitor(optimizer, names=model, coverage_steps=LOG_EVERY, **options)
    events: list[Any] = []
    monitor.add_reset_listener(lambda e: events.append([e.step, len(e.slots), sorted(map(str, e.slots))]))
    rows, saved = [], None
    for step, (x, y) in enumerate(batches(dtype), start=1):
        nn.functional.mse_loss(model(x).float(), y.float()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % LOG_EVERY == 0:
            rows.append([step, digest(monitor.compute())])
            getattr(monitor, "reset_window", lambda: None)()  # before reset_window(), compute() started the window
        if step == STEPS // 2:
            saved = monitor.state_dict()
            monitor.close()
            monitor = StaleStateMonitor(optimizer, names=model, coverage_steps=LOG_EVERY, **options)
            monitor.add_reset_listener(lambda e: events.append([e.step, len(e.slots), sorted(map(str, e.slots))]))
            monitor.load_state_dict(saved)
    result = {"rows": rows, "events": events, "saved": digest(saved), "final": digest(monitor.state_dict()),
              "periods": digest(monitor.reset_periods()), "reset_events": monitor.reset_events,
              "remedy_resets": monitor.remedy_resets, "steps": monitor.steps,
              "optimizer": optimizer_digest(optimizer, model)}
    monitor.close()
    return result


def run_trainer(kind: str, dtype: torch.dtype, options: dict[str, Any]) -> dict[str, Any]:
    """A real Lightning Trainer with the callback, every logged value captured by a recording logger."""
    import lightning as L
    from lightning.pytorch.loggers import Logger
    from torch.utils.data import DataLoader

    class Recorder(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[Any] = []

        name, version = "golden", 0

        @property
        def experiment(self) -> None:
            return None

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append([step, digest({k: float(v) for k, v in metrics.items()})])

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    data = batches(dtype)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(dtype)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x[0]).float(), y[0].float())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(kind, self.net.parameters())

        def train_dataloader(self) -> DataLoader:
            return DataLoader(data, batch_size=None, shuffle=False, collate_fn=lambda b: (b[0][None], b[1][None]))

    module, recorder = Module(), Recorder()
    callback = StaleStateCallback(**options)
    events: list[Any] = []
    callback.add_reset_listener(lambda e: events.append([e.step, len(e.slots), sorted(map(str, e.slots))]))
    trainer = L.Trainer(max_steps=STEPS, logger=recorder, callbacks=[callback], log_every_n_steps=LOG_EVERY,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    trainer.fit(module)
    rows = [[step, {k: v for k, v in row.items() if not k.startswith(("epoch", "train_loss"))}]
            for step, row in recorder.rows]
    return {"rows": rows, "events": events, "state": digest(callback.state_dict()),
            "periods": digest(callback.reset_periods()), "reset_events": callback.reset_events,
            "optimizer": optimizer_digest(trainer.optimizers[0], module.net)}


Q = ("q:fp8_e4m3:nearest", "q:fp8_e4m3:stochastic", "q:fp4:nearest", "q:fp4:stochastic", "q:int8_dynamic:nearest",
     "q:int8_dynamic:stochastic", "q:bf16:nearest", "q:bf16:stochastic")
F32, B16 = torch.float32, torch.bfloat16
CONFIGS: list[tuple[str, Callable[..., dict[str, Any]], str, torch.dtype, dict[str, Any]]] = [
    ("loop/torch32/default", run_loop, "torch", F32, {}),
    ("loop/torch16/default", run_loop, "torch", B16, {}),
    ("loop/torch16/exact", run_loop, "torch", B16, {"track": "exact", "log_per_param": True}),
    ("loop/torch16/theory", run_loop, "torch", B16, {"reset": "theory", "s0": 0.3}),
    ("loop/torch16/remedy", run_loop, "torch", B16, {"remedy": "auto", "track": "exact"}),
    ("loop/bnb/default", run_loop, "bnb", F32, {"log_per_param": True}),
    ("loop/bnb/exact-theory", run_loop, "bnb", F32, {"track": "exact", "reset": "theory", "s0": 0.3}),
    ("loop/bnb/periodic-v", run_loop, "bnb", F32, {"reset": "periodic", "every": 5, "moments": ("v",)}),
    ("loop/bnb/adaptive", run_loop, "bnb", F32, {"reset": "adaptive", "min_interval": 4, "s0": 0.1}),
    ("loop/bnb/drift", run_loop, "bnb", F32, {"reset": "drift", "min_interval": 3, "drift_band": 1.05}),
    ("loop/bnb/remedy", run_loop, "bnb", F32, {"remedy": "auto", "drift_band": 1.05}),
    ("loop/bnb/guard", run_loop, "bnb", F32, {"underflow_guard": True, "track": "exact"}),
    *[(f"loop/{k}/default", run_loop, k, F32, {"log_per_param": True}) for k in Q],
    ("loop/q:fp8:n/exact-periodic", run_loop, Q[0], F32,
     {"track": "exact", "reset": "periodic", "every": 4, "warmup_steps": 2}),
    ("loop/q:fp8:s/theory", run_loop, Q[1], F32, {"reset": "theory", "s0": 0.3}),
    ("loop/q:fp8:n/theory-b95", run_loop, Q[0] + "/0.95", F32, {"reset": "theory", "s0": 0.3, "track": "exact"}),
    ("loop/bnb/theory-b9", run_loop, "bnb/0.9", F32, {"reset": "theory", "s0": 0.5}),
    ("loop/torch16/remedy-b95", run_loop, "torch/0.95", B16, {"remedy": "auto", "drift_band": 1.01}),
    ("loop/q:fp4:n/remedy-b95", run_loop, Q[2] + "/0.95", F32, {"remedy": "auto", "drift_band": 1.01}),
    ("loop/q:fp4:n/adaptive", run_loop, Q[2], F32, {"reset": "adaptive", "min_interval": 3, "s0": 0.1}),
    ("loop/q:int8:s/drift", run_loop, Q[5], F32, {"reset": "drift", "min_interval": 2, "drift_band": 1.02}),
    ("loop/q:bf16:n/remedy", run_loop, Q[6], F32, {"remedy": "auto", "track": "exact", "drift_band": 1.02}),
    ("loop/q:fp8:n/guard", run_loop, Q[0], F32, {"underflow_guard": True, "sample_size": 64, "params_per_step": 1}),
    ("loop/q:bf16:s/v-exact", run_loop, Q[7], F32,
     {"reset": "periodic", "every": 5, "moments": ("v",), "v_reset": "exact-unbounded", "track_every": 2}),
    ("trainer/torch16/default", run_trainer, "torch", B16, {"log_per_param": True}),
    ("trainer/bnb/theory", run_trainer, "bnb", F32, {"reset": "theory", "s0": 0.3, "track": "exact"}),
    ("trainer/q:fp8:s/periodic", run_trainer, Q[1], F32, {"reset": "periodic", "every": 5, "log_per_param": True}),
    ("trainer/q:int8:n/remedy", run_trainer, Q[4], F32, {"remedy": "auto", "drift_band": 1.02}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON")
    parser.add_argument("--compare", help="a JSON of an earlier run: report every configuration that differs")
    parser.add_argument("--only", help="run only configurations whose name contains this")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    start = time.perf_counter()
    for name, run, kind, dtype, options in CONFIGS:
        if args.only and args.only not in name:
            continue
        results[name] = run(kind, dtype, options)
    with open(args.out, "w") as out:
        json.dump(results, out, indent=1, sort_keys=True)
    print(f"{len(results)} configurations in {time.perf_counter() - start:.1f}s -> {args.out}")
    if args.compare:
        with open(args.compare) as before:
            baseline = json.load(before)
        differ = [n for n in results if json.dumps(results[n], sort_keys=True)
                  != json.dumps(baseline.get(n), sort_keys=True)]
        missing = [n for n in baseline if n not in results and not args.only]
        print(f"compared with {args.compare}: {len(results) - len(differ)}/{len(results)} identical"
              + (f"; differ: {differ}" if differ else "") + (f"; missing: {missing}" if missing else ""))
        sys.exit(1 if differ or missing else 0)


if __name__ == "__main__":
    main()
