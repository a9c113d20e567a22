"""The same checks on every device (``cpu`` always, ``cuda`` when present): a full Trainer fit with bitsandbytes
AdamW8bit and theory resets, every adapter's full and v-only reset, the underflow guard, and QuantizedAdamW eager and
compiled. On a GPU machine ``pytest -k cuda`` runs the CUDA half (``benchmarks/gpu_check.py`` does)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from helpers import Regression, make_optimizer, trainer_for
from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.act.guard import guard_underflow
from lightning_stale.adapters import adapter_for
from lightning_stale.optim import QuantizedAdamW

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def steps(model: nn.Module, opt, n: int, device) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randn(16, 64, generator=g).to(device)
        nn.functional.mse_loss(model(x), x[:, :16]).backward()
        opt.step()
        opt.zero_grad()


def test_trainer_fit_with_bitsandbytes_and_theory_resets(tmp_path, device):
    callback = StaleStateCallback(reset="theory", underflow_guard=True, warmup_steps=2)
    resets: list[int] = []
    callback.add_reset_listener(lambda event: resets.append(event.step))
    trainer = trainer_for(tmp_path, [callback], 30, accelerator=device.type, devices=1, logger=False,
                          log_every_n_steps=5)
    # 64 -> 256 -> 16, bitsandbytes 8-bit from 256 elements on; at b2 = 0.995 the 8-bit map's rho-hat is over 1
    model = Regression("bnb", in_features=64, out_features=16, betas=(0.9, 0.995), min_8bit_size=256)
    trainer.fit(model)
    assert trainer.global_step == 30 and all(torch.isfinite(p).all() for p in model.parameters())
    assert 0.0 <= float(trainer.callback_metrics["stale/v/frac"]) <= 1.0
    assert set(callback.reset_periods().values()) - {None}, "no parameter got a theory period"


KINDS = ["bnb", "torch", "qadamw:int8_dynamic", "qadamw:fp8_e4m3", "qadamw:fp4"] + (["torchao"] if HAS_TORCHAO else [])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("moments", [("m", "v"), ("v",)], ids=["full", "v-only"])
def test_resets_in_place_on_the_device(kind, moments, device):
    if kind == "torchao" and device.type == "cpu":
        pytest.skip("torchao's CPU step compiles for minutes; covered by tests/test_adapters_torchao.py")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16)).to(device)
    # bitsandbytes 8-bit from 256 elements on, QuantizedAdamW eager
    opt = make_optimizer(kind, model.parameters(), min_8bit_size=256, compile=False)
    steps(model, opt, 3, device)
    pointers = {k: v.data_ptr() for s in opt.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)}
    adapter = adapter_for(opt)
    adapter.reset(moments)
    for slot in adapter.slots():
        assert slot.codes().device.type == device.type
        if slot.moment in moments and moments == ("m", "v"):
            assert bool((slot.value() == 0).all()), slot.key
    after = {k: v.data_ptr() for s in opt.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)}
    assert after == pointers  # in place: nobody's references went stale
    steps(model, opt, 2, device)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_underflow_guard_on_the_device(device):
    model = nn.Linear(64, 256).to(device)
    opt = QuantizedAdamW(model.parameters(), state_format="fp8_e4m3", min_quantized_size=256)
    model.weight.grad = torch.zeros_like(model.weight)
    model.weight.grad[0, 0] = 1e3  # one huge element: the per-tensor fp8 scale flushes the others' v to zero
    model.weight.grad[1:] = 1e-2  # m stays representable, v = (1 - b2) g**2 flushes to zero
    model.bias.grad = torch.ones_like(model.bias)
    opt.step()
    zeroed = guard_underflow(adapter_for(opt).slots(), count=True)
    assert zeroed.device.type == device.type and int(zeroed) > 0


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_quantized_adamw_with_the_monitor(compile, device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16)).to(device)
    opt = QuantizedAdamW(model.parameters(), state_format="bf16", min_quantized_size=256, compile=compile)
    monitor = StaleStateMonitor(opt, track="exact", reset="periodic", every=3)
    steps(model, opt, 7, device)
    metrics = monitor.compute()
    assert 0.0 <= metrics["stale/v/frac"] <= 1.0 and monitor.reset_events == 2
    monitor.close()


WRITEBACK_OPTIMIZERS = {
    "torch_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, foreach=True),
    "torch_fused": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, fused=True),
    "bnb_8bit": lambda p: make_optimizer("bnb", p, lr=1e-3, min_8bit_size=256),
    "quantized_fp8": lambda p: QuantizedAdamW(p, lr=1e-3, state_format="fp8_e4m3"),
}


@pytest.mark.parametrize("name", sorted(WRITEBACK_OPTIMIZERS))
@pytest.mark.parametrize("weights", ["stochastic", "compensated"])
def test_weight_writeback_on_the_device(name, weights, device):
    """The write-back on bf16 weights on the device: weights, states and buffers stay there, updates stay near lr,
    and (CUDA) a step with torch's foreach AdamW waits on the device nowhere (sync debug mode raises on a sync)."""
    from lightning_stale.act.writeback import WeightWriteBack

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 16)).to(device, torch.bfloat16)
    opt = WRITEBACK_OPTIMIZERS[name](list(model.parameters()))
    moments = "stochastic" if name.startswith("torch") else "nearest"
    writeback = WeightWriteBack(opt, weights, moments=moments)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(16, 64, generator=g).to(device, torch.bfloat16) for _ in range(6)]
    for i, x in enumerate(batches):
        nn.functional.mse_loss(model(x).float(), x[:, :16].float()).backward()
        before = [p.detach().float().clone() for p in model.parameters()]
        checked = device.type == "cuda" and name == "torch_foreach" and i >= 2  # after compiling, on a warm cache
        if checked:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            if checked:
                torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
        worst = max(float((p.detach().float() - b).abs().max()) for p, b in zip(model.parameters(), before))
        assert worst <= 10 * 1e-3 * (1 + 0.1), (name, weights, i, worst)
    held = [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor) and t.dim()]
    assert held and all(t.device.type == device.type for t in held)  # the compensation buffers among them
    assert (writeback.buffer_bytes() > 0) == (weights == "compensated")
    assert all(torch.isfinite(p).all() and p.dtype == torch.bfloat16 for p in model.parameters())
    writeback.close()
