"""The batched engine: exact counts equal an independent clone-and-compare on every step and every layout, samples
stay within sampling error, the step work does not grow with the number of tensors, nothing is read back to the host
on a non-logging step, and every tensor the engine creates lives on the state's device."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import make_optimizer
from lightning_stale import StaleStateMonitor
from lightning_stale.adapters import adapter_for
from lightning_stale.measure.counting import COUNTED, STALLED
from lightning_stale.measure.engine import StallEngine
from lightning_stale.optim import QuantizedAdamW

LR = 1e-3
# 8-bit and quantized states from 256 elements on, QuantizedAdamW eager; torchao keeps its default block sizes
OPTIMIZER_OPTIONS = {"lr": LR, "min_8bit_size": 256, "min_quantized_size": 256, "compile": False}


def layers(widths, device, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    mods = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    return nn.Sequential(*mods).to(device=device, dtype=dtype)


def state_codes(opt, p) -> dict[str, torch.Tensor]:
    """Every stored moment of ``p`` as one comparable flat code tensor (the probe reads the raw state itself)."""
    out = {}
    for key, value in opt.state[p].items():
        if key in ("step", "step_m", "step_v") or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if key.startswith(("absmax", "qmap", "exp_avg_scale", "exp_avg_sq_scale")):
            continue
        codes = getattr(value, "codes", value)
        if codes.dtype == torch.uint8 and type(value).__name__ == "OptimState4bit" or (
                isinstance(opt, QuantizedAdamW) and opt.moment_format(p, "m" if key == "exp_avg" else "v").name == "fp4"):
            flat = codes.reshape(-1)
            codes = torch.stack([flat >> 4, flat & 15], 1).reshape(-1)[: p.numel()]
        elif codes.is_floating_point():
            codes = codes.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[codes.element_size()])
        out[key] = codes.reshape(-1).clone()
    if p.dtype in (torch.bfloat16, torch.float16):  # the stored weight is measured too (its "weight" slot)
        out["weight"] = p.detach().reshape(-1).view(torch.int16).clone()
    return out


KINDS = ["bnb", "torch_bf16", "torchao", "torchao:AdamW4bit", "qadamw:fp8_e4m3", "qadamw:fp4", "qadamw:int8_dynamic",
         "qadamw:fp4/fp32", "qadamw:bf16/fp4"]  # per-moment formats: packed and plain rows in one batch


@pytest.mark.parametrize("widths", [[64, 64, 128], [64, 1280, 128]], ids=["scan", "per-slot"])
@pytest.mark.parametrize("kind", KINDS)
def test_exact_counts_equal_clone_and_compare_on_every_step(kind, widths, device):
    """Both counting paths: segments summed by one scan (small tensors) and counted slot by slot (>= 64K)."""
    if kind.startswith("torchao") and device.type == "cpu":
        pytest.importorskip("torchao")
    dtype = torch.bfloat16 if kind == "torch_bf16" else torch.float32
    model = layers(widths, device, dtype)  # a mean of 3K elements per parameter (scan), of 62K (slot by slot)
    opt = make_optimizer(kind, model.parameters(), **OPTIMIZER_OPTIONS)
    engine = StallEngine(adapter_for(opt), "opt0", exact=True, sample_size=4096, params_per_step=32,
                         coverage_steps=50, seed=0)
    g = torch.Generator(device="cpu").manual_seed(0)
    checked = 0
    for step in range(6):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(device=device, dtype=dtype)
        model[0].weight.grad[:3] = 0.0  # zero-gradient elements are not counted
        if step == 4 and kind != "bnb":  # bitsandbytes' CPU kernel corrupts a block with a NaN (README)
            model[1].weight.grad[0, 0] = float("nan")
        before = {p: state_codes(opt, p) for p in model.parameters() if opt.state[p]}
        engine.before_step(measure=True)
        opt.step()
        engine.after_step()
        window = engine.window()
        assert torch.equal(engine.window(), window)  # a readout: only reset_window() starts a new window
        engine.reset_window()
        rows = {e.key: row for e, row in zip(engine.entries.values(), window.tolist())}
        for entry in engine.entries.values():
            p = entry.slot.param
            if p not in before:
                continue
            raw_key = {"state1": "state1", "state2": "state2"}.get(entry.slot.key, entry.slot.key)
            mask = (torch.isfinite(p.grad) & (p.grad != 0)).reshape(-1)
            unchanged = (state_codes(opt, p)[raw_key] == before[p][raw_key]) & mask
            assert rows[entry.key][STALLED] == int(unchanged.sum()), (step, entry.key)
            assert rows[entry.key][COUNTED] == int(mask.sum()), (step, entry.key)
            checked += 1
    assert checked >= 4 * 4 * 2


def test_sample_mode_is_within_sampling_error_of_exact():
    model = layers([256, 512, 64], "cpu")
    import bitsandbytes as bnb

    opt = bnb.optim.AdamW8bit(model.parameters(), lr=LR)
    adapter = adapter_for(opt)
    exact = StallEngine(adapter, "opt0", True, 4096, 32, 50, 0)
    sample = StallEngine(adapter, "opt0", False, 1024, 32, 50, 0)
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        exact.before_step(True)
        sample.before_step(True)
        opt.step()
        exact.after_step()
        sample.after_step()
    e, s = exact.window(), sample.window()
    for entry, er, sr in zip(exact.entries.values(), e.tolist(), s.tolist()):
        fe, fs = er[STALLED] / er[COUNTED], sr[STALLED] / sr[COUNTED]
        n = min(1024, entry.slot.numel) * 39
        assert abs(fe - fs) <= 5 * math.sqrt(max(fe * (1 - fe), 1e-4) / n) + 1e-3, entry.key


class CountOps(TorchDispatchMode):
    """Counts the aten ops that run kernels (views and metadata-only ops excluded) and host read-backs."""

    FREE = {"view", "_unsafe_view", "slice", "as_strided", "alias", "reshape", "detach", "t", "expand", "select",
            "unsqueeze", "squeeze", "lift_fresh", "_to_copy_noop"}

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("_local_scalar_dense", "is_nonzero", "item"):
            self.syncs += 1
        elif name not in self.FREE:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def hooks_cost(tensors: int, kind: str, **options) -> tuple[int, int]:
    """(kernels, host reads) of the monitor's step hooks on a model with ``tensors`` parameter tensors, on a
    measured, non-logging step after the state exists: an optimizer step with the monitor attached minus the next
    step without it (the optimizer's own work is the same on both)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(tensors // 2)])
    opt = make_optimizer(kind, model.parameters(), **OPTIMIZER_OPTIONS)
    monitor = StaleStateMonitor(opt, params_per_step=8, coverage_steps=10_000, **options)
    warm = tensors // 8 + 3  # every cohort measured once: one-off grid estimates are behind us
    counters = []
    for step in range(warm + 2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape) * 1e-2
        if step < warm:
            opt.step()
            continue
        if step == warm + 1:
            monitor.close()
        with CountOps() as counter:
            opt.step()
        counters.append(counter)
    attached, detached = counters
    return attached.kernels - detached.kernels, attached.syncs - detached.syncs


@pytest.mark.parametrize("kind", ["bnb", "torch", "qadamw:int8_dynamic"])
@pytest.mark.parametrize("options", [{}, {"reset": "theory"}, {"reset": "periodic", "every": 1000}],
                         ids=["monitor", "theory", "periodic"])
def test_step_work_does_not_grow_with_the_number_of_tensors_and_never_syncs(kind, options):
    small = hooks_cost(16, kind, **options)
    large = hooks_cost(256, kind, **options)
    assert small[1] == large[1] == 0, "a host read-back on a non-logging step"
    assert small[0] == large[0], f"kernels per step: {small[0]} with 16 tensors, {large[0]} with 256"
    assert small[0] <= 70  # about 20 kernels per layout (here 8-bit weights, fp32 biases) and 10 for drift


def test_engine_tensors_live_on_the_state_device(device):
    import bitsandbytes as bnb

    model = layers([64, 256, 16], device)
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=256) if device.type == "cuda" else \
        QuantizedAdamW(model.parameters(), min_quantized_size=256)
    monitor = StaleStateMonitor(opt, remedy="auto", underflow_guard=True, coverage_steps=1)  # a check every step
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, device=device) * 1e-2
        opt.step()
    created = monitor.engines()[0].tensors()
    assert created and all(t.device == device for t in created)
    metrics = monitor.compute()
    assert 0.0 <= metrics["stale/v/frac"] <= 1.0
    monitor.close()
