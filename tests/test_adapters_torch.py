"""torch.optim adapters: Adam/AdamW (for-loop, foreach, fused), NAdam, RAdam, Adamax, Adafactor, SGD momentum, RMSprop,
Adagrad, fp32 and bf16."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import pytest
import torch
from adapter_checks import (
    check_codes_track_state,
    check_full_reset_is_fresh,
    check_partial_params,
    check_reset_in_place,
    check_slot_reads,
    check_survives_load,
    first_update_ratio,
    make_params,
    reset_update_ratios,
    run,
    zero_keys,
)
from torch import nn

from lightning_stale.adapters import adapter_for, register_adapter
from lightning_stale.adapters.generic import GenericAdapter
from lightning_stale.adapters.layouts import dtype_ulp

SHAPES = [(8, 16), (16,)]
LR = 1e-2


def _differentiable(cls: type[torch.optim.Optimizer], **kwargs) -> Callable[[list[nn.Parameter]],
                                                                         torch.optim.Optimizer]:
    """A factory for ``cls(differentiable=True)``: its step runs under autograd, so the params must not require
    grad (in-place updates of leaves that do are refused)."""

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        for p in params:
            p.requires_grad_(False)
        return cls(params, lr=LR, differentiable=True, **kwargs)

    return make


OPTIMIZERS = {
    "Adam": functools.partial(torch.optim.Adam, lr=LR),
    "Adam-foreach-amsgrad": functools.partial(torch.optim.Adam, lr=LR, foreach=True, amsgrad=True),
    "AdamW-fused": functools.partial(torch.optim.AdamW, lr=LR, fused=True),
    "AdamW-foreach": functools.partial(torch.optim.AdamW, lr=LR, foreach=True),
    "NAdam": functools.partial(torch.optim.NAdam, lr=LR),
    "NAdam-foreach-decoupled": functools.partial(torch.optim.NAdam, lr=LR, foreach=True, weight_decay=0.1,
                                                 decoupled_weight_decay=True, momentum_decay=0.01),
    "NAdam-differentiable-maximize-wd": _differentiable(torch.optim.NAdam, maximize=True, weight_decay=0.1),
    "RAdam": functools.partial(torch.optim.RAdam, lr=LR),
    "RAdam-foreach-decoupled": functools.partial(torch.optim.RAdam, lr=LR, foreach=True, weight_decay=0.1,
                                                 decoupled_weight_decay=True),
    "RAdam-differentiable-maximize-wd": _differentiable(torch.optim.RAdam, maximize=True, weight_decay=0.1),
    "Adamax": functools.partial(torch.optim.Adamax, lr=LR),
    "Adamax-foreach-maximize-wd": functools.partial(torch.optim.Adamax, lr=LR, foreach=True, maximize=True,
                                                    weight_decay=0.1),
    "Adamax-differentiable": _differentiable(torch.optim.Adamax),
    "Adafactor": functools.partial(torch.optim.Adafactor, lr=LR),
    "Adafactor-foreach-wd": functools.partial(torch.optim.Adafactor, lr=LR, foreach=True, weight_decay=0.1),
    "SGD-momentum": functools.partial(torch.optim.SGD, lr=LR, momentum=0.9),
    "SGD-dampening": functools.partial(torch.optim.SGD, lr=LR, momentum=0.9, dampening=0.1),
    "RMSprop-centered": functools.partial(torch.optim.RMSprop, lr=LR, momentum=0.5, centered=True),
    "Adagrad": functools.partial(torch.optim.Adagrad, lr=LR, initial_accumulator_value=0.1),
}
MOMENTS = {"Adam": ("m", "v"), "AdamW": ("m", "v"), "NAdam": ("m", "v"), "RAdam": ("m", "v"), "Adamax": ("m", "v"),
           "Adafactor": ("v",), "SGD": ("m",), "RMSprop": ("v",), "Adagrad": ("v",)}
# The state entries a naive v reset zeroes (keeping step), per family.
V_KEYS = {"Adam": ("exp_avg_sq", "max_exp_avg_sq"), "AdamW": ("exp_avg_sq",), "NAdam": ("exp_avg_sq",),
          "RAdam": ("exp_avg_sq",), "Adamax": ("exp_inf",), "Adafactor": ("row_var", "col_var", "variance")}
DTYPES = [torch.float32, torch.bfloat16]


def _family(name: str) -> str:
    return name.split("-")[0]


def _slot_moments(name: str, p: torch.Tensor) -> tuple[str, ...]:
    """The moments of ``p``'s slots: Adafactor's matrices keep two factors of v (``row_var``, ``col_var``)."""
    if _family(name) == "Adafactor" and p.dim() > 1:
        return ("v", "v")
    return MOMENTS[_family(name)]


def _as_read(state: dict, key: str) -> torch.Tensor:
    """``state[key]`` as its slot reads it: an Adafactor factor spread over its matrix (the shape both factors
    broadcast to)."""
    if key in ("row_var", "col_var"):
        return torch.broadcast_tensors(state["row_var"], state["col_var"])[key == "col_var"]
    return state[key]


def _slack(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> float:
    """What a measured |update| / lr holds besides the adaptive step: decoupled weight decay (``wd |p|``) and, for
    low-precision parameters, their rounding (one ulp of the largest; NAdam writes the parameter twice)."""
    group = opt.param_groups[0]
    decay = group["weight_decay"] * max(float(p.detach().abs().max()) for p in params) if group.get(
        "decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)) else 0.0
    if params[0].dtype == torch.float32:
        return decay
    return decay + max(float(dtype_ulp(p.detach()).max()) for p in params) / LR


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_slots_and_reads(name: str, dtype: torch.dtype) -> None:
    params = make_params(SHAPES, dtype)
    opt = OPTIMIZERS[name](params)
    run(opt, params, range(2))
    adapter = adapter_for(opt)
    slots = adapter.slots()
    expected = [(p, m) for p in params for m in _slot_moments(name, p)]
    assert [(s.param, s.moment) for s in slots] == expected
    fmt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    assert {s.format for s in slots} == {fmt}
    check_slot_reads(adapter)
    spacing = slots[0].spacing()
    value = slots[0].value()
    nz = value != 0
    assert bool((spacing[nz] <= value[nz].abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 23)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["Adam", "NAdam", "RAdam", "Adamax", "Adafactor", "SGD-momentum", "RMSprop-centered"])
def test_codes_track_state(name: str, dtype: torch.dtype) -> None:
    check_codes_track_state(OPTIMIZERS[name], make_params(SHAPES, dtype), _as_read)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_full_reset_equals_fresh(name: str, dtype: torch.dtype) -> None:
    check_full_reset_is_fresh(OPTIMIZERS[name], make_params(SHAPES, dtype))


@pytest.mark.parametrize("moments", [None, ("m",), ("v",)], ids=str)
@pytest.mark.parametrize("name", ["Adam-foreach-amsgrad", "NAdam-foreach-decoupled", "RAdam", "Adamax",
                                  "Adafactor-foreach-wd"])
def test_resets_write_in_place(name: str, moments: tuple[str, ...] | None) -> None:
    check_reset_in_place(OPTIMIZERS[name], make_params(SHAPES), moments)


@pytest.mark.parametrize("name", ["Adam", "NAdam", "RAdam", "Adamax", "Adafactor", "SGD-dampening",
                                  "RMSprop-centered", "Adagrad"])
def test_reset_only_chosen_params(name: str) -> None:
    check_partial_params(OPTIMIZERS[name], make_params(SHAPES))


@pytest.mark.parametrize("name", ["Adam", "NAdam", "Adamax", "Adafactor", "SGD-momentum", "RMSprop-centered",
                                  "Adagrad"])
def test_survives_load_state_dict(name: str) -> None:
    check_survives_load(OPTIMIZERS[name], make_params(SHAPES))


@pytest.mark.parametrize("name", ["NAdam", "RAdam", "Adamax", "Adafactor"])
def test_reported_moments_and_betas(name: str) -> None:
    """Only EMAs with a constant beta report one: Adamax's exp_inf is a decayed max, Adafactor's beta2 a schedule."""
    params = make_params(SHAPES)
    opt = OPTIMIZERS[name](params)
    run(opt, params, range(2))
    expected = {"NAdam": [("exp_avg", "m", 0.9), ("exp_avg_sq", "v", 0.999)] * 2,
                "RAdam": [("exp_avg", "m", 0.9), ("exp_avg_sq", "v", 0.999)] * 2,
                "Adamax": [("exp_avg", "m", 0.9), ("exp_inf", "v", None)] * 2,
                "Adafactor": [("row_var", "v", None), ("col_var", "v", None), ("variance", "v", None)]}[name]
    assert [(s.key, s.moment, s.beta) for s in adapter_for(opt).slots()] == expected  # the matrix, then the vector


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["Adam", "Adam-foreach-amsgrad", "AdamW-fused", "NAdam", "NAdam-foreach-decoupled",
                                  "NAdam-differentiable-maximize-wd", "RAdam", "RAdam-foreach-decoupled",
                                  "RAdam-differentiable-maximize-wd", "Adamax", "Adamax-foreach-maximize-wd"])
def test_v_only_reset_first_update_is_bounded(name: str, dtype: torch.dtype) -> None:
    """The bounded restart keeps the next update within lr (plus the rounding of bf16 parameters); zeroing v and
    keeping step does not (m / eps where the gradient is small)."""
    make = OPTIMIZERS[name]
    params = make_params(SHAPES, dtype)
    safe = first_update_ratio(make, params, LR, lambda opt: adapter_for(opt).reset(["v"]))
    assert safe <= 1.0 + 1e-3 + _slack(make(make_params(SHAPES, dtype)), params)
    assert first_update_ratio(make, make_params(SHAPES, dtype), LR, zero_keys(V_KEYS[_family(name)])) > 10 * safe


@pytest.mark.parametrize("name", ["Adam", "NAdam", "RAdam", "Adamax"])
def test_m_only_reset_keeps_v_and_step(name: str) -> None:
    params = make_params(SHAPES)
    opt = OPTIMIZERS[name](params)
    run(opt, params, range(3))
    kept = [{k: v.clone() for k, v in opt.state[p].items() if k != "exp_avg"} for p in params]
    adapter_for(opt).reset(["m"])
    for p, old in zip(params, kept):
        assert bool((opt.state[p]["exp_avg"] == 0).all())
        for key, value in old.items():  # v, step and NAdam's mu_product
            assert torch.equal(opt.state[p][key], value), key
        assert int(opt.state[p]["step"]) == 3
    # the next update is smaller than a normal step: (1 - beta1) of the gradient, or less, over the kept v
    assert first_update_ratio(OPTIMIZERS[name], make_params(SHAPES), LR, lambda o: adapter_for(o).reset(["m"])) < 0.1


def test_update_ratios_after_each_reset_kind() -> None:
    """The documented table (docs/adapters.md) on small tensors: bounded restarts, sign-like steps after full
    resets, and the unbounded naive v reset they replace."""
    ratios = {name: reset_update_ratios(OPTIMIZERS[name], SHAPES, LR, V_KEYS[name])
              for name in ("NAdam", "RAdam", "Adamax", "Adafactor")}
    for name in ("NAdam", "Adamax"):
        assert ratios[name]["v-only"] <= 1.0 + 1e-3 and ratios[name]["zero v"] > 100
    assert ratios["NAdam"]["full"] == pytest.approx(1.056, abs=1e-3)  # NAdam's own first step: (1 + c_m (1 - beta1))
    assert ratios["RAdam"]["v-only"] < ratios["RAdam"]["full"] < 1  # rectified: RAdam's early steps are small
    # Adafactor's v reset is its full reset (an exact fresh state); update clipping bounds even the naive one
    assert ratios["Adafactor"]["v-only"] == ratios["Adafactor"]["full"] == ratios["Adafactor"]["zero v"]
    assert ratios["Adafactor"]["m-only"] == ratios["Adafactor"]["none"]  # no first moment: nothing to reset


def test_adafactor_v_reset_is_the_exact_fresh_state_and_covers_factored_matrices() -> None:
    params = make_params(SHAPES)
    check_full_reset_is_fresh(OPTIMIZERS["Adafactor"], params, moments=("v",))
    opt = OPTIMIZERS["Adafactor"](params)
    run(opt, params, range(3))
    adapter = adapter_for(opt)
    assert adapter.exact_moment_reset
    assert [(s.param, s.key) for s in adapter.slots()] == [(params[0], "row_var"), (params[0], "col_var"),
                                                          (params[1], "variance")]
    adapter.reset(["v"], params=[params[0]])
    state = opt.state[params[0]]
    assert int(state["step"]) == 0 and not state["row_var"].any() and not state["col_var"].any()


def test_nadam_full_reset_restores_mu_product() -> None:
    params = make_params(SHAPES)
    opt = OPTIMIZERS["NAdam"](params)
    run(opt, params, range(5))
    mu_product = opt.state[params[0]]["mu_product"]
    assert float(mu_product) < 0.1
    adapter_for(opt).reset()
    assert opt.state[params[0]]["mu_product"] is mu_product and float(mu_product) == 1.0


@pytest.mark.parametrize("name", ["NAdam", "RAdam", "Adamax", "Adafactor"])
def test_monitor_measures_and_resets_through_the_new_adapters(name: str) -> None:
    """End to end: the monitor tracks the slots and its periodic v resets run."""
    from lightning_stale import StaleStateMonitor

    params = make_params(SHAPES)
    opt = OPTIMIZERS[name](params)
    with StaleStateMonitor(opt, reset="periodic", every=2, moments=("v",)) as monitor:
        run(opt, params, range(5))
        metrics = monitor.compute()
    assert metrics["stale/resets"] == 2  # reset events, after steps 2 and 4


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


class _Damped(torch.optim.Optimizer):
    """An unregistered optimizer that, like NAdam, keeps scalars beside its buffers: a 0-dim tensor product that
    bias-corrects its EMA, a Python float and a bool mask."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": LR})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=torch.tensor(0.0), decay_product=torch.tensor(1.0), peak=0.0,
                              ema=torch.zeros_like(p), seen=torch.zeros_like(p, dtype=torch.bool))
                st["step"] += 1
                st["decay_product"] *= 0.9
                st["peak"] = max(st["peak"], float(p.grad.abs().max()))
                st["seen"] |= p.grad != 0
                st["ema"].lerp_(p.grad, 0.1)
                p.sub_(group["lr"] * st["ema"] / (1 - st["decay_product"]))


def test_generic_warning_names_what_a_reset_leaves_alone() -> None:
    params = make_params(SHAPES)
    opt = _Damped(params)
    with pytest.warns(UserWarning, match="generic adapter"):
        adapter = adapter_for(opt, strict=False)
    run(opt, params, range(2))
    with pytest.warns(UserWarning) as record:
        assert [s.key for s in adapter.slots()] == ["ema", "ema"]
    message = str(record[0].message)
    assert "guessed the state slots ema->m" in message and "beta unknown" in message
    assert "leaves decay_product (0-dim tensor), peak (float), seen (bool tensor) alone on reset" in message
    assert "step" not in message  # step is handled: zeroed by a reset of every moment
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapter.reset()  # announced once, whether slots() or reset() sees the keys first
    assert float(opt.state[params[0]]["decay_product"]) == pytest.approx(0.81)  # what the warning said: left alone
    assert int(opt.state[params[0]]["step"]) == 0


def test_generic_reset_warns_before_any_slots_read() -> None:
    params = make_params(SHAPES)
    with pytest.warns(UserWarning, match="generic adapter"):
        adapter = adapter_for(_Damped(params), strict=False)
    run(adapter.optimizer, params, range(1))
    with pytest.warns(UserWarning, match=r"leaves decay_product \(0-dim tensor\)"):
        adapter.reset(["m"])


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
