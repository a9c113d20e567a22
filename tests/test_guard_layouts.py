"""The underflow guard's one pass on every built-in slot layout (issue 23): fp8 states (one scale per tensor, blocks
of 256) and packed 4-bit states take the planned pass instead of the eager masks and write exactly what the masks
write, -0 and empty blocks included; and an m that already reads as zero keeps its bits, so a reset followed by the
post-reset guard holds what a fresh optimizer holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_stale.act import guard
from lightning_stale.act.guard import GuardPlan
from lightning_stale.adapters import adapter_for
from lightning_stale.adapters.protocol import Slot
from lightning_stale.optim import QuantizedAdamW

LARGE, SMALL = (256, 300), (64, 100)  # 76,800 elements: guarded in place, compiled where a compiler exists; 6,400


def _grads(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    """Gradients spanning ten decades with random signs, one huge element each: a per-tensor fp8 scale then flushes
    most of v (and some of m, as +0 or -0) to zero."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        n = torch.Size(shape).numel()
        g = torch.randn(n, generator=gen).sign() * torch.logspace(-6, 2, n)[torch.randperm(n, generator=gen)]
        g[n // 2] = 1e4
        out.append(g.view(shape))
    return out


def _qadamw_fp8() -> list[Slot]:
    params = [nn.Parameter(torch.zeros(shape)) for shape in (LARGE, SMALL)]
    opt = QuantizedAdamW(params, lr=1e-3, state_format="fp8_e4m3", min_quantized_size=256, compile=False)
    for step in range(2):
        for p, g in zip(params, _grads([LARGE, SMALL], step)):
            p.grad = g
        opt.step()
    return adapter_for(opt).slots()


def _torchao_fp8() -> list[Slot]:
    """torchao's own fp8 buffers (blocks of 256), filled by their eager ``copy_`` (no compiled optimizer step)."""
    pytest.importorskip("torchao.optim")
    from torchao.optim.subclass_fp8 import OptimStateFp8

    from lightning_stale.adapters.torchao import buffer_slot

    slots = []
    for shape, g in zip((LARGE, SMALL), _grads([LARGE, SMALL], 0)):
        p = nn.Parameter(torch.zeros(shape))
        for moment, value in (("m", 0.1 * g), ("v", 1e-3 * g.square())):
            buf = OptimStateFp8.zeros(p.shape, block_size=256)
            buf.copy_(value)
            slots.append(buffer_slot(p, buf, "exp_avg_sq" if moment == "v" else "exp_avg", moment, 0.9))
    slots[1].scale[5] = 0.0  # an empty v block reads as zero whatever its codes
    return slots


def _fp8_codes(slot: Slot) -> torch.Tensor:
    return slot.stored.view(torch.uint8).view(-1)


def _guarded_twice(make) -> tuple[list[torch.Tensor], list[torch.Tensor], int, GuardPlan]:
    """The m codes after the masked (counting) path and after the planned pass, on twin states; hazards counted."""
    results, hazards, plan = [], 0, None
    for count in (True, False):
        slots = make()
        for s in slots:
            if s.moment == "v":  # fp8 v is never stored as -0 by these optimizers, but -0 is a zero all the same
                _fp8_codes(s)[1::97] = 0x80
        plan = GuardPlan(slots)
        zeroed = plan.run(count=count)
        hazards = hazards if zeroed is None else int(zeroed)
        results.append([s.codes().clone() for s in slots if s.moment == "m"])
    return results[0], results[1], hazards, plan


@pytest.mark.parametrize("make", [_qadamw_fp8, _torchao_fp8], ids=["qadamw-per-tensor", "torchao-blocks"])
def test_fp8_states_take_the_one_pass_and_it_writes_what_the_masks_write(make):
    masked, fused, hazards, plan = _guarded_twice(make)
    assert plan._masked == [] and plan._calls, "fp8 pairs must take the planned pass, not the eager masks"
    assert hazards > 1000
    assert all(torch.equal(a, b) for a, b in zip(masked, fused))
    assert any(bool((codes == 0x80).any()) for codes in fused), "m kept no -0: the case is not exercised"
    assert not guard._fused_failed


def _small_state(kind: str) -> list[Slot]:
    """A stepped optimizer of ``kind`` with a 6,400-element and a 5,000-element parameter (a partial last block)
    whose gradients have zero blocks, and v zeros injected; small, so the pass runs eagerly."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if kind == "torch-bf16" else torch.float32
    params = [nn.Parameter(torch.randn(shape).to(dtype)) for shape in (SMALL, (5000,))]
    if kind == "bnb":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(params, lr=1e-3)
    elif kind.startswith("torchao"):
        pytest.importorskip("torchao.optim")
        from torchao.optim import AdamW4bit, AdamW8bit

        params = [nn.Parameter(torch.randn(shape)) for shape in ((64, 128), (4096,))]  # torchao: whole blocks
        opt = (AdamW4bit if kind == "torchao-4bit" else AdamW8bit)(params, lr=1e-3)
    elif kind.startswith("qadamw"):
        opt = QuantizedAdamW(params, lr=1e-3, state_format=kind.split(":")[1], min_quantized_size=256, compile=False)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape).to(p.dtype)
        p.grad.view(-1)[:512] = 0
    if kind.startswith("torchao"):  # its buffers as its step creates them, filled by their copy_ (the compiled step
        for p in params:  # takes long to build)
            state = opt.state[p]
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = opt._new_buffer(p, True)
            state["exp_avg_sq"] = opt._new_buffer(p, False)
            state["exp_avg"].copy_(p.grad * 0.1)
            state["exp_avg_sq"].copy_(p.grad.square() * 1e-3)
    else:
        opt.step()
    slots = adapter_for(opt).slots()
    gen = torch.Generator().manual_seed(1)
    for s in slots:
        if s.moment == "v":
            s.zero_elements(torch.rand(s.numel, generator=gen) < 0.1)
    return slots


@pytest.mark.parametrize("kind", ["bnb", "torchao-8bit", "torchao-4bit", "qadamw:int8_dynamic", "qadamw:fp4",
                                  "qadamw:bf16", "torch-fp32", "torch-bf16"])
def test_every_built_in_layout_takes_the_one_pass_and_it_writes_what_the_masks_write(kind):
    masked_slots, fused_slots = _small_state(kind), _small_state(kind)
    GuardPlan(masked_slots).run(count=True)
    plan = GuardPlan(fused_slots)
    plan.run()
    assert plan._masked == []
    for a, b in zip(masked_slots, fused_slots):
        assert torch.equal(a.codes(), b.codes()), f"{kind} {a.key}"


def test_a_reset_then_guarded_steps_hold_what_a_fresh_bitsandbytes_optimizer_holds():
    """A full reset is exact (docs/adapters.md), and the reset parameters then run under the guard for 30 steps.
    bitsandbytes stores m's code 0 (-0.99 x 0) in a block whose absmax is 0, a block of zero gradients: the guard must
    leave it, not write the zero code (127) there, or the state is no longer what a fresh optimizer holds."""
    import bitsandbytes as bnb

    from lightning_stale import StaleStateMonitor

    shapes = [LARGE, SMALL, (5000,)]  # in place (compiled), small, and small with a partial last block
    gen = torch.Generator().manual_seed(0)

    def grads() -> list[torch.Tensor]:
        out = [torch.randn(shape, generator=gen) for shape in shapes]
        for g in out:
            g.view(-1)[:512] = 0  # two zero blocks
            g.view(-1)[-100:] = 0
        return out

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape in shapes]
    opt = bnb.optim.AdamW8bit(params, lr=1e-3)
    every = 4  # resets after steps 4 and 8: steps 5 to 7 run inside the post-reset guard window
    with StaleStateMonitor(opt, reset="periodic", every=every):
        for _ in range(every):  # the reset runs after the last of these steps
            for p, g in zip(params, grads()):
                p.grad = g
            opt.step()
        assert all(opt.state[p]["step"] == 0 for p in params)
        twins = [nn.Parameter(p.detach().clone()) for p in params]
        fresh = bnb.optim.AdamW8bit(twins, lr=1e-3)
        for _ in range(every - 1):
            for p, twin, g in zip(params, twins, grads()):
                p.grad, twin.grad = g, g.clone()
            opt.step()
            fresh.step()
    assert any(bool((fresh.state[t]["absmax1"] == 0).any()) for t in twins), "no empty block: the case is not exercised"
    for p, twin in zip(params, twins):
        assert torch.equal(p, twin)
        for key in ("state1", "state2", "absmax1", "absmax2"):
            assert torch.equal(opt.state[p][key], fresh.state[twin][key]), key
