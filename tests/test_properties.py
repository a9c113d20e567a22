"""Property-based tests (issue 6 item 6) for the state formats and the optimizer adapters, over random shapes, dtypes,
values and step counts:

- a full reset equals a fresh state (and the next steps match a fresh optimizer bit for bit);
- codes never change on a skipped step (a parameter without a gradient);
- dequantized values stay finite for finite inputs;
- after the underflow guard no element holds v = 0 with m != 0.

torchao is left out: every new shape costs a torch.compile of its step (its adapter has fixed-shape tests).
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from adapter_checks import assert_states_equal
from helpers import make_optimizer
from lightning_stale.act.guard import guard_underflow
from lightning_stale.adapters import adapter_for
from lightning_stale.formats import FORMAT_NAMES, ROUNDINGS, get_format

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Shapes from empty to a little over the 4096-element quantization thresholds, odd sizes included.
def shape_strategy(min_dim: int) -> st.SearchStrategy[tuple[int, ...]]:
    dims = st.one_of(st.integers(min_dim, 7), st.integers(8, 97), st.sampled_from([128, 255, 256, 257, 4096, 4097]))
    return st.lists(dims, min_size=1, max_size=2).map(tuple).filter(lambda s: math.prod(s) <= 8192)


shapes = shape_strategy(0)
param_shapes = st.lists(shape_strategy(1), min_size=1, max_size=3)


@st.composite
def finite_values(draw, shape: tuple[int, ...], max_exp: int = 30) -> Tensor:
    """Random finite fp32 values of mixed magnitudes (10**-max_exp ... 10**max_exp), signs, and exact zeros."""
    seed = draw(st.integers(0, 2**31 - 1))
    lo = draw(st.integers(-max_exp, max_exp))
    hi = draw(st.integers(lo, max_exp))
    zeros = draw(st.sampled_from([0.0, 0.1, 0.9]))
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    exponent = lo + (hi - lo) * torch.rand(n, generator=gen)
    values = torch.randn(n, generator=gen) * torch.pow(10.0, exponent)
    values[torch.rand(n, generator=gen) < zeros] = 0.0
    return values.reshape(shape)


# -- formats ------------------------------------------------------------------------------------------------------


@SETTINGS
@given(name=st.sampled_from(FORMAT_NAMES), signed=st.booleans(), rounding=st.sampled_from(ROUNDINGS),
       data=st.data(), shape=shapes)
def test_format_dequantizes_finite_values_for_finite_inputs(name, signed, rounding, data, shape):
    fmt = get_format(name, signed)
    x = data.draw(finite_values(shape, max_exp=38))
    if not signed:
        x = x.abs()
    q = fmt.quantize(x, rounding, torch.Generator().manual_seed(0))
    out = fmt.dequantize(q)
    assert out.shape == x.shape
    assert bool(torch.isfinite(out).all())
    assert bool(torch.isfinite(fmt.spacing(q)).all())
    if not signed:
        assert bool((out >= 0).all())


@SETTINGS
@given(name=st.sampled_from(FORMAT_NAMES), signed=st.booleans(), shape=shapes)
def test_format_empty_state_reads_zero(name, signed, shape):
    fmt = get_format(name, signed)
    out = fmt.dequantize(fmt.empty(shape))
    assert out.shape == torch.Size(shape) and not bool(out.any())


# -- adapters: real optimizers ---------------------------------------------------------------------------------------

KINDS = (["torch_fp32", "torch_bf16", "bnb"]
         + [f"qadamw:{f}:{r}" for f in FORMAT_NAMES for r in ROUNDINGS])


@st.composite
def setups(draw, kinds: list[str]):
    """(kind, params, min_quantized_size)."""
    kind = draw(st.sampled_from(kinds))
    dtype = torch.bfloat16 if kind == "torch_bf16" else torch.float32
    params = [nn.Parameter(draw(finite_values(s, max_exp=1)).to(dtype)) for s in draw(param_shapes)]
    return kind, params, draw(st.sampled_from([1, 256, 4096]))


def set_grads(data, params: list[nn.Parameter], max_exp: int = 6) -> None:
    for p in params:
        p.grad = data.draw(finite_values(p.shape, max_exp=max_exp)).to(p.dtype)


@SETTINGS
@given(setup=setups(KINDS), steps=st.integers(1, 4), data=st.data())
def test_full_reset_reads_zero_and_steps_like_a_fresh_optimizer(setup, steps, data):
    kind, params, min_size = setup
    opt = make_optimizer(kind, params, min_quantized_size=min_size)
    for _ in range(steps):
        set_grads(data, params)
        opt.step()
    adapter = adapter_for(opt)
    adapter.reset()
    for slot in adapter.slots():
        assert not bool(slot.value().any()), f"{kind} {slot.key}: not zero after a reset"
    if kind.endswith("stochastic"):
        return  # the rounding stream is not part of the state a reset restores
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    fresh = make_optimizer(kind, twins, min_quantized_size=min_size)
    for _ in range(data.draw(st.integers(1, 3))):
        set_grads(data, params)
        for p, t in zip(params, twins):
            t.grad = p.grad.clone()
        opt.step()
        fresh.step()
    assert_states_equal(opt, params, fresh, twins)


@SETTINGS
@given(setup=setups(KINDS), steps=st.integers(1, 3), data=st.data())
def test_codes_never_change_on_a_skipped_step(setup, steps, data):
    kind, params, min_size = setup
    opt = make_optimizer(kind, params, min_quantized_size=min_size)
    for _ in range(steps):
        set_grads(data, params)
        opt.step()
    skipped = data.draw(st.lists(st.booleans(), min_size=len(params), max_size=len(params)))
    adapter = adapter_for(opt)
    before = {(id(s.param), s.key): s.codes().clone() for s in adapter.slots()}
    set_grads(data, params)
    for p, skip in zip(params, skipped):
        if skip:
            p.grad = None
    opt.step()
    for slot in adapter.slots():
        if skipped[[id(p) for p in params].index(id(slot.param))]:
            assert torch.equal(slot.codes(), before[(id(slot.param), slot.key)]), f"{kind} {slot.key} changed"


@SETTINGS
@given(setup=setups(KINDS), steps=st.integers(1, 4), data=st.data())
def test_stored_moments_stay_finite_for_finite_gradients(setup, steps, data):
    kind, params, min_size = setup
    opt = make_optimizer(kind, params, min_quantized_size=min_size)
    for _ in range(steps):
        set_grads(data, params, max_exp=15)  # g**2 stays finite in fp32, where every optimizer does its arithmetic
        opt.step()
    for slot in adapter_for(opt).slots():
        assert bool(torch.isfinite(slot.value()).all()), f"{kind} {slot.key}: non-finite stored value"


@SETTINGS
@given(setup=setups(KINDS), steps=st.integers(1, 3), data=st.data())
def test_guard_leaves_no_zero_v_under_a_nonzero_m(setup, steps, data):
    kind, params, min_size = setup
    opt = make_optimizer(kind, params, min_quantized_size=min_size)
    adapter = adapter_for(opt)
    for _ in range(steps):
        set_grads(data, params, max_exp=8)
        opt.step()
        guard_underflow(adapter.slots())
        by_param: dict[int, dict[str, Tensor]] = {}
        for slot in adapter.slots():
            by_param.setdefault(id(slot.param), {})[slot.moment] = slot.zero_mask()
        for zero in by_param.values():
            if "m" in zero and "v" in zero:
                assert not bool((zero["v"] & ~zero["m"]).any()), kind
