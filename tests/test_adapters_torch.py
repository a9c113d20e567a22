"""torch.optim adapters: Adam/AdamW (for-loop, foreach, fused), SGD momentum, RMSprop, Adagrad, fp32 and bf16."""

from __future__ import annotations

import functools
import warnings

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
from lightning_stale.adapters import adapter_for, register_adapter
from lightning_stale.adapters.generic import GenericAdapter

SHAPES = [(8, 16), (16,)]
LR = 1e-2

OPTIMIZERS = {
    "Adam": functools.partial(torch.optim.Adam, lr=LR),
    "Adam-foreach-amsgrad": functools.partial(torch.optim.Adam, lr=LR, foreach=True, amsgrad=True),
    "AdamW-fused": functools.partial(torch.optim.AdamW, lr=LR, fused=True),
    "AdamW-foreach": functools.partial(torch.optim.AdamW, lr=LR, foreach=True),
    "SGD-momentum": functools.partial(torch.optim.SGD, lr=LR, momentum=0.9),
    "SGD-dampening": functools.partial(torch.optim.SGD, lr=LR, momentum=0.9, dampening=0.1),
    "RMSprop-centered": functools.partial(torch.optim.RMSprop, lr=LR, momentum=0.5, centered=True),
    "Adagrad": functools.partial(torch.optim.Adagrad, lr=LR, initial_accumulator_value=0.1),
}
MOMENTS = {"Adam": ("m", "v"), "SGD": ("m",), "RMSprop": ("v",), "Adagrad": ("v",)}
DTYPES = [torch.float32, torch.bfloat16]


def _moments(name: str) -> tuple[str, ...]:
    return MOMENTS["Adam" if name.startswith("Adam") else name.split("-")[0]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_slots_and_reads(name: str, dtype: torch.dtype) -> None:
    params = make_params(SHAPES, dtype)
    opt = OPTIMIZERS[name](params)
    run(opt, params, range(2))
    adapter = adapter_for(opt)
    slots = adapter.slots()
    assert [(s.param, s.moment) for s in slots] == [(p, m) for p in params for m in _moments(name)]
    fmt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    assert {s.format for s in slots} == {fmt}
    check_slot_reads(adapter)
    spacing = slots[0].spacing()
    value = slots[0].value()
    nz = value != 0
    assert bool((spacing[nz] <= value[nz].abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 23)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["Adam", "SGD-momentum", "RMSprop-centered"])
def test_codes_track_state(name: str, dtype: torch.dtype) -> None:
    check_codes_track_state(OPTIMIZERS[name], make_params(SHAPES, dtype), lambda state, key: state[key])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_full_reset_equals_fresh(name: str, dtype: torch.dtype) -> None:
    check_full_reset_is_fresh(OPTIMIZERS[name], make_params(SHAPES, dtype))


@pytest.mark.parametrize("name", ["Adam", "SGD-dampening", "RMSprop-centered", "Adagrad"])
def test_reset_only_chosen_params(name: str) -> None:
    check_partial_params(OPTIMIZERS[name], make_params(SHAPES))


@pytest.mark.parametrize("name", ["Adam", "SGD-momentum", "RMSprop-centered", "Adagrad"])
def test_survives_load_state_dict(name: str) -> None:
    check_survives_load(OPTIMIZERS[name], make_params(SHAPES))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["Adam", "Adam-foreach-amsgrad", "AdamW-fused"])
def test_v_only_reset_first_update_is_bounded(name: str, dtype: torch.dtype) -> None:
    make = OPTIMIZERS[name]
    safe = first_update_ratio(make, make_params(SHAPES, dtype), LR, lambda opt: adapter_for(opt).reset(["v"]))
    assert safe <= 1.0 + 1e-3 + (2**-7 * 0.1 / LR if dtype == torch.bfloat16 else 0)  # bf16 params round the step

    def naive(opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            state["exp_avg_sq"].zero_()
            state.get("max_exp_avg_sq", torch.zeros(())).zero_()

    assert first_update_ratio(make, make_params(SHAPES, dtype), LR, naive) > 10 * safe


def test_m_only_reset_keeps_v_and_step() -> None:
    params = make_params(SHAPES)
    opt = torch.optim.Adam(params, lr=LR)
    run(opt, params, range(3))
    v = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    adapter_for(opt).reset(["m"])
    for p, old in zip(params, v):
        assert bool((opt.state[p]["exp_avg"] == 0).all())
        assert torch.equal(opt.state[p]["exp_avg_sq"], old)
        assert int(opt.state[p]["step"]) == 3


def test_lazy_state_and_new_param_groups() -> None:
    params = make_params(SHAPES)
    opt = torch.optim.AdamW(params[:1], lr=LR)
    adapter = adapter_for(opt)
    assert adapter.slots() == []
    run(opt, params[:1], [0])
    assert len(adapter.slots()) == 2
    opt.add_param_group({"params": params[1:]})
    run(opt, params, [1])
    assert {s.param is params[1] for s in adapter.slots()} == {True, False}


def test_lightning_and_deepspeed_style_wrappers_are_unwrapped() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = torch.optim.Adam(make_params(SHAPES), lr=LR)
    assert adapter_for(LightningOptimizer(opt)).optimizer is opt

    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    assert adapter_for(Wrapper(opt)).optimizer is opt


def test_invalid_moments_are_rejected() -> None:
    opt = torch.optim.Adam(make_params(SHAPES), lr=LR)
    with pytest.raises(ValueError, match="moments"):
        adapter_for(opt).reset(["w"])


class _Mystery(torch.optim.Optimizer):
    """An unregistered optimizer with an int counter and two float buffers."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": LR})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["step"], st["avg"], st["var"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                st["avg"].lerp_(p.grad, 0.1)
                st["var"].lerp_(p.grad**2, 0.01)
                p.sub_(group["lr"] * st["avg"] / (st["var"].sqrt() + 1e-8))


def test_unknown_optimizer_strict_error_names_class_and_how_to_register() -> None:
    with pytest.raises(TypeError, match=r"_Mystery.*Supported.*torch\.optim\.adam\.Adam.*register_adapter"):
        adapter_for(_Mystery(make_params(SHAPES)))


def test_unknown_optimizer_generic_fallback() -> None:
    params = make_params(SHAPES)
    opt = _Mystery(params)
    with pytest.warns(UserWarning, match="generic adapter"):
        adapter = adapter_for(opt, strict=False)
    assert isinstance(adapter, GenericAdapter)
    run(opt, params, range(2))
    with pytest.warns(UserWarning, match=r"avg->m, var->v"):
        slots = adapter.slots()
    assert [(s.key, s.moment) for s in slots] == [("avg", "m"), ("var", "v")] * 2
    check_slot_reads(adapter)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapter.slots()  # announced once
    adapter.reset()
    for p in params:
        assert opt.state[p]["step"] == 0
        assert bool((opt.state[p]["avg"] == 0).all() and (opt.state[p]["var"] == 0).all())


def test_register_adapter_validates_arguments() -> None:
    with pytest.raises(TypeError, match="optimizer_cls"):
        register_adapter(int, GenericAdapter)
    with pytest.raises(TypeError, match="adapter_cls"):
        register_adapter(torch.optim.Adam, int)


def test_subclasses_match_their_registered_base() -> None:
    class MyAdam(torch.optim.Adam):
        pass

    opt = MyAdam(make_params(SHAPES), lr=LR)
    assert type(adapter_for(opt)).__name__ == "TorchAdamAdapter"
