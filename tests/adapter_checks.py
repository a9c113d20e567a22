"""Shared checks for the optimizer-adapter tests: each takes a factory ``make(params) -> optimizer`` and runs real
optimizer steps on CPU with fixed pseudo-random gradients."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_stale.adapters import adapter_for
from lightning_stale.adapters.protocol import OptimizerAdapter
from lightning_stale.adapters.sampling import choose_sample

MakeOpt = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def make_params(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype)) for s in shapes]


def set_grads(params: Sequence[Tensor], seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def run(opt: torch.optim.Optimizer, params: Sequence[Tensor], seeds: Sequence[int], scale: float = 1.0) -> None:
    for s in seeds:
        set_grads(params, s, scale)
        opt.step()


def state_tensors(opt: torch.optim.Optimizer, p: Tensor) -> dict[str, object]:
    """A deep copy of the raw state of ``p`` (tensor subclasses flattened to their inner tensors)."""
    out: dict[str, object] = {}
    for key, value in opt.state[p].items():
        if isinstance(value, Tensor) and hasattr(value, "__tensor_flatten__") and type(value) is not Tensor:
            for name in value.__tensor_flatten__()[0]:
                out[f"{key}.{name}"] = getattr(value, name).clone()
        elif isinstance(value, Tensor):
            out[key] = value.clone()
        else:
            out[key] = copy.deepcopy(value)
    return out


def assert_same(a: object, b: object, what: str) -> None:
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                           if b.dtype.itemsize == 1 else b), f"{what} differs"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def assert_states_equal(opt_a, params_a, opt_b, params_b) -> None:
    for i, (pa, pb) in enumerate(zip(params_a, params_b)):
        assert torch.equal(pa, pb), f"param {i} differs"
        sa, sb = state_tensors(opt_a, pa), state_tensors(opt_b, pb)
        assert sa.keys() == sb.keys(), f"param {i} state keys {sa.keys()} != {sb.keys()}"
        for key in sa:
            assert_same(sa[key], sb[key], f"param {i} state {key}")


def check_slot_reads(adapter: OptimizerAdapter) -> None:
    """numel matches the parameter, and the sampled readers agree with the full ones."""
    for slot in adapter.slots():
        assert slot.numel == slot.param.numel() == slot.value().numel(), slot.key
        index = torch.randint(slot.numel, (37,), generator=torch.Generator().manual_seed(0))
        assert torch.equal(slot.codes_at(index), slot.codes().reshape(-1)[index]), slot.key
        assert torch.equal(slot.value_at(index), slot.value()[index]), slot.key
        assert slot.value().dtype == torch.float32
        spacing = slot.spacing()
        if spacing is not None:
            assert torch.equal(slot.spacing_at(index), spacing.reshape(-1)[index]), slot.key
        check_sampled_codes(slot)
        if hasattr(slot, "qmap"):
            check_map_spacing(slot, index)


def check_sampled_codes(slot) -> None:
    """The engine's strided sample reads the same codes as the full reader, and the zero code stores zero."""
    sample = choose_sample("check", slot.param.shape, 256, seed=0, pairs=slot.packed)
    codes = slot.sampled_codes(sample).reshape(-1)
    if slot.packed:
        codes = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1)
    positions = sample.positions()
    assert torch.equal(codes, slot.codes().reshape(-1)[positions]), slot.key
    zero = slot.zero_code()
    if zero is not None:
        assert bool((slot.value()[positions][codes == zero] == 0).all()), slot.key


def check_map_spacing(slot, index: Tensor) -> None:
    """Ulp convention, checked by brute force over the map: the distance from |value| to the next larger magnitude
    on the element's block grid (to the next smaller one at the top)."""
    spacing = slot.spacing().reshape(-1)
    for i in index[:8].tolist():
        scale = float(slot.scale.reshape(-1)[i // slot.block_size])
        mags = torch.unique((slot.qmap.double() * scale).abs())
        a = abs(float(slot.value()[i]))
        larger = mags[mags > a * (1 + 1e-6)]
        expected = float(larger[0]) - a if larger.numel() else a - float(mags[mags < a * (1 - 1e-6)][-1])
        assert abs(float(spacing[i]) - expected) <= 1e-5 * max(expected, 1e-30) + 1e-12, (slot.key, i)


def check_codes_track_state(make: MakeOpt, params: list[nn.Parameter], raw: Callable[[dict, str], Tensor]) -> None:
    """Over a real step, a slot's unchanged codes are exactly the unchanged raw stored values (read by ``raw``)."""
    opt = make(params)
    run(opt, params, [0, 1])
    adapter = adapter_for(opt)
    before = {_sid(s): s.codes().reshape(-1).clone() for s in adapter.slots()}
    raw_before = {_sid(s): raw(state_tensors(opt, s.param), s.key).reshape(-1) for s in adapter.slots()}
    set_grads(params, 2, scale=0.3)
    opt.step()
    changed_any = False
    for slot in adapter.slots():
        unchanged = slot.codes().reshape(-1) == before[_sid(slot)]
        raw_unchanged = raw(state_tensors(opt, slot.param), slot.key).reshape(-1) == raw_before[_sid(slot)]
        assert torch.equal(unchanged, raw_unchanged), slot.key
        changed_any |= not bool(unchanged.all())
    assert changed_any


def _sid(slot) -> tuple[int, str]:
    return id(slot.param), slot.key


def check_full_reset_is_fresh(
    make: MakeOpt, params: list[nn.Parameter], n: int = 3, k: int = 3, moments: Sequence[str] | None = None
) -> None:
    """Reset (``moments``, all by default) after ``n`` steps, then ``k`` steps == a fresh optimizer on copied params,
    bit for bit (params and states)."""
    opt = make(params)
    run(opt, params, range(n))
    adapter_for(opt).reset(moments)
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    fresh = make(twins)
    run(opt, params, range(10, 10 + k))
    run(fresh, twins, range(10, 10 + k))
    assert_states_equal(opt, params, fresh, twins)


def check_partial_params(make: MakeOpt, params: list[nn.Parameter]) -> None:
    """``reset(params=[p0])`` changes p0's state and no other parameter's."""
    opt = make(params)
    run(opt, params, range(3))
    before = [state_tensors(opt, p) for p in params]
    adapter_for(opt).reset(params=[params[0]])
    after = [state_tensors(opt, p) for p in params]
    assert before[0].keys() != after[0].keys() or any(
        not torch.equal(before[0][k], after[0][k]) for k in before[0] if isinstance(before[0][k], Tensor))
    for b, a in zip(before[1:], after[1:]):
        for key in b:
            assert_same(b[key], a[key], key)


def check_survives_load(make: MakeOpt, params: list[nn.Parameter]) -> None:
    """After ``load_state_dict`` the same adapter reads and resets the new state tensors."""
    opt = make(params)
    run(opt, params, range(2))
    adapter = adapter_for(opt)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)  # a checkpoint round trip (deepcopy cannot clone torchao states)
    buffer.seek(0)
    saved = torch.load(buffer)
    old_slots = adapter.slots()
    opt.load_state_dict(saved)
    new_slots = adapter.slots()
    assert len(new_slots) == len(old_slots) > 0
    values = [slot.value().clone() for slot in old_slots]
    adapter.reset()
    for slot, value in zip(new_slots, values):
        assert not torch.equal(slot.value(), value), f"{slot.key}: the loaded state was not reset"
    for slot, value in zip(old_slots, values):
        assert torch.equal(slot.value(), value), f"{slot.key}: a stale reference was reset"


def first_update_ratio(
    make: MakeOpt, params: list[nn.Parameter], lr: float, reset: Callable[[torch.optim.Optimizer], None]
) -> float:
    """Largest |update| / lr of the step right after ``reset``, with the gradient of the last step repeated.

    History: 20 steps with large gradients (so the kept m dwarfs the new gradient), then one small-gradient step."""
    opt = make(params)
    run(opt, params, range(20), scale=3.0)
    set_grads(params, 99, scale=0.05)
    opt.step()
    reset(opt)
    before = [p.detach().float().clone() for p in params]
    opt.step()
    return max(float(((p.detach().float() - b).abs() / lr).max()) for p, b in zip(params, before))


def check_reset_in_place(make: MakeOpt, params: list[nn.Parameter], moments: Sequence[str] | None = None) -> None:
    """A reset writes into the state tensors it found (GradScaler and FSDP keep references): after it every state
    entry is the same tensor object on the same storage, and no entry appeared or vanished."""
    opt = make(params)
    run(opt, params, range(3))
    before = [{k: (v, v.data_ptr()) for k, v in opt.state[p].items() if isinstance(v, Tensor)} for p in params]
    adapter_for(opt).reset(moments)
    for i, (p, old) in enumerate(zip(params, before)):
        now = {k: v for k, v in opt.state[p].items() if isinstance(v, Tensor)}
        assert now.keys() == old.keys(), f"param {i}: state keys {now.keys()} != {old.keys()}"
        for key, (tensor, pointer) in old.items():
            assert now[key] is tensor and tensor.data_ptr() == pointer, f"param {i} state {key} was replaced"


def zero_keys(keys: Sequence[str]) -> Callable[[torch.optim.Optimizer], None]:
    """The naive reset that zeroes the state entries ``keys`` (where present) and keeps everything else."""

    def reset(opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            for key in keys:
                if key in state:
                    state[key].zero_()

    return reset


def reset_update_ratios(
    make: MakeOpt, shapes: Sequence[tuple[int, ...]], lr: float, v_keys: Sequence[str],
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """:func:`first_update_ratio` after each kind of reset (``"none"`` for no reset, ``"zero v"`` for zeroing the
    ``v_keys`` entries and keeping ``step``), each from fresh parameters of ``shapes``."""
    kinds: dict[str, Callable[[torch.optim.Optimizer], None]] = {
        "v-only": lambda opt: adapter_for(opt).reset(["v"]),
        "m-only": lambda opt: adapter_for(opt).reset(["m"]),
        "full": lambda opt: adapter_for(opt).reset(),
        "none": lambda opt: None,
        "zero v": zero_keys(v_keys),
    }
    return {kind: first_update_ratio(make, make_params(shapes, dtype), lr, fn) for kind, fn in kinds.items()}


if __name__ == "__main__":  # the table in docs/adapters.md: python tests/adapter_checks.py [bfloat16]
    import functools
    import sys

    lr = 1e-2
    dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
    torch_optimizers = {
        "Adam": (torch.optim.Adam, ("exp_avg_sq",)),
        "NAdam": (torch.optim.NAdam, ("exp_avg_sq",)),
        "RAdam": (torch.optim.RAdam, ("exp_avg_sq",)),
        "Adamax": (torch.optim.Adamax, ("exp_inf",)),
        "Adafactor": (torch.optim.Adafactor, ("row_var", "col_var", "variance")),
    }
    print(f"largest |update| / lr in the step after a reset, 64x64 weight and bias, {dtype}")
    for name, (cls, keys) in torch_optimizers.items():
        ratios = reset_update_ratios(functools.partial(cls, lr=lr), [(64, 64), (64,)], lr, keys, dtype)
        print(f"{name:10s}", "  ".join(f"{kind}: {ratio:.3g}" for kind, ratio in ratios.items()))
