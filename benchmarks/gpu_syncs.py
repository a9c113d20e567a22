"""The prepared GPU check's ``syncs`` part: every front-end's steps with each optimizer family and remedy, the host
syncs the package causes counted per optimizer step (:class:`~lightning_stale.testing.HostSyncCounter`), and on CUDA
also torch's own sync check (``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call warns, and the
package's are those whose innermost own frame lies in it). Steps that log are marked and tallied apart; the first
steps (the state appears, the measurement plans are built) are set-up.

Run alone: ``python benchmarks/gpu_syncs.py --device cuda`` (or ``cpu``, where only the counter runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
EVERY = 4  # logging interval (and coverage_steps: check steps are logging steps, as in every front-end)
STEPS = 16
SETUP = 3  # tallies 1 and 2 are set-up (tally 0 is everything before the first step)
SIZES = [(96, 33), (5,), (3000,), (7, 3, 2), (640, 9), (1,), (129,), (300, 300)]  # odd sizes, one of 1 element


def counter(device: str) -> Any:
    """The dispatch-level counter for a run on ``device`` (on a CPU run host tensors are told by their birth)."""
    from lightning_stale.testing import HostSyncCounter

    class DeviceCounter(HostSyncCounter):
        device_type = torch.device(device).type

    return DeviceCounter()


@contextlib.contextmanager
def cuda_sync_warnings(syncs: Any) -> Iterator[list[str]]:
    """torch's CUDA sync check in ``"warn"`` mode while entered: each synchronizing call the package caused (by the
    counter's own attribution of the calling frames) is listed with its optimizer step."""
    caught: list[str] = []
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        if "synchronizing" not in str(message):
            return original(message, category, filename, lineno, file, line)
        ours, where = syncs._attribute()
        tally = syncs.tallies[-1]
        if ours and not tally.logs and tally.index >= SETUP:
            caught.append(f"step {tally.index}: {where}")
        return None

    with warnings.catch_warnings():  # restores showwarning and the filters on leaving
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def params(device: str, dtype: torch.dtype = torch.bfloat16) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(s, device=device).to(dtype) * 0.1) for s in SIZES]


def optimizer(kind: str, ps: list[nn.Parameter]) -> torch.optim.Optimizer:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import make_optimizer

    return {
        "adamw-foreach": lambda: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "adamw-fused": lambda: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "sgd": lambda: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
        "bnb-adamw8bit": lambda: make_optimizer("bnb", ps, min_8bit_size=256),
        "qadamw": lambda: make_optimizer("qadamw:int8_dynamic:stochastic", ps, min_quantized_size=256),
    }[kind]()


def plain_loop(device: str, kind: str, options: dict[str, Any], syncs: Any, missing: int | None = 1) -> None:
    """``StaleStateMonitor`` on ``kind``; parameter ``missing`` has no gradient every other step."""
    from lightning_stale import StaleStateMonitor

    ps = params(device)
    opt = optimizer(kind, ps)
    monitor = StaleStateMonitor(opt, coverage_steps=EVERY, **options)
    for step in range(1, STEPS + 1):
        for i, p in enumerate(ps):
            p.grad = None if i == missing and step % 2 else torch.randn_like(p) * 1e-2
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            syncs.mark_logging()
            monitor.compute()
            monitor.reset_window()
    monitor.close()


def _module(device: str) -> Any:
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(17, 330), nn.ReLU(), nn.Linear(330, 3)).to(torch.bfloat16)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def train_dataloader(self):  # noqa: ANN201
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(256, 17, generator=g).to(torch.bfloat16),
                                                  torch.randn(256, 3, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=8)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    return Regression()


def trainer(device: str, options: dict[str, Any], syncs: Any) -> None:
    import lightning as L

    from lightning_stale import StaleStateCallback, _compat

    class MarkLogging(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001
            if _compat.lightning_should_log(trainer):
                syncs.mark_logging()

    run = L.Trainer(max_steps=STEPS, log_every_n_steps=EVERY, accelerator=device, devices=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[StaleStateCallback(**options), MarkLogging()])
    run.fit(_module(device))


def fabric(device: str, options: dict[str, Any], syncs: Any) -> None:
    import lightning as L

    from lightning_stale.fabric import StaleStateFabricCallback

    fab = L.Fabric(accelerator=device, devices=1, callbacks=[StaleStateFabricCallback(EVERY, **options)])
    module = _module(device)
    model, opt = fab.setup(module, module.configure_optimizers())
    for step, (x, y) in enumerate(fab.setup_dataloaders(module.train_dataloader()), start=1):
        fab.backward(nn.functional.mse_loss(model.net(x).float(), y))
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            syncs.mark_logging()
        if step == STEPS:
            break


def hugging_face(device: str, options: dict[str, Any], syncs: Any) -> None:
    import tempfile

    import transformers

    from lightning_stale.hf import add_stale_callback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=96,
                                                                 n_positions=16)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (128, 16), generator=g)]

    class MarkLogs(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            syncs.mark_logging()

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=4,
                                              logging_steps=EVERY, report_to=[], use_cpu=device == "cpu",
                                              save_strategy="no", disable_tqdm=True)
        run = transformers.Trainer(model=model, args=args, train_dataset=data)
        add_stale_callback(run, **options)
        run.add_callback(MarkLogs())
        run.train()


def runs(quick: bool) -> list[tuple[str, Callable[[str, Any], None]]]:
    """(name, run(device, counter)) of every configuration the part checks."""
    out: list[tuple[str, Callable[[str, Any], None]]] = []
    families = ("adamw-foreach",) if quick else ("adamw-foreach", "adamw-fused", "sgd", "bnb-adamw8bit", "qadamw")
    for kind in families:
        out.append((f"plain loop, {kind}, auto", lambda d, s, k=kind: plain_loop(d, k, {"remedy": "auto"}, s)))
    if not quick:
        for label, options in (("theory resets", {"reset": "theory"}), ("adaptive resets", {"reset": "adaptive"}),
                               ("drift resets", {"reset": "drift"}), ("underflow guard", {"underflow_guard": True}),
                               ("compensated weights", {"weights": "compensated+moments"})):
            out.append((f"plain loop, adamw-foreach, {label}",
                        lambda d, s, o=options: plain_loop(d, "adamw-foreach", o, s)))
        out.append(("Trainer, auto", lambda d, s: trainer(d, {"remedy": "auto"}, s)))
        out.append(("Trainer, adaptive resets", lambda d, s: trainer(d, {"reset": "adaptive"}, s)))
        out.append(("Fabric, auto", lambda d, s: fabric(d, {"remedy": "auto"}, s)))
        out.append(("Hugging Face Trainer, auto", lambda d, s: hugging_face(d, {"remedy": "auto"}, s)))
    else:
        out.append(("Trainer, auto", lambda d, s: trainer(d, {"remedy": "auto"}, s)))
    return out


def run_front_ends(device: str, quick: bool) -> dict[str, Any]:
    """Every configuration of :func:`runs` under the counter (and on CUDA torch's sync check): per run, the host
    syncs the package caused on steps that do not log after set-up (0 is the target), their places, and the most
    host reads of a logging step."""
    results = []
    for name, run in runs(quick):
        syncs = counter(device)
        error, caught = None, []
        try:
            with syncs, (cuda_sync_warnings(syncs) if device.startswith("cuda") else contextlib.nullcontext([])) \
                    as caught:
                run(device, syncs)
        except Exception as exc:  # noqa: BLE001 - recorded, the next configuration runs
            error = f"{type(exc).__name__}: {exc}"
        offenders = syncs.offenders(SETUP)
        logging_reads = max((t.reads for t in syncs.tallies[SETUP:] if t.logs), default=0)
        result = {"run": name, "steps": len(syncs.tallies) - 1, "syncs": sum(t.syncs for t in offenders)
                  + len(caught), "logging_reads": logging_reads, "error": error,
                  "where": syncs.summary(offenders).splitlines()[:12] + caught[:12]}
        results.append(result)
        print(f"{name}: {result['steps']} steps, {result['syncs']} syncs on steps that do not log, at most "
              f"{logging_reads} reads on a logging step" + (f"; ERROR {error}" if error else ""), flush=True)
        for line in result["where"]:
            print(f"    {line}")
    return {"runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(json.dumps(run_front_ends(args.device, args.quick), indent=1))


if __name__ == "__main__":
    main()
