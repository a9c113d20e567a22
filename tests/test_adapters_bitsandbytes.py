"""bitsandbytes adapters on CPU (>= 0.50): every 8-bit optimizer, the 32-bit fallback of small parameters and
``optim_bits=32`` overrides."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as F  # noqa: E402

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

SHAPES = [(64, 64), (16,)]  # 4096 elements: 8-bit state; 16: below min_8bit_size, fp32 state
LR = 1e-3

OPTIMIZERS = {
    "Adam8bit": (functools.partial(make_optimizer, "bnb:Adam8bit", lr=LR), "mv"),
    "AdamW8bit": (functools.partial(make_optimizer, "bnb:AdamW8bit", lr=LR), "mv"),
    "PagedAdam8bit": (functools.partial(make_optimizer, "bnb:PagedAdam8bit", lr=LR), "mv"),
    "PagedAdamW8bit": (functools.partial(make_optimizer, "bnb:PagedAdamW8bit", lr=LR), "mv"),
    "Lion8bit": (functools.partial(make_optimizer, "bnb:Lion8bit", lr=LR), "m"),
    "SGD8bit": (functools.partial(make_optimizer, "bnb:SGD8bit", lr=LR, momentum=0.9), "m"),
    "RMSprop8bit": (functools.partial(make_optimizer, "bnb:RMSprop8bit", lr=LR), "v"),
    "Adagrad8bit": (functools.partial(make_optimizer, "bnb:Adagrad8bit", lr=LR), "v"),
    "AdEMAMix8bit": (functools.partial(make_optimizer, "bnb:AdEMAMix8bit", lr=LR), "mmv"),
    "LAMB8bit": (functools.partial(make_optimizer, "bnb:LAMB8bit", lr=LR), "mv"),
}


@pytest.fixture(autouse=True)
def _quiet_paged_fallback():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        yield


def _raw(state: dict, key: str) -> torch.Tensor:
    """Independent reader: the stored code tensor (or one half of AdEMAMix's double buffer)."""
    return state["state1"][int(key[-2])] if key.endswith("]") else state[key]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_slots_and_reads(name: str) -> None:
    make, moments = OPTIMIZERS[name]
    params = make_params(SHAPES)
    opt = make(params)
    run(opt, params, range(2))
    adapter = adapter_for(opt)
    slots = adapter.slots()
    assert [(s.param, s.moment) for s in slots] == [(p, m) for p in params for m in moments]
    assert [s.format for s in slots] == ["int8_dynamic"] * len(moments) + ["fp32"] * len(moments)
    check_slot_reads(adapter)
    for slot in slots[: len(moments)]:  # the 8-bit ones: agree with bitsandbytes' own dequantization
        expected = F.dequantize_blockwise(slot.codes(), absmax=slot.scale, code=slot.qmap, blocksize=256)
        assert torch.equal(slot.value(), expected.reshape(-1))
        assert slot.qmap is opt.state[params[0]]["qmap1" if slot.key.startswith("state1") else "qmap2"]


def test_betas_per_slot() -> None:
    params = make_params(SHAPES)
    betas = {
        "AdEMAMix8bit": ([0.9, 0.9999, 0.999], bnb.optim.AdEMAMix8bit(params, betas=(0.9, 0.999, 0.9999))),
        "Lion8bit": ([0.99], bnb.optim.Lion8bit(params, betas=(0.9, 0.99))),
        "RMSprop8bit": ([0.95], bnb.optim.RMSprop8bit(params, alpha=0.95)),
        "SGD8bit": ([None], bnb.optim.SGD8bit(params, lr=LR, momentum=0.9)),
    }
    for name, (expected, opt) in betas.items():
        run(opt, params, [0])
        assert [s.beta for s in adapter_for(opt).slots()[: len(expected)]] == expected, name
    keys = [s.key for s in adapter_for(betas["AdEMAMix8bit"][1]).slots()[:3]]
    assert keys == ["state1[0]", "state1[1]", "state2"]


@pytest.mark.parametrize("name", ["Adam8bit", "Lion8bit", "AdEMAMix8bit", "RMSprop8bit"])
def test_codes_track_state(name: str) -> None:
    check_codes_track_state(OPTIMIZERS[name][0], make_params(SHAPES), _raw)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_full_reset_equals_fresh(name: str) -> None:
    check_full_reset_is_fresh(OPTIMIZERS[name][0], make_params(SHAPES))


@pytest.mark.parametrize("name", ["AdamW8bit", "AdEMAMix8bit", "SGD8bit"])
def test_reset_only_chosen_params(name: str) -> None:
    check_partial_params(OPTIMIZERS[name][0], make_params(SHAPES))


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit", "AdEMAMix8bit"])
def test_survives_load_state_dict(name: str) -> None:
    check_survives_load(OPTIMIZERS[name][0], make_params(SHAPES))


@pytest.mark.parametrize("name", ["Adam8bit", "AdamW8bit", "AdEMAMix8bit"])
def test_v_only_reset_first_update_is_bounded(name: str) -> None:
    make = functools.partial(OPTIMIZERS[name][0], weight_decay=0.0)
    safe = first_update_ratio(make, make_params(SHAPES), LR, lambda opt: adapter_for(opt).reset(["v"]))
    first_step = 1.0 + (5.0 * (1 - 0.9999) if name == "AdEMAMix8bit" else 0.0)  # AdEMAMix: 1 + alpha (1 - beta3)
    assert safe <= first_step * (1 + 1e-3)

    def naive(opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            state["state2"].zero_()
            state.get("absmax2", torch.zeros(())).zero_()

    assert first_update_ratio(make, make_params(SHAPES), LR, naive) > 10 * safe


def test_m_only_reset_keeps_v_and_step() -> None:
    params = make_params(SHAPES)
    opt = bnb.optim.Adam8bit(params, lr=LR)
    run(opt, params, range(3))
    v = [opt.state[p]["state2"].clone() for p in params]
    adapter_for(opt).reset(["m"])
    for slot in adapter_for(opt).slots():
        if slot.moment == "m":
            assert bool((slot.value() == 0).all())
    for p, old in zip(params, v):
        assert torch.equal(opt.state[p]["state2"], old) and opt.state[p]["step"] == 3


def test_optim_bits_32_override() -> None:
    """A GlobalOptimManager ``optim_bits=32`` override gives that weight fp32 state; it resets to a fresh state."""
    mng = bnb.optim.GlobalOptimManager.get_instance()
    params = make_params([(64, 64), (64, 64)])
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    try:
        mng.register_parameters(params)
        mng.override_config(params[1], "optim_bits", 32)
        mng.override_config(twins[1], "optim_bits", 32)
        opt = bnb.optim.Adam8bit(params, lr=LR)
        run(opt, params, range(3))
        adapter = adapter_for(opt)
        assert [s.format for s in adapter.slots()] == ["int8_dynamic"] * 2 + ["fp32"] * 2
        adapter.reset()
        for p, t in zip(params, twins):
            t.data.copy_(p.data)
        fresh = bnb.optim.Adam8bit(twins, lr=LR)
        run(opt, params, range(10, 13))
        run(fresh, twins, range(10, 13))
        for p, t in zip(params, twins):
            assert torch.equal(p, t)
            assert torch.equal(opt.state[p]["state2"], fresh.state[t]["state2"])
    finally:
        mng.pid2config.clear()
        mng.index2config.clear()
