"""QuantizedAdamW: fp32 parity with torch AdamW, stall counts, per-moment resets, checkpoints and argument errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from lightning_stale.formats import FORMAT_NAMES, get_format
from lightning_stale.formats.noise import NOISE_BITS, counter_bits
from lightning_stale.optim import QuantizedAdamW


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def test_fp32_state_reproduces_torch_adamw() -> None:
    reference, ours = small_model(), small_model()
    groups = lambda m: [  # noqa: E731
        {"params": m[0].parameters(), "lr": 3e-3, "weight_decay": 0.1},
        {"params": m[2].parameters(), "betas": (0.8, 0.99)},
    ]
    train(reference, torch.optim.AdamW(groups(reference), lr=1e-2, eps=1e-6), steps=30)
    train(ours, QuantizedAdamW(groups(ours), lr=1e-2, eps=1e-6, state_format="fp32"), steps=30)
    for a, b in zip(reference.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("state_format", [n for n in FORMAT_NAMES if n != "fp32"])
def test_quantized_formats_track_fp32_adamw(state_format: str) -> None:
    """The parameter update uses the unrounded moments, so one step from a fresh state equals fp32 AdamW exactly."""
    reference, ours = small_model(), small_model()
    train(reference, torch.optim.AdamW(reference.parameters()), steps=1)
    opt = QuantizedAdamW(ours.parameters(), state_format=state_format, min_quantized_size=0)
    train(ours, opt, steps=1)
    for a, b in zip(reference.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    weight = ours[0].weight
    assert opt.moment_format(weight, "m").name == state_format
    m_fmt = get_format(state_format, True)
    assert opt.moment_state(weight, "m").codes.dtype == m_fmt.empty((2,)).codes.dtype


def test_state_layout_small_params_stay_fp32_and_views_are_live() -> None:
    model = small_model()
    opt = QuantizedAdamW(model.parameters(), state_format={"m": "fp8_e4m3", "v": "int8_dynamic"})
    train(model, opt, steps=2)
    big, small = model[0].weight, model[0].bias  # 6144 and 96 elements
    state = opt.state[big]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn and state["exp_avg_sq"].dtype == torch.uint8
    assert {"exp_avg_scale", "exp_avg_sq_scale", "step_m", "step_v"} <= set(state)
    assert state["step_m"].dtype == torch.float32 and state["step_m"].item() == 2
    assert opt.moment_format(small, "v").name == "fp32" and opt.state[small]["exp_avg_sq"].dtype == torch.float32
    q = opt.moment_state(big, "v")
    assert q.codes is state["exp_avg_sq"] and q.scale is state["exp_avg_sq_scale"]
    q.codes.fill_(0)
    assert torch.all(opt.state[big]["exp_avg_sq"] == 0)


@pytest.mark.parametrize("state_format", FORMAT_NAMES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_builtin_stall_counts_equal_clone_and_compare(state_format: str, rounding: str) -> None:
    model = small_model()
    opt = QuantizedAdamW(
        model.parameters(), lr=1e-2, state_format=state_format, rounding=rounding, min_quantized_size=1000,
        count_stalls=True,
    )
    train(model, opt, steps=3)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        before = {(id(p), mo): opt.moment_format(p, mo).element_codes(opt.moment_state(p, mo)).clone()
                  for p in model.parameters() for mo in ("m", "v")}
        opt.zero_grad()
        model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
        model[0].weight.grad[:10] = 0.0  # zero gradients are not counted
        if step == 2:
            model[2].weight.grad[0, 0] = float("inf")  # nor non-finite ones
        opt.step()
        counts = opt.last_stall_counts()
        for p in model.parameters():
            counted_mask = (p.grad != 0) & torch.isfinite(p.grad)
            for mo in ("m", "v"):
                after = opt.moment_format(p, mo).element_codes(opt.moment_state(p, mo))
                unchanged = (after == before[(id(p), mo)]) & counted_mask.reshape(-1)
                stalled, counted = counts[id(p)][mo]
                assert stalled.dtype == torch.int64 and stalled.dim() == 0
                assert stalled.item() == unchanged.sum().item()
                assert counted.item() == counted_mask.sum().item()
    assert counts[id(model[0].weight)]["m"][1].item() == model[0].weight.numel() - 10 * 64


def test_count_stalls_off_by_default_records_nothing() -> None:
    model = small_model()
    opt = QuantizedAdamW(model.parameters())
    train(model, opt, steps=1)
    assert opt.last_stall_counts() == {}


def test_bf16_nearest_second_moment_stalls_as_the_paper_predicts() -> None:
    """bf16, nearest, beta2 = 0.999, Gaussian gradients: most v codes stop moving (paper: about 0.946 per step;
    measured here about 0.91 after 1,500 steps, rising to about 0.97 as the stored v ratchets up)."""
    param = torch.nn.Parameter(torch.zeros(8192))
    opt = QuantizedAdamW([param], lr=0.0, weight_decay=0.0, state_format="bf16", count_stalls=True)
    g = torch.Generator().manual_seed(0)
    fractions = []
    for _ in range(2000):
        param.grad = torch.randn(8192, generator=g)
        opt.step()
        stalled, counted = opt.last_stall_counts()[id(param)]["v"]
        fractions.append(stalled.item() / counted.item())
    late = sum(fractions[-200:]) / 200
    assert late > 0.9
    assert sum(fractions[:5]) / 5 < 0.5  # early on the EMA still moves


def test_reset_moments_is_in_place_and_per_moment() -> None:
    model = small_model()
    opt = QuantizedAdamW(model.parameters(), state_format="int8_dynamic", min_quantized_size=0)
    train(model, opt, steps=3)
    weight = model[0].weight
    state = opt.state[weight]
    pointers = {k: v.data_ptr() for k, v in state.items()}
    m_before = opt.moment_format(weight, "m").dequantize(opt.moment_state(weight, "m")).clone()
    opt.reset_moments(moments=("v",), params=[weight])
    assert {k: v.data_ptr() for k, v in state.items()} == pointers
    assert torch.all(opt.moment_format(weight, "v").dequantize(opt.moment_state(weight, "v")) == 0)
    assert state["step_v"].item() == 0 and state["step_m"].item() == 3
    assert torch.equal(opt.moment_format(weight, "m").dequantize(opt.moment_state(weight, "m")), m_before)
    assert opt.state[model[2].weight]["step_v"].item() == 3  # other params untouched


@pytest.mark.parametrize("state_format", ["int8_dynamic", "fp4", "bf16"])
def test_full_reset_equals_a_fresh_optimizer(state_format: str) -> None:
    model = small_model()
    opt = QuantizedAdamW(model.parameters(), state_format=state_format, min_quantized_size=0)
    train(model, opt, steps=3)
    opt.reset_moments()
    fresh_model = copy.deepcopy(model)
    fresh = QuantizedAdamW(fresh_model.parameters(), state_format=state_format, min_quantized_size=0)
    train(model, opt, steps=3, seed=9)
    train(fresh_model, fresh, steps=3, seed=9)
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("state_format", [{"m": "fp4", "v": "bf16"}, "int8_dynamic", "fp8_e4m3", "fp16"])
def test_state_dict_round_trip_continues_bit_identically(state_format) -> None:
    model = small_model()
    opt = QuantizedAdamW(
        model.parameters(), state_format=state_format, rounding="stochastic", min_quantized_size=0, seed=3
    )
    train(model, opt, steps=3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model = small_model(seed=42)
    resumed_model.load_state_dict(saved["model"])
    resumed = QuantizedAdamW(resumed_model.parameters(), state_format=state_format, rounding="stochastic",
                             min_quantized_size=0, seed=99)
    resumed.load_state_dict(saved["opt"])
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        for key, value in opt.state[p].items():
            assert resumed.state[q][key].dtype == value.dtype and torch.equal(resumed.state[q][key], value)
    train(model, opt, steps=3, seed=7)
    train(resumed_model, resumed, steps=3, seed=7)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def test_stochastic_rounding_uses_its_own_seeded_stream() -> None:
    runs = []
    for seed in (0, 0, 1):
        model = small_model()
        opt = QuantizedAdamW(
            model.parameters(), state_format="bf16", rounding="stochastic", seed=seed, min_quantized_size=0
        )
        rng_before = torch.get_rng_state()
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        assert torch.equal(torch.get_rng_state(), rng_before)
        runs.append(opt.state[model[0].weight]["exp_avg_sq"].clone())
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"state_format": "int4"}, "int8_dynamic"),
        ({"state_format": {"m": "bf16"}}, "'m' and 'v'"),
        ({"state_format": {"m": "bf16", "v": "fp5"}}, "state_format\\['v'\\]"),
        ({"state_format": 8}, "mapping"),
        ({"rounding": "up"}, "stochastic"),
        ({"betas": (0.9, 1.0)}, "betas\\[1\\]"),
        ({"betas": (-0.1, 0.99)}, "betas\\[0\\]"),
        ({"lr": -1.0}, "lr"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"min_quantized_size": -1}, "min_quantized_size"),
        ({"compile": "yes"}, "compile"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        QuantizedAdamW(small_model().parameters(), **kwargs)


def test_stochastic_step_noise_is_uniform_and_keyed() -> None:
    """The step's counter-hashed noise: near-uniform 16-bit values, independent per moment and per key."""
    m_noise, v_noise = counter_bits(torch.tensor([1, 2]), 1 << 16)
    other, _ = counter_bits(torch.tensor([1, 3]), 1 << 16)
    for noise in (m_noise, v_noise):
        assert noise.dtype == torch.int32 and 0 <= noise.min() and noise.max() < 1 << NOISE_BITS
        counts = torch.bincount(noise >> 12, minlength=16).float()  # 16 bins of 4096 expected values
        assert (counts - 4096).abs().max() < 400
    for a, b in ((m_noise, v_noise), (m_noise, other)):
        assert (a == b).float().mean() < 0.01 and abs(torch.corrcoef(torch.stack([a, b]).float())[0, 1]) < 0.02


@pytest.mark.slow
@pytest.mark.parametrize(
    "state_format,rounding",
    [({"m": "int8_dynamic", "v": "bf16"}, "stochastic"), ({"m": "fp8_e4m3", "v": "fp4"}, "stochastic"),
     ({"m": "fp4", "v": "int8_dynamic"}, "nearest")],
)
def test_compiled_step_equals_eager(state_format, rounding: str) -> None:
    """torch.compile'd steps store the same codes, scales and stall counts as eager ones, stochastic stream included;
    parameters agree to an ulp (eager torch.sqrt is not correctly rounded, Inductor's is)."""
    runs = []
    for compile in (False, True):
        weight = torch.nn.Parameter(torch.linspace(-1, 1, 256 * 40).reshape(40, 256))
        opt = QuantizedAdamW([weight], lr=1e-2, state_format=state_format, rounding=rounding, seed=4, compile=compile,
                             count_stalls=True)
        g = torch.Generator().manual_seed(0)
        counts = []
        for _ in range(3):
            weight.grad = torch.randn(weight.shape, generator=g) * 1e-3
            weight.grad[0] = 0.0
            opt.step()
            counts.append([c.item() for mo in ("m", "v") for c in opt.last_stall_counts()[id(weight)][mo]])
        runs.append((weight.detach(), opt.state[weight], counts))
    (eager_weight, eager_state, eager_counts), (compiled_weight, compiled_state, compiled_counts) = runs
    for key, value in eager_state.items():
        assert torch.equal(value, compiled_state[key]), key
    assert eager_counts == compiled_counts
    torch.testing.assert_close(eager_weight, compiled_weight, rtol=1e-6, atol=1e-7)


def test_invalid_param_group_override_and_moment_names() -> None:
    model = small_model()
    with pytest.raises(ValueError, match="int8_dynamic"):
        QuantizedAdamW([{"params": model[0].parameters(), "state_format": "fp6"}])
    opt = QuantizedAdamW(model.parameters())
    with pytest.raises(ValueError, match="moment"):
        opt.reset_moments(moments=("w",))
    with pytest.raises(ValueError, match="moment"):
        opt.moment_state(model[0].weight, "x")


def test_sparse_gradients_are_rejected() -> None:
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = QuantizedAdamW(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
