"""What monitoring adds to a process's memory.

What the monitor holds, against the optimizer state it watches, counted two ways: its own ``resident_bytes()`` and
an independent walk of every object the monitor references (each tensor storage and numpy buffer once; the
optimizer, its state and the parameters it reads are not the monitor's). With ``--trace``, what a plain training loop
(GPT-2 shapes, bitsandbytes AdamW8bit, ``compute()`` and ``reset_window()`` every ``--coverage`` steps, one thread)
costs in resident set and peak memory, monitored against unmonitored, each in its own process: a warm-up on a
one-layer model first pays what is paid once (imports, code maps, compiled kernels), then the resident set is traced
from the first monitored step; the monitor's transient peak per step (above what was live when its hook began) is
measured in a third process.

    python benchmarks/memory.py                      # walk: GPT-2 shapes of 20M parameters, bnb AdamW8bit and bf16 AdamW
    python benchmarks/memory.py --layers 4 --steps 6 --kinds bnb
    python benchmarks/memory.py --trace              # 600 steps: resident set and peaks, monitored vs unmonitored
    python benchmarks/memory.py --trace --malloc fixed  # glibc returning freed blocks at once: what is live

Gradients are random (no forward pass): memory does not depend on them (``--trace`` writes them in place, so that the
loop itself allocates nothing). ``--coverage`` is the logging interval, in steps, within which every parameter is
measured (each cohort's batch plan is kept).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

TRACE_AT = (1, 10, 30, 100, 300, 600, 1000, 3000)  # steps at which --trace reads the resident set
PEAK_STEPS = 12  # steps of the peak process: the first measurement, a check step and a logging step among them
MALLOC = {"default": {}, "fixed": {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}}


def walk_bytes(root: object, exclude: set[int]) -> int:
    """Bytes of the tensors and numpy arrays reachable from ``root`` (each storage once), skipping storages whose
    address is in ``exclude``, and without entering optimizers, modules, classes or functions' globals."""
    seen: set[int] = set()
    storages: set[int] = set()
    total, stack = 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            if storage.data_ptr() not in exclude and storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
            continue
        if isinstance(obj, np.ndarray):
            base = obj if obj.base is None else obj.base
            if id(base) not in storages:
                storages.add(id(base))
                total += base.nbytes if isinstance(base, np.ndarray) else obj.nbytes
            continue
        if isinstance(obj, (torch.optim.Optimizer, nn.Module, type, types.ModuleType)):
            continue
        if isinstance(obj, types.FunctionType):  # its closure, not the module globals it can see
            stack.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
            continue
        if isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
            continue
        stack.extend(gc.get_referents(obj))
    return total


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def state_storages(optimizer: torch.optim.Optimizer) -> tuple[set[int], int]:
    """(addresses of the optimizer's state, parameter and gradient storages, bytes of its state)."""
    addresses, state_bytes = set(), 0
    for param, state in optimizer.state.items():
        for value in [param, param.grad, *state.values()]:
            for tensor in _tensors(value):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in addresses and value is not param and value is not param.grad:
                    state_bytes += storage.nbytes()
                addresses.add(storage.data_ptr())
    return addresses, state_bytes


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        inner = [getattr(value, name) for name in ("codes", "scale", "qmap") if isinstance(getattr(value, name, None),
                                                                                         torch.Tensor)]
        return inner or [value]  # torchao's state subclasses keep their data in codes/scale/qmap
    return []


def gpt2(layers: int, width: int, dtype: torch.dtype, vocab: int = 50257) -> nn.Module:
    """A GPT-2 of the given depth and width (tied embeddings), built from a config: no download."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_layer=layers, n_embd=width, n_head=max(1, width // 64),
                                     n_positions=256)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def measure(kind: str, layers: int, width: int, steps: int, coverage: int) -> dict[str, float]:
    from lightning_stale import StaleStateMonitor

    model = gpt2(layers, width, torch.bfloat16 if kind == "torch_bf16" else torch.float32)
    params = list(model.parameters())
    if kind == "bnb":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(params, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4)
    monitor = StaleStateMonitor(optimizer, names=model, coverage_steps=coverage)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
        optimizer.step()
    monitor.compute()
    exclude, state_bytes = state_storages(optimizer)
    walked = walk_bytes(monitor, exclude)
    return {"params": sum(p.numel() for p in params), "tensors": len(params), "state_bytes": state_bytes,
            "resident_bytes": monitor.resident_bytes(), "walked_bytes": walked}


def proc_mib(field: str) -> float:
    """A field of this process's /proc status in MiB: ``VmRSS`` (the resident set), ``RssAnon`` (its anonymous part:
    the heap, without the library code paged in) or ``VmHWM`` (its peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


class PeakWindow:
    """The peak of the bytes allocated between :meth:`start` and :meth:`stop` above what was live at the start:
    ``torch.cuda.max_memory_allocated`` on a GPU; on CPU every allocation and free of torch's allocator, in order, as
    the profiler records them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profile: torch.profiler.profile | None = None
        self._base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base
        self._profile.__exit__(None, None, None)
        events = [e for e in self._profile.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        return peak


def transient_peak(function: Callable[[], object], device: torch.device) -> int:
    """The transient peak of one call (see :class:`PeakWindow`)."""
    window = PeakWindow(device)
    window.start()
    function()
    return window.stop()


def monitor_with_peaks(optimizer: torch.optim.Optimizer, attach: Callable[[], object],
                       device: torch.device) -> tuple[object, list[int]]:
    """``attach()`` (which builds the monitor) between step hooks that open and close a :class:`PeakWindow` around
    the monitor's own: the list receives the transient peak of each of its hooks (torch runs hooks in the order of
    registration)."""
    window, peaks = PeakWindow(device), []
    optimizer.register_step_pre_hook(lambda *_: window.start())
    optimizer.register_step_post_hook(lambda *_: window.start())
    monitor = attach()
    optimizer.register_step_pre_hook(lambda *_: peaks.append(window.stop()))
    optimizer.register_step_post_hook(lambda *_: peaks.append(window.stop()))
    return monitor, peaks


def log(monitor: object) -> None:
    """What a logging step asks of the monitor: its row, then a new window."""
    monitor.compute()
    monitor.reset_window()


def _loop(layers: int, width: int, steps: int, coverage: int, role: str, device: torch.device,
          vocab: int = 50257) -> dict:
    """One training loop of ``role`` (``plain``, ``monitored`` or ``peaks``) on a GPT-2 with bitsandbytes AdamW8bit:
    three unmonitored steps, then ``steps`` steps with or without the monitor; resident set and peaks from step 0."""
    import bitsandbytes as bnb

    from lightning_stale import StaleStateMonitor

    model = gpt2(layers, width, torch.float32, vocab).to(device)
    params = list(model.parameters())
    optimizer = bnb.optim.AdamW8bit(params, lr=1e-4)
    g = torch.Generator(device).manual_seed(0)
    for p in params:
        p.grad = torch.zeros_like(p)

    def step() -> None:
        for p in params:
            p.grad.normal_(0.0, 1e-3, generator=g)
        optimizer.step()

    for _ in range(3):  # the optimizer's state exists before monitoring starts
        step()
    gc.collect()
    out: dict = {"params": sum(p.numel() for p in params), "largest": max(p.numel() for p in params), "trace": {}}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        out["cuda_base"] = torch.cuda.memory_allocated(device)
    base, base_anon = proc_mib("VmRSS"), proc_mib("RssAnon")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM starts again from the current resident set
    monitor, peaks = None, []
    if role == "peaks":
        monitor, peaks = monitor_with_peaks(
            optimizer, lambda: StaleStateMonitor(optimizer, names=model, coverage_steps=coverage), device)
    elif role == "monitored":
        monitor = StaleStateMonitor(optimizer, names=model, coverage_steps=coverage)
    for i in range(1, steps + 1):
        step()
        if monitor is not None and i % coverage == 0:
            if role == "peaks":
                peaks.append(transient_peak(lambda: log(monitor), device))
            else:
                log(monitor)
        if i in TRACE_AT or i == steps:
            out["trace"][i] = proc_mib("VmRSS") - base, proc_mib("RssAnon") - base_anon
    out["peak_resident"] = proc_mib("VmHWM") - base
    if device.type == "cuda":
        out["cuda_peak"] = (torch.cuda.max_memory_allocated(device) - out.pop("cuda_base")) / 2**20
    out["transient_peak"] = max(peaks, default=0) / 2**20
    out["resident_bytes"] = monitor.resident_bytes() if monitor is not None else 0
    if monitor is not None:
        monitor.close()
    return out


def child(role: str, layers: int, width: int, steps: int, coverage: int, device: torch.device) -> dict:
    """One process of ``--trace``: the warm-up (a one-layer loop, with the monitor unless ``plain``), then the loop."""
    torch.set_num_threads(1)
    start, start_anon = proc_mib("VmRSS"), proc_mib("RssAnon")
    _loop(1, 64, PEAK_STEPS, min(coverage, PEAK_STEPS), "plain" if role == "plain" else "monitored", device,
          vocab=1024)
    gc.collect()
    out = {"warmup": (proc_mib("VmRSS") - start, proc_mib("RssAnon") - start_anon)}
    out.update(_loop(layers, width, steps, coverage, role, device))
    if role == "peaks":  # the same on a model whose largest tensor (the embedding) is four times larger
        out["transient_peak_x4"] = _loop(layers, width, steps, coverage, role, device, vocab=4 * 50257)[
            "transient_peak"]
    return out


def trace(args: argparse.Namespace) -> None:
    """``--trace``: the three processes, one after the other, and their table."""
    env = {**os.environ, **MALLOC[args.malloc]}
    results = {}
    for role, steps in (("plain", args.steps), ("monitored", args.steps), ("peaks", PEAK_STEPS)):
        command = [sys.executable, __file__, "--child", role, "--layers", str(args.layers), "--width",
                   str(args.width), "--steps", str(steps), "--coverage", str(args.coverage), "--device", args.device]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        results[role] = json.loads(done.stdout.strip().splitlines()[-1])
    plain, monitored, peaks = results["plain"], results["monitored"], results["peaks"]
    print(f"GPT-2 {args.layers} layers x {args.width} ({plain['params'] / 1e6:.1f}M parameters, largest tensor "
          f"{plain['largest'] / 1e6:.1f}M), bitsandbytes AdamW8bit, plain loop, compute() and reset_window() every "
          f"{args.coverage} steps, one thread, {args.steps} steps, malloc {args.malloc} {MALLOC[args.malloc] or ''}, "
          f"torch {torch.__version__}, device {args.device}")
    print(f"\nwarm-up (one-layer model, {PEAK_STEPS} steps; what is paid once), resident set (anonymous part): "
          f"unmonitored {plain['warmup'][0]:+.1f} ({plain['warmup'][1]:+.1f}) MiB, monitored "
          f"{monitored['warmup'][0]:+.1f} ({monitored['warmup'][1]:+.1f}) MiB")
    print("\n| from step 0, MiB: resident set (anonymous part) | unmonitored | monitored | monitored - unmonitored |")
    print("|---|---|---|---|")
    for step in plain["trace"]:
        (a, a_anon), (b, b_anon) = plain["trace"][step], monitored["trace"][step]
        print(f"| step {step} | {a:+.1f} ({a_anon:+.1f}) | {b:+.1f} ({b_anon:+.1f}) | {b - a:+.1f} "
              f"({b_anon - a_anon:+.1f}) |")
    a, b = plain["peak_resident"], monitored["peak_resident"]
    print(f"| peak resident set (VmHWM) | {a:+.1f} | {b:+.1f} | {b - a:+.1f} |")
    if "cuda_peak" in plain:
        a, b = plain["cuda_peak"], monitored["cuda_peak"]
        print(f"| peak allocated (torch.cuda.max_memory_allocated) | {a:+.1f} | {b:+.1f} | {b - a:+.1f} |")
    print(f"\nresident_bytes() at the end: {monitored['resident_bytes'] / 1024:.1f} KiB")
    print(f"the monitor's transient peak per step (max over {PEAK_STEPS} steps, above what was live when its hook "
          f"began): {peaks['transient_peak']:.2f} MiB; with a largest tensor four times larger: "
          f"{peaks['transient_peak_x4']:.2f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=None, help="default 8; with --trace 600")
    parser.add_argument("--coverage", type=int, default=None, help="default 4; with --trace 10")
    parser.add_argument("--kinds", default="bnb,torch_bf16")
    parser.add_argument("--trace", action="store_true", help="resident set and peaks, monitored vs unmonitored")
    parser.add_argument("--malloc", choices=list(MALLOC), default="default",
                        help="glibc settings of the --trace processes (fixed: freed large blocks go back at once)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", choices=("plain", "monitored", "peaks"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (600 if args.trace else 8)
    args.coverage = args.coverage or (10 if args.trace else 4)
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.width, args.steps, args.coverage,
                               torch.device(args.device))))
        return
    if args.trace:
        trace(args)
        return
    torch.set_num_threads(2)
    print(f"GPT-2 {args.layers} layers x {args.width}, {args.steps} steps, coverage {args.coverage}, torch "
          f"{torch.__version__}")
    print(f"{'optimizer':<11} {'params':>11} {'tensors':>7} {'state MiB':>9} {'resident KiB':>12} "
          f"{'walked KiB':>10} {'walked / state':>14}")
    for kind in args.kinds.split(","):
        r = measure(kind, args.layers, args.width, args.steps, args.coverage)
        print(f"{kind:<11} {r['params']:>11,} {r['tensors']:>7} {r['state_bytes'] / 2**20:>9.1f} "
              f"{r['resident_bytes'] / 1024:>12.1f} {r['walked_bytes'] / 1024:>10.1f} "
              f"{100 * r['walked_bytes'] / r['state_bytes']:>13.3f}%")


if __name__ == "__main__":
    main()
