"""The QuantizedAdamW adapter: slots in every state format, exact per-moment resets, a bounded v-only restart."""

from __future__ import annotations

import functools

import pytest
import torch

from adapter_checks import (
    check_codes_track_state,
    check_full_reset_is_fresh,
    check_partial_params,
    check_slot_reads,
    check_survives_load,
    first_update_ratio,
    make_params,
    run,
)
from helpers import make_optimizer
from lightning_stale.adapters import adapter_for
from lightning_stale.formats.base import unpack_nibbles

SHAPES = [(64, 64), (16,)]  # 4096 elements: stored in the format; 16: below min_quantized_size, fp32
FORMATS = ["int8_dynamic", "fp4", "fp8_e4m3", "bf16"]
LR = 1e-3
OPTIMIZERS = {fmt: functools.partial(make_optimizer, f"qadamw:{fmt}", lr=LR, weight_decay=0.0, min_quantized_size=4096)
              for fmt in FORMATS}


def _raw(fmt: str):
    """Independent reader of one stored code per element."""

    def read(state: dict, key: str) -> torch.Tensor:
        codes = state[key]
        if codes.numel() * 2 == 4096 and fmt == "fp4":
            return unpack_nibbles(codes, 4096)
        return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes

    return read


@pytest.mark.parametrize("fmt", FORMATS)
def test_slots_reads_and_format_dequantization(fmt: str) -> None:
    params = make_params(SHAPES)
    opt = OPTIMIZERS[fmt](params)
    run(opt, params, range(2))
    adapter = adapter_for(opt)
    slots = adapter.slots()
    assert adapter.exact_moment_reset
    assert [(s.param, s.moment, s.format) for s in slots] == [
        (params[0], "m", fmt), (params[0], "v", fmt), (params[1], "m", "fp32"), (params[1], "v", "fp32")]
    check_slot_reads(adapter)
    for slot in slots:
        f, q = opt.moment_format(slot.param, slot.moment), opt.moment_state(slot.param, slot.moment)
        assert torch.equal(slot.value(), f.dequantize(q).reshape(-1).float())
        assert torch.equal(slot.codes().reshape(-1), f.element_codes(q))
        assert torch.allclose(slot.spacing(), f.spacing(q).reshape(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", ["int8_dynamic", "fp4", "bf16"])
def test_codes_track_state(fmt: str) -> None:
    check_codes_track_state(OPTIMIZERS[fmt], make_params(SHAPES), _raw(fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_reset_equals_fresh(fmt: str) -> None:
    check_full_reset_is_fresh(OPTIMIZERS[fmt], make_params(SHAPES))


def test_reset_only_chosen_params_and_load() -> None:
    check_partial_params(OPTIMIZERS["int8_dynamic"], make_params(SHAPES))
    check_survives_load(OPTIMIZERS["int8_dynamic"], make_params(SHAPES))


def test_exact_v_only_reset_restarts_v_age_only() -> None:
    params = make_params(SHAPES)
    opt = OPTIMIZERS["int8_dynamic"](params)
    run(opt, params, range(4))
    m = [opt.state[p]["exp_avg"].clone() for p in params]
    adapter_for(opt).reset_exact(["v"])
    for p, old in zip(params, m):
        assert float(opt.state[p]["step_v"]) == 0 and float(opt.state[p]["step_m"]) == 4
        assert torch.equal(opt.state[p]["exp_avg"], old)
    assert all(bool((s.value() == 0).all()) for s in adapter_for(opt).slots() if s.moment == "v")


@pytest.mark.parametrize("state_format", ["int8_dynamic", "fp8_e4m3", "fp4", "bf16"])
def test_v_only_reset_is_bounded_by_default_and_the_exact_one_is_not(state_format: str) -> None:
    make = OPTIMIZERS[state_format]
    bounded = first_update_ratio(make, make_params(SHAPES), LR, lambda opt: adapter_for(opt).reset(["v"]))
    exact = first_update_ratio(make, make_params(SHAPES), LR, lambda opt: adapter_for(opt).reset_exact(["v"]))
    assert bounded <= 1.0 + 1e-3  # the next update is at most a first Adam step
    assert exact > 10 * bounded  # the paper's reset: lr * m_hat / |g| for the small new gradient
    params = make_params(SHAPES)
    opt = make(params)
    run(opt, params, range(4))
    m = [opt.state[p]["exp_avg"].clone() for p in params]
    adapter_for(opt).reset(["v"])
    for p, old in zip(params, m):  # both ages and m kept; v rewritten in place
        assert float(opt.state[p]["step_v"]) == 4 and float(opt.state[p]["step_m"]) == 4
        assert torch.equal(opt.state[p]["exp_avg"], old)
