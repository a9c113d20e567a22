"""Conformance and behaviour of :class:`lightning_stale.act.weights.WeightWriteBack` on small real models (CPU)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from lightning_stale.act import weights as weights_module
from lightning_stale.act.weights import WeightWriteBack, _counters, _Entry, _fused_write, _hash, noise_bits, \
    stochastic_round
from lightning_stale.optim import QuantizedAdamW

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes")

LR = 1e-2
KW = dict(lr=LR, weight_decay=0.1)
warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")

# name -> (optimizer factory, measured per-step tolerance: (largest share of differing weights, max |diff| / lr)).
# (0, 0) means bit for bit. Measured on this model over 8 steps, each from the optimizer's own state (CPU, torch 2.13,
# bitsandbytes 0.50.2); the bounds below are about 1.5x the measured worst case.
FAMILIES = {
    # bf16 arithmetic (decay, sqrt, division rounded to bf16): measured 30% of weights differ, by <= 0.098 lr.
    "torch_adamw_forloop": (lambda p: torch.optim.AdamW(p, **KW, foreach=False), (0.45, 0.15)),
    "torch_adamw_foreach": (lambda p: torch.optim.AdamW(p, **KW, foreach=True), (0.45, 0.15)),
    # fp32 arithmetic from the unrounded fp32 moments, which it stores as bf16: measured 7.1%, 0.098 lr.
    "torch_adamw_fused": (lambda p: torch.optim.AdamW(p, **KW, fused=True), (0.11, 0.15)),
    # L2 weight decay inside the moments, bf16 arithmetic: measured 23%, 0.049 lr.
    "torch_adam_forloop": (lambda p: torch.optim.Adam(p, **KW, foreach=False), (0.35, 0.15)),
    # maximize: the sign is inside the moments, the write is unchanged: measured 23%, 0.098 lr.
    "torch_adam_maximize": (lambda p: torch.optim.Adam(p, **KW, foreach=False, maximize=True), (0.35, 0.15)),
    # fp32 states, fp32 arithmetic: the write-back is the optimizer's own op sequence.
    "bnb_adamw_32bit": (lambda p: bnb.optim.AdamW(p, **KW, optim_bits=32), (0.0, 0.0)),
    "bnb_adam_32bit": (lambda p: bnb.optim.Adam32bit(p, **KW), (0.0, 0.0)),
    # 8-bit: written ahead of its update from the fp32 moments it computes before requantizing them: bit for bit.
    "bnb_adamw_8bit": (lambda p: bnb.optim.AdamW8bit(p, **KW, min_8bit_size=256), (0.0, 0.0)),
    "bnb_paged_adamw_8bit": (lambda p: bnb.optim.PagedAdamW8bit(p, **KW, min_8bit_size=256), (0.0, 0.0)),
    "quantized_fp32": (lambda p: QuantizedAdamW(p, **KW, state_format="fp32"), (0.0, 0.0)),
    # QuantizedAdamW updates from the unrounded moments: bf16 measured 7.1%, 0.098 lr; int8 35%, 0.34 lr.
    "quantized_bf16": (lambda p: QuantizedAdamW(p, **KW, state_format="bf16", min_quantized_size=0), (0.11, 0.15)),
    "quantized_int8": (lambda p: QuantizedAdamW(p, **KW, min_quantized_size=256), (0.5, 0.5)),
}


def _model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8)).to(dtype)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)


def _twin(model, opt, make):
    """An independent copy of (model, optimizer) with the same weights and state."""
    twin = copy.deepcopy(model)
    twin_opt = make(twin.parameters())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return twin, twin_opt


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_nearest_reproduces_the_optimizer(name):
    make, (max_share, max_lr_units) = FAMILIES[name]
    model = _model()
    opt = make(model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):  # each step: the optimizer's own step against the write-back from the same state
        x = torch.randn(32, 64, generator=gen).bfloat16()
        twin, twin_opt = _twin(model, opt, make)
        writeback = WeightWriteBack(twin_opt, "nearest")
        _step(model, opt, x)
        _step(twin, twin_opt, x)
        writeback.close()
        diffs = torch.cat([(a.float() - b.float()).abs().flatten() for a, b in zip(model.parameters(),
                                                                                  twin.parameters())])
        assert (diffs > 0).float().mean().item() <= max_share
        assert diffs.max().item() <= max_lr_units * LR
        if max_share == 0.0:
            for key, value in opt.state_dict()["state"][0].items():  # the optimizer's state is unaffected
                if isinstance(value, (torch.Tensor, int, float)):
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(twin_opt.state_dict()["state"][0][key]))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bnb_8bit_written_ahead_without_a_closure(rounding):
    """A plain loop (backward, then ``step()`` without a closure): bitsandbytes' 8-bit weights are still written from
    this step's fp32 moments before its update, and its codes are what its own step writes. Nearest: its weights bit
    for bit; stochastic: within a bf16 gap of them."""
    make = FAMILIES["bnb_adamw_8bit"][0]
    model = _model()
    opt = make(model.parameters())
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randn(32, 64, generator=gen).bfloat16()
        twin, twin_opt = _twin(model, opt, make)
        writeback = WeightWriteBack(twin_opt, rounding)
        for net, optimizer in ((model, opt), (twin, twin_opt)):
            optimizer.zero_grad()
            net(x).float().pow(2).mean().backward()
            optimizer.step()
        writeback.close()
        for a, b in zip(model.parameters(), twin.parameters()):
            gap = torch.where(a == 0, 2.0**-133, a.float().abs() * 2.0**-7)
            assert torch.equal(a, b) if rounding == "nearest" else bool(((a.float() - b.float()).abs() <= gap).all())
        for key in ("state1", "state2", "absmax1", "absmax2"):
            assert torch.equal(opt.state[next(iter(model.parameters()))][key],
                               twin_opt.state[next(iter(twin.parameters()))][key])
        model.load_state_dict(twin.state_dict())  # both go on from the write-back's weights
        opt.load_state_dict(twin_opt.state_dict())


def test_lr_restored_after_a_raising_closure_and_outside_steps():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    writeback = WeightWriteBack(opt, "stochastic")
    seen = []

    def closure():
        seen.append(opt.param_groups[0]["lr"])
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        opt.step(closure)
    assert seen == [0.0]  # suppressed during the step
    assert opt.param_groups[0]["lr"] == LR  # restored after the exception
    _step(model, opt, torch.randn(4, 64).bfloat16())
    assert opt.param_groups[0]["lr"] == LR
    writeback.close()


def test_lr_restored_after_an_error_in_the_optimizers_own_update():
    """The closure returns, then torch's update raises (a sparse gradient): no post-step hook runs, and the group's
    real lr is back before the error reaches the caller (schedulers and checkpoints in an ``except`` see it)."""
    model = _model()
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([*model.parameters(), extra], lr=LR)
    writeback = WeightWriteBack(opt, "stochastic")
    _step(model, opt, torch.randn(4, 64).bfloat16())
    extra.grad = torch.zeros(3, dtype=torch.bfloat16).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert opt.param_groups[0]["lr"] == LR
    writeback.close()
    assert "step" not in opt.__dict__  # the instance-level wrapper is gone


def test_the_error_hook_keeps_schedulers_built_before_and_after_it_working():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    before = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    writeback = WeightWriteBack(opt, "stochastic")
    after = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=1.0)  # wraps the write-back's step in turn
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither "overridden after initialization" nor "step before optimizer.step"
        for _ in range(3):
            _step(model, opt, torch.randn(4, 64).bfloat16())
            before.step()
            after.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** 3)
    writeback.close()
    _step(model, opt, torch.randn(4, 64).bfloat16())  # a pass-through now, under the later scheduler's wrapper
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** 3)


def test_skipped_step_leaves_weights_untouched():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _step(model, opt, torch.randn(4, 64).bfloat16())
    writeback = WeightWriteBack(opt, "compensated")
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()  # no gradients: the optimizer skips every parameter, its step counters do not advance
    opt.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    assert writeback.resident_bytes() == 0
    writeback.close()


def test_stochastic_rounding_is_unbiased_and_keyed_not_random():
    value = torch.full((200_000,), 1.0 + 1e-3)  # between bf16 1.0 and 1.0078125
    noise = noise_bits(value.numel(), seed=3, step=7, index=2, device=value.device)
    rounded = stochastic_round(value, torch.bfloat16, noise).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0078125}
    assert abs(rounded.mean().item() - (1.0 + 1e-3)) < 2e-5
    half = stochastic_round(value, torch.float16, noise).float()
    assert abs(half.mean().item() - (1.0 + 1e-3)) < 2e-5
    state = torch.random.get_rng_state()
    assert torch.equal(noise, noise_bits(value.numel(), 3, 7, 2, value.device))
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is never used
    assert not torch.equal(noise, noise_bits(value.numel(), 3, 8, 2, value.device))


def test_batched_noise_is_each_parameters_own():
    """One hash over several parameters' ranges laid end to end draws, for each element, what ``noise_bits`` draws
    for it alone."""
    entries = [_Entry(index, torch.empty(n), None, True, "addcdiv", 1.0, 0.0, 1.0, 0.0, step)
               for index, n, step in ((0, 5000, 7), (3, 70_000, 7), (4, 300, 8))]
    batch = [(entries[0], 0, 5000), (entries[1], 1000, 70_000), (entries[2], 0, 300)]
    bits = _hash(_counters(batch, 5, torch.device("cpu")))
    alone = torch.cat([noise_bits(b - a, 5, e.step, e.index, torch.device("cpu"), a) for e, a, b in batch])
    assert torch.equal(bits & 0xFFFF, alone)


@pytest.mark.skipif(not weights_module._compat.compiler_available(), reason="torch.compile needs a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_write_equals_the_eager_one_bit_for_bit(dtype):
    """The fused write-back (torch.compile) and its eager fallback give the same bits: weights, moments, noise."""
    gen = torch.Generator().manual_seed(0)
    n = weights_module.COMPILE_MIN_NUMEL + 77
    w, m, g = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen) * 1e-3
    counter = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
    hyper = torch.tensor([0.1, 0.999, 0.001, -1.0, 0.01, 0.9999, 1.0, 0.3, 1e-8, -1e-3, 2.0])
    for args in ((g, counter, True, True), (None, counter, True, False), (g, None, False, False)):
        eager = _fused_write(w, m, v, args[0], args[1], hyper, dtype, *args[2:])
        fused = weights_module._compiled_fused_write()(w, m, v, args[0], args[1], hyper, dtype, *args[2:])
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(eager, fused))


def test_same_seed_same_weights_like_replicated_ranks():
    weights = []
    for _ in range(2):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        writeback = WeightWriteBack(opt, "stochastic", seed=5)
        torch.manual_seed(123 + len(weights))  # the global RNG differs between the two "ranks"
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            _step(model, opt, torch.randn(8, 64, generator=gen).bfloat16())
        writeback.close()
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*weights):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rounding,moves", [("nearest", False), ("compensated", True), ("stochastic", True)])
def test_small_updates_move_only_with_stochastic_or_compensated(rounding, moves):
    weight = torch.nn.Parameter(torch.ones(1024, dtype=torch.bfloat16))
    # fp32 moments, so that Adam's update is lr per step (bf16 moments would stall too), far below the half-gap
    # 1/512 of bf16 just below 1.0.
    opt = QuantizedAdamW([weight], lr=1e-4, weight_decay=0.0, eps=1e-12, state_format="fp32")
    writeback = WeightWriteBack(opt, rounding)
    for _ in range(100):
        weight.grad = torch.ones_like(weight)
        opt.step()
    mean = weight.float().mean().item()
    if rounding == "compensated":  # the stored weight is within half a gap; with its residual it is 0.99
        assert abs(mean - 0.99) <= 2.0**-9
        assert abs((weight.float() + writeback.compensation[0].float()).mean().item() - 0.99) < 1e-4
    elif moves:  # unbiased on average over the 1024 elements
        assert abs(mean - 0.99) < 1e-3
    else:
        assert mean == 1.0
    writeback.close()


def test_compensation_state_dict_round_trip_is_bit_exact():
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(16, 64, generator=gen).bfloat16() for _ in range(6)]
    make = FAMILIES["bnb_adamw_8bit"][0]
    model = _model()
    opt = make(model.parameters())
    writeback = WeightWriteBack(opt, "compensated")
    for x in inputs[:3]:
        _step(model, opt, x)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "wb": writeback.state_dict()})
    assert writeback.resident_bytes() == 2 * sum(p.numel() for p in model.parameters())
    for x in inputs[3:]:
        _step(model, opt, x)
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    resumed_opt = make(resumed.parameters())
    resumed_opt.load_state_dict(saved["opt"])
    resumed_writeback = WeightWriteBack(resumed_opt, "compensated")
    resumed_writeback.load_state_dict(saved["wb"])
    for x in inputs[3:]:
        _step(resumed, resumed_opt, x)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for i, buffer in writeback.compensation.items():
        assert torch.equal(buffer, resumed_writeback.compensation[i])


def test_fp32_parameters_untouched_and_bit_identical():
    gen = torch.Generator().manual_seed(4)
    inputs = [torch.randn(8, 64, generator=gen) for _ in range(3)]
    runs = []
    for attach in (False, True):
        model = _model(torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        writeback = WeightWriteBack(opt, "compensated") if attach else None
        for x in inputs:
            _step(model, opt, x)
        runs.append([p.detach().clone() for p in model.parameters()])
        if writeback is not None:
            assert writeback.resident_bytes() == 0
            writeback.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_update_size_stays_near_lr():
    """Largest |fp32 update| / lr of the write-back's own target (nearest: the rounding adds at most half a gap)."""
    model = _model()
    opt = QuantizedAdamW(model.parameters(), lr=LR, weight_decay=0.0, min_quantized_size=256)
    writeback = WeightWriteBack(opt, "nearest")
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for _ in range(8):
        before = [p.detach().float() for p in model.parameters()]
        _step(model, opt, torch.randn(32, 64, generator=gen).bfloat16())
        for b, p in zip(before, model.parameters()):
            half_gap = torch.where(b == 0, 0.0, b.abs() * 2.0**-8)  # at most half a bf16 gap of rounding
            worst = max(worst, ((p.float() - b).abs() - half_gap).max().item() / LR)
    assert worst < 1.5  # measured: about 1.0 (the first step of Adam is lr * sign(g))
    writeback.close()


@pytest.mark.parametrize("make,match", [
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "SGD"),
    (lambda p: bnb.optim.Lion8bit(p), "Lion8bit"),
    (lambda p: torch.optim.Adam(p, capturable=True), "capturable"),
])
def test_refuses_unsupported(make, match):
    with pytest.raises(ValueError, match=match):
        WeightWriteBack(make(_model().parameters()))


@pytest.mark.parametrize("name,rounding,moments", [
    *((name, rounding, "optimizer") for name in ("torch_adamw_foreach", "bnb_adamw_8bit", "quantized_int8")
      for rounding in ("stochastic", "compensated")),
    ("torch_adamw_foreach", "stochastic", "stochastic"),
    ("torch_adamw_foreach", "compensated", "stochastic"),
])
def test_chunked_writes_equal_whole_writes(name, rounding, moments, monkeypatch):
    """Written in chunks of 1,000 elements (bnb blocks and parameters cut mid-way) the weights (and moments the
    write-back computes) are bit-identical to one whole pass: the transient memory is bounded by the chunk, not by
    the largest tensor."""
    make = FAMILIES[name][0]
    results = []
    for chunk in (weights_module.CHUNK_ELEMENTS, 1000):
        monkeypatch.setattr(weights_module, "CPU_CHUNK_ELEMENTS", chunk)
        model = _model()
        opt = make(model.parameters())
        writeback = WeightWriteBack(opt, rounding, seed=5, moments=moments)
        gen = torch.Generator().manual_seed(2)
        for _ in range(4):
            _step(model, opt, torch.randn(32, 64, generator=gen).bfloat16())
        writeback.close()
        results.append([p.detach().clone() for p in model.parameters()]
                       + [t for p in model.parameters() for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
                       + list(writeback.compensation.values()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


# -- the write-back computing torch.optim's bf16 moments (moments="stochastic"/"nearest") ------------------------------
TORCH_KINDS = {  # torch's fused form computes the moments in fp32 and rounds them once: the reference
    "adamw": lambda p, **kw: torch.optim.AdamW(p, **KW, **kw),
    "adam_l2": lambda p, **kw: torch.optim.Adam(p, **KW, **kw),
    "adam_maximize": lambda p, **kw: torch.optim.Adam(p, **KW, maximize=True, **kw),
}


@pytest.mark.parametrize("kind", sorted(TORCH_KINDS))
def test_nearest_moments_reproduce_torchs_fp32_moments(kind):
    """With nearest rounding of weights and moments, each step from torch's own state stores the moments torch's fused
    AdamW stores and advances its step counter. torch's lerp is a fused multiply-add, the write-back's a product and
    a sum: measured, 0.03% of m and 0.01% of v elements differ, by one bf16 ulp or where a sum cancels to 0 (1e-11
    against 0). The weights differ from fused's in the last bits of the update (measured: up to 21%, by <= 0.049 lr)."""
    make = TORCH_KINDS[kind]
    model = _model()
    opt = make(model.parameters(), fused=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(32, 64, generator=gen).bfloat16()
        twin, twin_opt = _twin(model, opt, lambda p: make(p, foreach=False))
        writeback = WeightWriteBack(twin_opt, "nearest", moments="nearest")
        _step(model, opt, x)
        _step(twin, twin_opt, x)
        writeback.close()
        for key in ("exp_avg", "exp_avg_sq"):
            ours, theirs = (torch.cat([o.state[p][key].float().flatten() for p in m.parameters()])
                            for o, m in ((twin_opt, twin), (opt, model)))
            diff = (ours - theirs).abs()
            assert (diff <= torch.maximum(ours.abs(), theirs.abs()) * 2.0**-7 + 1e-10).all()
            assert (diff > 0).float().mean().item() <= 1e-3
        for a, b in zip(model.parameters(), twin.parameters()):
            assert float(twin_opt.state[b]["step"]) == float(opt.state[a]["step"])
            assert b.grad is not None  # given back after the step
        diffs = torch.cat([(a.float() - b.float()).abs().flatten() for a, b in zip(model.parameters(),
                                                                                  twin.parameters())])
        assert (diffs > 0).float().mean().item() <= 0.3
        assert diffs.max().item() <= 0.1 * LR


@pytest.mark.parametrize("flags", [{"foreach": True}, {"fused": True}])
def test_owned_moments_do_not_depend_on_torchs_implementation(flags):
    """Torch's step skips the parameters whose step the write-back owns: for-loop, foreach and fused AdamW end with the
    same weights and state, bit for bit."""
    runs = []
    for kw in ({"foreach": False}, flags):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), **KW, **kw)
        writeback = WeightWriteBack(opt, "stochastic", moments="stochastic", seed=2)
        gen = torch.Generator().manual_seed(3)
        for _ in range(5):
            _step(model, opt, torch.randn(16, 64, generator=gen).bfloat16())
        writeback.close()
        runs.append((list(model.parameters()), opt))
    (params_a, opt_a), (params_b, opt_b) = runs
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a.state[a][key].cpu(), opt_b.state[b][key].cpu())


def test_stochastic_moments_track_the_fp32_average_where_bf16_stalls():
    """After one gradient of 1, a zero gradient for 300 steps: bf16 ``v * 0.999`` rounds back to v (torch's v stays
    put), stochastic rounding decays it as fp32 does, on average over the elements."""
    results = {}
    for moments in ("optimizer", "stochastic"):
        weight = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
        opt = torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.0)
        writeback = WeightWriteBack(opt, "stochastic", moments=moments)
        for step in range(301):
            weight.grad = torch.full_like(weight, 1.0 if step == 0 else 0.0)
            opt.step()
        writeback.close()
        results[moments] = opt.state[weight]["exp_avg_sq"].float().mean().item()
    fp32 = 1e-3 * 0.999**300
    assert results["optimizer"] == pytest.approx(torch.tensor(1e-3).bfloat16().item())  # stalled
    assert results["stochastic"] == pytest.approx(fp32, rel=5e-3)


@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
def test_owned_moments_resume_bit_exactly_and_agree_across_ranks(rounding):
    """The moments' noise is keyed by seed, step and parameter: a run resumed from the optimizer's state and the
    write-back's (compensation buffers, where it keeps them) and a second "rank" with another global RNG state end
    bit-identical."""
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(16, 64, generator=gen).bfloat16() for _ in range(6)]
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **KW)
    writeback = WeightWriteBack(opt, rounding, moments="stochastic", seed=4)
    for x in inputs[:3]:
        _step(model, opt, x)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "wb": writeback.state_dict()})
    for x in inputs[3:]:
        _step(model, opt, x)
    writeback.close()
    torch.manual_seed(99)
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), **KW)
    resumed_opt.load_state_dict(saved["opt"])
    resumed_writeback = WeightWriteBack(resumed_opt, rounding, moments="stochastic", seed=0)
    resumed_writeback.load_state_dict(saved["wb"])
    for x in inputs[3:]:
        _step(resumed, resumed_opt, x)
    resumed_writeback.close()
    assert len(writeback.compensation) == (len(list(model.parameters())) if rounding == "compensated" else 0)
    for i, (a, b) in enumerate(zip(model.parameters(), resumed.parameters())):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], resumed_opt.state[b]["exp_avg_sq"])
        if rounding == "compensated":
            assert torch.equal(writeback.compensation[i], resumed_writeback.compensation[i])


def test_owned_moments_hooks_give_back_gradients_and_lr():
    """Other step hooks, registered before the write-back or after it, see the gradients (hidden from torch only
    inside its update) and the weights the write-back wrote, with a closure and without; a raising closure hides
    nothing; an error inside torch's own update (after the closure) gives the gradients and the lr back at once."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    seen = []
    opt.register_step_post_hook(lambda *_: seen.append([(p.grad is not None, p.detach().clone())
                                                        for p in model.parameters()]))
    writeback = WeightWriteBack(opt, "stochastic", moments="stochastic")
    opt.register_step_pre_hook(lambda *_: seen.append(all(p.grad is not None for p in model.parameters())))
    _step(model, opt, torch.randn(4, 64).bfloat16())  # the first step initializes torch's state: torch's own moments
    model(torch.randn(4, 64).bfloat16()).float().sum().backward()
    grads = [p.grad for p in model.parameters()]
    opt.step()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert seen[-2] is True and all(has and torch.equal(w, p) for (has, w), p in zip(seen[-1], model.parameters()))

    def raising():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        opt.step(raising)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads)) and opt.param_groups[0]["lr"] == LR

    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.zeros(3, dtype=torch.bfloat16).to_sparse()  # torch's Adam refuses it after our hook ran
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step(lambda: None)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads)) and opt.param_groups[0]["lr"] == LR
    writeback.close()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads)) and opt.param_groups[0]["lr"] == LR


def test_owned_moments_leave_skipped_steps_and_gradscaler_steps_to_the_optimizer():
    """No gradient: nothing moves. A step that GradScaler hands its scale and verdict (the ``grad_scale`` and
    ``found_inf`` attributes it sets on a fused optimizer) leaves the moments to the optimizer: skipped whole on inf,
    else the weight-only write-back's step, bit for bit."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _step(model, opt, torch.randn(4, 64).bfloat16())
    writeback = WeightWriteBack(opt, "stochastic", moments="stochastic")
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(float(opt.state[p]["step"]) == 1.0 for p in model.parameters())
    writeback.close()

    runs = []
    for moments in ("optimizer", "stochastic"):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        gen = torch.Generator().manual_seed(6)
        _step(model, opt, torch.randn(4, 64, generator=gen).bfloat16())
        writeback = WeightWriteBack(opt, "stochastic", moments=moments)
        for found_inf in (1.0, 0.0):
            opt.grad_scale, opt.found_inf = torch.ones(()), torch.tensor(found_inf)
            before = [p.detach().clone() for p in model.parameters()]
            _step(model, opt, torch.randn(4, 64, generator=gen).bfloat16())
            del opt.grad_scale, opt.found_inf
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) == bool(found_inf)
        writeback.close()
        runs.append([*model.parameters(), *(opt.state[p]["exp_avg_sq"] for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_owned_moments_keep_the_update_near_lr_where_gradients_vanish():
    """Largest |fp32 update| / lr with stochastically rounded moments, rows of an embedding without gradient for
    most steps included (their m and v decay; v rounded to 0 beside a non-zero m would give an m / eps step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 8)).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    writeback = WeightWriteBack(opt, "nearest", moments="stochastic")
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for step in range(60):
        tokens = torch.randint(0, 64 if step < 5 else 4, (16,), generator=gen)  # most rows stop getting gradient
        before = [p.detach().float() for p in model.parameters()]
        opt.zero_grad()
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        for b, p in zip(before, model.parameters()):
            half_gap = torch.where(b == 0, 0.0, b.abs() * 2.0**-8)
            worst = max(worst, ((p.float() - b).abs() - half_gap).max().item() / LR)
    assert worst < 1.5  # measured: 1.0
    writeback.close()


@pytest.mark.parametrize("make", [FAMILIES["bnb_adamw_8bit"][0], FAMILIES["quantized_bf16"][0]])
def test_moments_only_for_torch_optim(make):
    with pytest.raises(ValueError, match="torch.optim Adam/AdamW only"):
        WeightWriteBack(make(_model().parameters()), moments="stochastic")


class _Mixed(torch.nn.Module):
    """One group of three parameters: a bf16 matrix, a bf16 bias and an fp32 gain."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(64, 96).mul(0.1).bfloat16())
        self.bias = torch.nn.Parameter(torch.randn(96).mul(0.1).bfloat16())
        self.gain = torch.nn.Parameter(torch.ones(96))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.bfloat16() @ self.weight + self.bias).float() * self.gain


@pytest.mark.parametrize("name", ["torch_adamw_forloop", "torch_adamw_foreach", "bnb_adamw_32bit", "bnb_adamw_8bit",
                                  "quantized_fp32"])
def test_a_partial_take_over_writes_every_other_parameter_of_its_groups(name):
    """The group's lr is 0 during the step for every parameter in it: a write-back that takes over only the matrix
    (what the automatic remedy does) must still write the bias and the fp32 gain, as the optimizer would (they
    were left where they were, frozen for the run)."""
    make, (max_share, max_lr_units) = FAMILIES[name]
    model = _Mixed()
    opt = make(model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(32, 64, generator=gen)
        twin, twin_opt = _twin(model, opt, make)
        writeback = WeightWriteBack(twin_opt, "stochastic", params=[twin.weight])
        before = [p.detach().clone() for p in twin.parameters()]
        _step(model, opt, x)
        _step(twin, twin_opt, x)
        writeback.close()
        assert all(not torch.equal(a, b) for a, b in zip(before, twin.parameters()))  # every parameter moved
        assert torch.equal(model.gain, twin.gain)  # fp32: the optimizer's own computation
        diff = (model.bias.float() - twin.bias.float()).abs()
        assert (diff > 0).float().mean().item() <= max_share and diff.max().item() <= max_lr_units * LR


def test_compensated_weights_with_owned_moments_follow_fp32():
    """``weights="compensated+moments"``: torch's bf16 moments computed in fp32 and rounded stochastically, the weight
    kept exactly (stored weight + its bf16 residual) through updates far below its grid gap (its resume:
    test_owned_moments_resume_bit_exactly_and_agree_across_ranks)."""
    weight = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([weight], lr=1e-4, weight_decay=0.0, eps=1e-12)
    writeback = WeightWriteBack(opt, "compensated", moments="stochastic")
    for _ in range(100):
        weight.grad = torch.ones_like(weight)
        opt.step()
    assert abs(weight.float().mean().item() - 0.99) <= 2.0**-9  # stored: within half a gap of 0.99
    exact = weight.float() + writeback.compensation[0].float()
    # with its residual: fp32 Adam's weight, up to the bf16 residual's own rounding and the moments' noise (1% of
    # the distance travelled, as with the optimizer's fp32 moments in test_small_updates_move_only_...)
    assert abs(exact.mean().item() - 0.99) < 1e-4 and (exact - 0.99).abs().max().item() < 2e-4
    writeback.close()
