"""torchao low-bit optimizers on CPU: 8-bit, 4-bit, FP8 and their plain-tensor fallback for small parameters.

One tiny shape set for every test (each new shape/dtype/state type costs a torch.compile of the step)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("torchao.optim")

from adapter_checks import (  # noqa: E402
    check_codes_track_state,
    check_full_reset_is_fresh,
    check_partial_params,
    check_slot_reads,
    check_survives_load,
    first_update_ratio,
    make_params,
    run,
)
from helpers import make_optimizer  # noqa: E402
from lightning_stale.adapters import adapter_for  # noqa: E402

SHAPES = [(32, 128), (16,)]  # 4096 elements: quantized; 16: plain fallback in the parameter's dtype
LR = 1e-3
FORMATS = {
    "8bit": ("int8_dynamic", "int8_dynamic"),
    "4bit": ("torchao_4bit_dynamic", "torchao_4bit_linear_nozero"),
    "Fp8": ("fp8_e4m3", "fp8_e4m3"),
}
OPTIMIZERS = {
    f"{kind}{bits}": functools.partial(make_optimizer, f"torchao:{kind}{bits}", lr=LR)
    for bits in FORMATS for kind in ("Adam", "AdamW")
}

pytestmark = pytest.mark.slow  # ~ 1-2 min of torch.compile on a cold cache


def _raw(state: dict, key: str) -> torch.Tensor:
    """Independent reader of the stored codes, one per element (4-bit nibbles unpacked by shifting)."""
    if f"{key}.codes" not in state:
        return state[key]
    codes = state[f"{key}.codes"]
    if codes.dtype == torch.float8_e4m3fn:
        return codes.view(torch.uint8)
    if f"{key}.qmap" in state and state[f"{key}.qmap"].numel() == 16:
        shift = torch.tensor([4, 0], dtype=torch.uint8).repeat(codes.numel())
        return (codes.repeat_interleave(2) >> shift) & 15
    return codes


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_slots_reads_and_library_dequantization(name: str) -> None:
    params = make_params(SHAPES)
    opt = OPTIMIZERS[name](params)
    run(opt, params, range(2))
    adapter = adapter_for(opt)
    slots = adapter.slots()
    assert [(s.param, s.moment) for s in slots] == [(p, m) for p in params for m in "mv"]
    assert tuple(s.format for s in slots[:2]) == FORMATS[name.removeprefix("AdamW").removeprefix("Adam")]
    assert [s.format for s in slots[2:]] == ["fp32", "fp32"]
    check_slot_reads(adapter)
    for slot in slots:
        buf = opt.state[slot.param][slot.key]
        expected = buf.dequantize() if hasattr(buf, "dequantize") else buf
        assert torch.equal(slot.value(), expected.float().reshape(-1)), slot.key
        spacing = slot.spacing() if slot.format != "int8_dynamic" else None
        if spacing is not None:
            assert spacing.shape == (slot.numel,) and bool((spacing >= 0).all())


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_codes_track_state(name: str) -> None:
    check_codes_track_state(OPTIMIZERS[name], make_params(SHAPES), _raw)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_full_reset_equals_fresh(name: str) -> None:
    check_full_reset_is_fresh(OPTIMIZERS[name], make_params(SHAPES))


def test_full_reset_keeps_step_and_lr_tensors() -> None:
    params = make_params(SHAPES)
    opt = OPTIMIZERS["AdamW8bit"](params)
    run(opt, params, range(2))
    step, lr = opt.state[params[0]]["step"], opt.param_groups[0]["lr"]
    adapter_for(opt).reset()
    assert opt.state[params[0]]["step"] is step and float(step) == 0.0
    assert opt.param_groups[0]["lr"] is lr and isinstance(lr, torch.Tensor)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_reset_only_chosen_params(name: str) -> None:
    check_partial_params(OPTIMIZERS[name], make_params(SHAPES))


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8"])
def test_survives_load_state_dict(name: str) -> None:
    check_survives_load(OPTIMIZERS[name], make_params(SHAPES))


@pytest.mark.parametrize("name", ["Adam8bit", "Adam4bit", "AdamFp8"])
def test_v_only_reset_first_update_is_bounded(name: str) -> None:
    make = OPTIMIZERS[name]
    safe = first_update_ratio(make, make_params(SHAPES), LR, lambda opt: adapter_for(opt).reset(["v"]))
    assert safe <= 1.0 + 1e-3

    def naive(opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            buf = state["exp_avg_sq"]
            (buf.scale if hasattr(buf, "scale") else buf).zero_()

    assert first_update_ratio(make, make_params(SHAPES), LR, naive) > 10 * safe
