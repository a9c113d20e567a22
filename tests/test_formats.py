"""Property tests of the state formats (hypothesis) and exactness against torchao and bitsandbytes quantizers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_stale.formats import FORMAT_NAMES, QuantizedState, get_format, zero_code
from lightning_stale.formats.fp4 import E2M1_MAGNITUDES, E2M2_NO_ZERO
from lightning_stale.formats.int8_dynamic import dynamic_map, spacing_from_codes

VARIANTS = [(name, signed) for name in FORMAT_NAMES for signed in (True, False)]
LENGTH = 256  # one int8 block, two fp4 blocks: tiling a LENGTH vector keeps every block scale identical


def representable(fmt, q: QuantizedState, magnitudes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sorted magnitudes, or signed values, representable at each element: a 2-D (elements, K) grid, fp64;
    the element's stored |value|)."""
    value = fmt.dequantize(q).reshape(-1).double()
    n = value.numel()
    if fmt.name in ("bf16", "fp16", "fp32"):
        raise AssertionError("use float_grid for unscaled floats")
    if fmt.name == "fp8_e4m3":
        normalized = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        scales = q.scale.double().expand(n)
    else:
        if fmt.name == "int8_dynamic":
            normalized = dynamic_map(fmt.signed).double()
        else:
            e2m1 = torch.tensor(E2M1_MAGNITUDES) / 6.0
            normalized = (torch.cat([e2m1, -e2m1]) if fmt.signed else torch.tensor(E2M2_NO_ZERO) / 14.0).double()
        scales = q.scale.double().repeat_interleave(fmt.block_size)[:n]
    finite = normalized[torch.isfinite(normalized)]
    mags = torch.unique(finite.abs() if magnitudes else finite)
    return mags.view(1, -1) * scales.view(-1, 1), value.abs()


def float_grid(fmt) -> torch.Tensor:
    """All non-negative finite values of an unscaled float format (bf16 / fp16), sorted, fp64."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(fmt.dtype).double()
    return torch.unique(bits[torch.isfinite(bits)].abs())


def input_strategy(name: str, signed: bool):
    """A LENGTH-element fp32 vector in the format's useful range (a mix of magnitudes, with zeros and signs)."""
    limit = {"fp16": 2.0**15, "bf16": 2.0**100}.get(name, 2.0**20)
    floats = st.floats(-limit, limit, allow_nan=False, width=32) | st.sampled_from([0.0, 1e-3, -2.5, 1.0])
    if not signed:
        floats = floats.map(abs)
    # 64 drawn values tiled to LENGTH (drawing 256 floats per example is slow; the blocks still mix magnitudes).
    return st.lists(floats, min_size=64, max_size=64).map(lambda v: torch.tensor(v, dtype=torch.float32).repeat(4))


def in_range_mask(fmt, x: torch.Tensor, q: QuantizedState) -> torch.Tensor:
    """Elements inside the representable range (the signed int8 map stops at -0.993; zero-free E2M2 at 1/14)."""
    if fmt.name == "int8_dynamic" and fmt.signed:
        scales = q.scale.repeat_interleave(fmt.block_size)[: x.numel()]
        return x >= float(dynamic_map(True)[0]) * scales
    if fmt.name == "fp4" and not fmt.signed:
        scales = q.scale.repeat_interleave(fmt.block_size)[: x.numel()]
        return x >= scales / 14.0
    return torch.ones_like(x, dtype=torch.bool)


def bracketing_gap(fmt, x: torch.Tensor, q: QuantizedState) -> torch.Tensor:
    """Distance between the two representable values around each x (fp64)."""
    xd = x.double().abs()
    if fmt.name in ("bf16", "fp16"):
        grid = float_grid(fmt)
        hi = torch.searchsorted(grid, xd).clamp(max=grid.numel() - 1)
        lo = (hi - 1).clamp(min=0)
        return torch.where(grid[hi] == xd, torch.zeros_like(xd), grid[hi] - grid[lo])
    if fmt.name == "fp32":
        return torch.zeros_like(xd)
    values, _ = representable(fmt, q, magnitudes=False)
    xd = x.double()
    above = torch.where(values >= xd.view(-1, 1), values, torch.inf).amin(dim=1)
    below = torch.where(values <= xd.view(-1, 1), values, -torch.inf).amax(dim=1)
    return torch.where(torch.isfinite(above) & torch.isfinite(below), above - below, torch.zeros_like(xd))


# ---------------------------------------------------------------------------------------------------------------------
# Contract


def test_format_names_and_metadata() -> None:
    assert FORMAT_NAMES == ("fp32", "bf16", "fp16", "fp8_e4m3", "fp4", "int8_dynamic")
    theory = {(n, s): get_format(n, s).theory_name for n, s in VARIANTS}
    assert theory[("fp4", True)] == "fp4_e2m1" and theory[("fp4", False)] == "fp4_e2m2"
    assert theory[("fp32", True)] is None and theory[("int8_dynamic", False)] is None
    assert theory[("bf16", False)] == "bf16" and theory[("fp8_e4m3", True)] == "fp8_e4m3"
    assert get_format("fp4", True).block_size == 128 and get_format("int8_dynamic", False).block_size == 256
    assert get_format("bf16", True).block_size is None
    assert get_format("int8_dynamic", True).signed and not get_format("int8_dynamic", False).signed


def test_unknown_names_are_rejected_with_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="int8_dynamic"):
        get_format("int4", True)
    with pytest.raises(ValueError, match="stochastic"):
        get_format("bf16", True).quantize(torch.ones(3), rounding="up")


@pytest.mark.parametrize("name,signed", VARIANTS)
def test_empty_state_dequantizes_to_zero_and_code_dtypes(name: str, signed: bool) -> None:
    fmt = get_format(name, signed)
    empty = fmt.empty((3, 100))
    assert torch.equal(fmt.dequantize(empty), torch.zeros(3, 100))
    q = fmt.quantize(torch.randn(3, 100).abs())
    expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
    assert q.codes.dtype == expected.get(name, torch.uint8)
    assert q.shape == torch.Size((3, 100)) and fmt.dequantize(q).shape == (3, 100)
    code = zero_code(name, signed)
    if code is not None:  # the zero code stores 0 whatever the scale
        assert torch.all(fmt.element_codes(fmt.quantize(torch.zeros(300))) == code)


def test_storage_description() -> None:
    """What the optimizer and the adapters read instead of a format's name: bits, the code table, table rounding."""
    bits = {name: get_format(name, True).bits for name in FORMAT_NAMES}
    assert bits == {"fp32": 32, "bf16": 16, "fp16": 16, "fp8_e4m3": 8, "fp4": 4, "int8_dynamic": 8}
    assert [n for n in FORMAT_NAMES if get_format(n, True).table_rounded] == ["fp4", "int8_dynamic"]
    assert [n for n in FORMAT_NAMES if get_format(n, True).grid() is not None] == ["fp4", "int8_dynamic"]
    for signed in (True, False):
        assert torch.equal(get_format("int8_dynamic", signed).grid(), dynamic_map(signed))
    assert torch.equal(get_format("fp4", False).grid(), torch.tensor(E2M2_NO_ZERO) / 14.0)
    assert torch.equal(get_format("fp4", True).grid()[:8], torch.tensor(E2M1_MAGNITUDES) / 6.0)


@pytest.mark.parametrize("name,signed", [(n, s) for n, s in VARIANTS if get_format(n, s).grid() is not None])
def test_grid_formats_store_codes_into_their_grid(name: str, signed: bool) -> None:
    fmt = get_format(name, signed)
    x = torch.randn(3 * fmt.block_size + 7)  # an odd count: a partial block and a padded byte
    q = fmt.quantize(x if signed else x.abs())
    codes = fmt.element_codes(q)
    values = fmt.grid()[codes.long()] * q.scale.repeat_interleave(fmt.block_size)[: x.numel()]
    assert torch.equal(values, fmt.dequantize(q))
    assert torch.equal(fmt.pack_codes(codes), q.codes)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_round_up_into_bounds_every_value_from_below(name: str) -> None:
    """The write of a bounded v restart: every stored value at or above its target, no positive target stored as 0."""
    fmt = get_format(name, False)
    target = torch.randn(3 * 256 + 7).exp() * 1e-3
    target[::5] = 0.0
    q = fmt.quantize(torch.rand(target.shape))
    codes, scale = q.codes, q.scale
    fmt.round_up_into(q, target)
    assert q.codes is codes and q.scale is scale  # in place
    stored = fmt.dequantize(q)
    assert torch.all(stored >= target) and torch.all(stored[target > 0] > 0)


def test_bytes_per_element() -> None:
    n = 1 << 20
    per_param = {name: get_format(name, True).bytes_per_element(n) + get_format(name, False).bytes_per_element(n)
                 for name in FORMAT_NAMES}
    assert per_param["fp32"] == 8 and per_param["bf16"] == 4 and per_param["fp16"] == 4
    assert per_param["fp8_e4m3"] <= 2.05 and per_param["int8_dynamic"] <= 2.05 and per_param["fp4"] <= 1.1
    assert get_format("fp4", True).bytes_per_element(n) == pytest.approx(0.5 + 4 / 128)


# ---------------------------------------------------------------------------------------------------------------------
# Properties of nearest and stochastic rounding


@pytest.mark.parametrize("name,signed", VARIANTS)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_nearest_error_is_within_half_a_local_gap(name: str, signed: bool, data) -> None:
    fmt = get_format(name, signed)
    x = data.draw(input_strategy(name, signed))
    q = fmt.quantize(x)
    err = (fmt.dequantize(q).double() - x.double()).abs()
    gap = bracketing_gap(fmt, x, q)
    tol = 1e-6 * (x.double().abs() + gap) + 1e-30  # fp32 rounding of scale * normalized value
    inside = in_range_mask(fmt, x, q)
    assert torch.all((err <= 0.5 * gap + tol)[inside])


@pytest.mark.parametrize("name,signed", VARIANTS)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_nearest_is_idempotent(name: str, signed: bool, data) -> None:
    fmt = get_format(name, signed)
    x = data.draw(input_strategy(name, signed))
    if name == "int8_dynamic" and signed:
        x[0] = x.abs().max()  # the signed map stops at -0.993: a negative block max shrinks on re-quantization
    q = fmt.quantize(x)
    again = fmt.quantize(fmt.dequantize(q))
    assert torch.equal(fmt.element_codes(again), fmt.element_codes(q))
    assert torch.equal(fmt.dequantize(again), fmt.dequantize(q))


def test_signed_int8_map_cannot_store_minus_one() -> None:
    """A block whose largest magnitude is negative is stored at -0.993 of it (as in bitsandbytes and torchao)."""
    fmt = get_format("int8_dynamic", True)
    q = fmt.quantize(torch.tensor([-2.0, 1.0]))
    assert fmt.dequantize(q)[0].item() == pytest.approx(2 * float(dynamic_map(True)[0]))


@pytest.mark.parametrize("name,signed", VARIANTS)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_stochastic_rounding_is_unbiased(name: str, signed: bool, data) -> None:
    fmt = get_format(name, signed)
    x = data.draw(input_strategy(name, signed))
    x[0] = x.abs().max()  # keep every value inside the range of the signed int8 map
    samples = 400
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    q = fmt.quantize(x.repeat(samples), rounding="stochastic", generator=generator)
    draws = fmt.dequantize(q).double().view(samples, -1)
    mean = draws.mean(dim=0)
    # Each draw is one of the two neighbours: standard deviation <= gap / 2.
    gap = (draws.amax(dim=0) - draws.amin(dim=0))
    nearest_q = fmt.quantize(x)
    bound = 5 * 0.5 * torch.maximum(gap, bracketing_gap(fmt, x, nearest_q)) / math.sqrt(samples)
    inside = in_range_mask(fmt, x, nearest_q)
    bracket = bracketing_gap(fmt, x, nearest_q)
    tol = 1e-6 * (x.double().abs() + bracket) + 1e-30  # fp32 rounding of scale * normalized value
    assert torch.all(((mean - x.double()).abs() <= bound + tol)[inside])
    assert torch.all((gap <= bracket + tol)[inside])


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp4", "int8_dynamic"])
def test_stochastic_rounding_is_reproducible_and_leaves_global_rng_alone(name: str) -> None:
    fmt = get_format(name, True)
    x = torch.randn(1000)
    rng_before = torch.get_rng_state()
    a = fmt.quantize(x, "stochastic", torch.Generator().manual_seed(7))
    b = fmt.quantize(x, "stochastic", torch.Generator().manual_seed(7))
    fmt.quantize(x, "stochastic")  # no generator: a private one, still not the global RNG
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.equal(fmt.element_codes(a), fmt.element_codes(b))
    c = fmt.quantize(x, "stochastic", torch.Generator().manual_seed(8))
    assert not torch.equal(fmt.element_codes(a), fmt.element_codes(c))


@pytest.mark.parametrize("name,signed", [v for v in VARIANTS if v[0] != "fp32"])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_spacing_is_the_distance_to_the_next_larger_magnitude(name: str, signed: bool, data) -> None:
    fmt = get_format(name, signed)
    x = data.draw(input_strategy(name, signed))
    q = fmt.quantize(x)
    spacing = fmt.spacing(q).reshape(-1).double()
    if name in ("bf16", "fp16"):
        grid = float_grid(fmt)
        value = fmt.dequantize(q).reshape(-1).double().abs()
        idx = torch.searchsorted(grid, value)
        top = idx == grid.numel() - 1
        below = grid[idx] - grid[(idx - 1).clamp(min=0)]
        expected = torch.where(top, below, grid[(idx + 1).clamp(max=grid.numel() - 1)] - grid[idx])
    else:
        mags, value = representable(fmt, q)
        larger = torch.where(mags > value.view(-1, 1) * (1 + 1e-6), mags, torch.inf).amin(dim=1)
        smaller = torch.where(mags < value.view(-1, 1) * (1 - 1e-6), mags, -torch.inf).amax(dim=1)
        expected = torch.where(torch.isfinite(larger), larger - value, value - smaller)
        zero_scale = ~torch.isfinite(expected)
        expected[zero_scale] = spacing[zero_scale]
    assert torch.allclose(spacing, expected, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Exactness against the libraries


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_equals_bitsandbytes(signed: bool) -> None:
    from bitsandbytes.functional import create_dynamic_map

    assert torch.equal(dynamic_map(signed), create_dynamic_map(signed).float())
    assert dynamic_map(signed)[zero_code("int8_dynamic", signed)] == 0


def wide_range_blocks(blocks: int, signed: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(blocks * 256, generator=g) * torch.exp(4 * torch.randn(blocks * 256, generator=g))
    x[::97] = 0.0
    return x if signed else x.abs()


@pytest.mark.parametrize("signed", [True, False])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_int8_codes_equal_torchao(signed: bool, seed: int) -> None:
    from torchao.optim.quant_utils import quantize_8bit_with_qmap, scale_tensor

    x = wide_range_blocks(8, signed, seed)
    q = get_format("int8_dynamic", signed).quantize(x)
    normalized, scale = scale_tensor(x.clone(), 256)
    assert torch.equal(q.codes, quantize_8bit_with_qmap(normalized, dynamic_map(signed)))
    assert torch.equal(q.scale, scale)


@pytest.mark.parametrize("signed", [True, False])
def test_int8_codes_equal_bitsandbytes_where_its_cpu_table_is_exact(signed: bool) -> None:
    """bitsandbytes' CPU quantizer uses a 65,536-bin table over [-1, 1]: it is exact for normalized magnitudes above
    about 3e-5 that are not within one bin of a rounding threshold."""
    import bitsandbytes.functional as F

    x = torch.randn(400 * 256, generator=torch.Generator().manual_seed(0))
    x = x if signed else x.abs()
    codes, bnb_state = F.quantize_blockwise(x, code=F.create_dynamic_map(signed), blocksize=256)
    q = get_format("int8_dynamic", signed).quantize(x)
    assert torch.equal(bnb_state.absmax, q.scale)
    normalized = (x.view(-1, 256) / q.scale.view(-1, 1)).view(-1)
    qmap = dynamic_map(signed)
    midpoints = (qmap[1:] + qmap[:-1]) / 2
    bin_width = 2.0 / 65535
    near_threshold = (normalized.view(-1, 1) - midpoints.view(1, -1)).abs().amin(dim=1) < bin_width
    exact = (normalized.abs() > 3e-5) & ~near_threshold
    assert exact.float().mean() > 0.5
    assert torch.equal(codes[exact], q.codes[exact])


def test_spacing_from_codes_reads_bitsandbytes_state_without_requantizing() -> None:
    import bitsandbytes as bnb

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)  # 4096 weights: 8-bit state
    opt = bnb.optim.AdamW8bit(layer.parameters())
    layer(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()
    state = opt.state[layer.weight]
    for key, signed in (("1", True), ("2", False)):
        codes, absmax = state[f"state{key}"], state[f"absmax{key}"]
        spacing = spacing_from_codes(codes, absmax, state[f"qmap{key}"], 256)
        ours = get_format("int8_dynamic", signed).spacing(QuantizedState(codes, absmax, codes.shape))
        assert spacing.shape == codes.shape and torch.equal(spacing, ours)
        assert torch.all(spacing > 0)


@pytest.mark.parametrize("name,signed", VARIANTS)
def test_partial_blocks_and_quantize_into(name: str, signed: bool) -> None:
    fmt = get_format(name, signed)
    x = torch.randn(5, 77)
    x = x if signed else x.abs()
    q = fmt.empty(x.shape)
    codes, scale = q.codes, q.scale
    fmt.quantize_into(q, x)
    assert q.codes is codes and q.scale is scale  # in place
    assert torch.equal(fmt.dequantize(q), fmt.dequantize(fmt.quantize(x)))
    assert torch.allclose(fmt.dequantize(q), x, rtol=0.5, atol=0.2 * x.abs().max().item())


def _as_floats(patterns: torch.Tensor) -> torch.Tensor:
    """fp32 values with the given bit patterns (int64 in [0, 2^32))."""
    return (patterns - (patterns >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)


def _rounding_edges() -> torch.Tensor:
    """fp32 bit patterns at every place the fp16 and bf16 roundings decide, for each sign and exponent: the dropped
    bits of the normal ranges (13 and 16) and of each fp16 subnormal shift (14 to 25 bits) at exactly a tie, one
    below and one above, zero and all ones, under every even and odd kept last bit; plus random mantissas."""
    gen = torch.Generator().manual_seed(0)
    low = []
    for k in range(1, 24):
        tie = 1 << (k - 1)
        for kept in (0, 1, 2, 3, (1 << (23 - k)) - 1):
            above = (kept << k) & 0x7FFFFF
            low += [above | tie, above | (tie - 1), above | (tie + 1), above, above | ((1 << k) - 1)]
    mantissas = torch.cat([torch.tensor(sorted(set(low)), dtype=torch.int64),
                           torch.randint(0, 1 << 23, (256,), generator=gen, dtype=torch.int64)])
    exponents = torch.arange(256, dtype=torch.int64) << 23
    magnitudes = (exponents[:, None] | mantissas[None, :]).reshape(-1)
    return torch.cat([magnitudes, magnitudes | (1 << 31)])


def _assert_cast_bits(got: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` has the bits of ``x.to(dtype).float()``, and a NaN where it has one (torch's own cast pair gives a NaN's
    sign and payload differently in its vector and scalar code)."""
    expected = x.to(dtype).float()
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), expected[~nan].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nearest_on_grid_is_the_cast_round_trip_eager_and_compiled(dtype: torch.dtype) -> None:
    """The write-back's integer-op rounding equals the cast's round to nearest even bit for bit, on every sign and
    exponent at ties and either side of them (fp16's subnormal shifts included), zeros, infinities, overflow to inf
    and NaN; eager, and compiled without emulated casts (nothing for Inductor to fold away)."""
    from lightning_stale.formats.floats import nearest_on_grid

    x = _as_floats(_rounding_edges())
    compiled = torch.compile(nearest_on_grid, fullgraph=True, dynamic=False)
    for got in (nearest_on_grid(x, dtype), compiled(x, dtype)):
        _assert_cast_bits(got, x, dtype)


def test_fp8_scale_is_the_rounded_quotient_eager_and_compiled() -> None:
    """The fp8 scale max|x| / 448 is the correctly rounded fp32 quotient eager and compiled (torch.compile computes a
    division by a constant as a product by its reciprocal on GPUs and on torch 2.6's CPU: in fp32, an ulp off for about
    half of all maxima), and so are the codes."""
    fmt = get_format("fp8_e4m3", True)
    compiled = torch.compile(fmt.quantize_with_noise, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(32):
        x = torch.randn(16, generator=g) * 10.0 ** torch.randint(-6, 7, (), generator=g).item()
        expected = torch.tensor([x.abs().max().item() / 448.0], dtype=torch.float32)  # an fp64 quotient, rounded once
        eager, fused = fmt.quantize_with_noise(x, None), compiled(x, None)
        assert torch.equal(eager.scale, expected) and torch.equal(fused.scale, expected)
        assert torch.equal(fmt.element_codes(fused), fmt.element_codes(eager))


@settings(max_examples=200, deadline=None)
@given(patterns=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_nearest_on_grid_is_the_cast_on_any_bit_pattern(patterns: list[int], dtype: torch.dtype) -> None:
    from lightning_stale.formats.floats import nearest_on_grid

    x = _as_floats(torch.tensor(patterns, dtype=torch.int64))
    _assert_cast_bits(nearest_on_grid(x, dtype), x, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nearest_on_grid_is_the_cast_on_a_sweep_of_all_patterns(dtype: torch.dtype) -> None:
    """Every 4099th of the 2^32 fp32 bit patterns (a stride prime to every power of two: each low-bit pattern)."""
    from lightning_stale.formats.floats import nearest_on_grid

    for start in range(0, 2**32, 2**28):
        x = _as_floats(torch.arange(start, start + 2**28, 4099, dtype=torch.int64))
        _assert_cast_bits(nearest_on_grid(x, dtype), x, dtype)
