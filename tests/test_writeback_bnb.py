"""The weight write-back's bitsandbytes families: Adam/AdamW and Lion, 8-bit block-wise, paged and 32-bit."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import writeback_checks as checks
from lightning_stale.act.writeback import WeightWriteBack, kernels

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes")
warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
bnb_family = pytest.importorskip("lightning_stale.act.writeback.families.bnb")

LR = 1e-2
KW = dict(lr=LR, weight_decay=0.1)

# Each computes in fp32 from its stored codes (or fp32 states) and the gradient; the write-back does its whole step
# with its own ops: nearest rounding writes its weights, codes and scales bit for bit.
OPTIMIZERS = {
    "adamw_8bit": lambda p: bnb.optim.AdamW8bit(p, **KW, min_8bit_size=256),
    "adam_8bit": lambda p: bnb.optim.Adam8bit(p, **KW, min_8bit_size=256),
    "paged_adamw_8bit": lambda p: bnb.optim.PagedAdamW8bit(p, **KW, min_8bit_size=256),
    "adamw_32bit": lambda p: bnb.optim.AdamW(p, **KW, optim_bits=32),
    "lion_8bit": lambda p: bnb.optim.Lion8bit(p, lr=1e-3, weight_decay=0.1, min_8bit_size=256),
    "lion_32bit": lambda p: bnb.optim.Lion32bit(p, lr=1e-3, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("closure", [True, False], ids=["closure", "plain-loop"])
def test_nearest_rounding_is_bitsandbytes_own_step_bit_for_bit(name, closure):
    lr = 1e-3 if name.startswith("lion") else LR
    assert checks.conformance(OPTIMIZERS[name], lr, closure=closure) == (0.0, 0.0, True)


@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
def test_lion_weights_move_where_nearest_rounding_stalls_them(rounding):
    """Lion moves every weight by exactly lr: at lr 1e-3 a bf16 weight of magnitude 1 (gap 2^-7) never moves under
    nearest rounding; with the write-back it follows the exact path (to within the residual's own rounding)."""
    runs = {}
    for mode in ("nearest", rounding):
        weight = torch.nn.Parameter(torch.ones(1 << 14, dtype=torch.bfloat16))
        opt = bnb.optim.Lion8bit([weight], lr=1e-3, weight_decay=0.0, min_8bit_size=256)
        weight.grad = torch.ones_like(weight)
        opt.step()
        writeback = WeightWriteBack(opt, mode)
        for _ in range(100):
            weight.grad = torch.ones_like(weight)
            opt.step()
        writeback.close()
        buffer = opt.state[weight].get("lightning_stale.compensation")
        runs[mode] = (weight.float() + (0 if buffer is None else buffer.float())).mean().item()
    assert runs["nearest"] == 1.0
    assert runs[rounding] == pytest.approx(1.0 - 100e-3, abs=1e-3)


@pytest.mark.parametrize("name", ["adamw_8bit", "lion_8bit"])
def test_updates_stay_near_lr(name):
    """Largest |update| / lr beyond the rounding's share, with rows that stop getting gradient (measured 1.0)."""
    lr = 1e-3 if name.startswith("lion") else LR
    assert checks.largest_update(OPTIMIZERS[name], lr, "compensated") < 1.5


@pytest.mark.parametrize("setting,match", [("max_unorm", "max_unorm"), ("skip_zeros", "skip_zeros"),
                                           ("moments", "moments='stochastic'")])
def test_refused_configurations_say_why(setting, match):
    opt = bnb.optim.AdamW8bit(checks.model().parameters())
    if setting == "max_unorm":
        opt.args.max_unorm = 1.0
    elif setting == "skip_zeros":
        opt.args.skip_zeros = True
    with pytest.raises(ValueError, match=match):
        WeightWriteBack(opt, moments="stochastic" if setting == "moments" else "nearest")


def test_other_bitsandbytes_kernels_are_refused_by_name():
    with pytest.raises(ValueError, match="AdEMAMix8bit: not a supported optimizer family"):
        WeightWriteBack(bnb.optim.AdEMAMix8bit(checks.model().parameters()))


# Pieces: each parameter is stepped in pieces of whole blocks; with pieces of 512 elements (two blocks) these sizes
# straddle them (empty, one element, partial and whole blocks, partial and whole pieces, 2-D).
SHAPES = [(0,), (1,), (255,), (256,), (511,), (512,), (513,), (1024,), (1300,), (40, 33)]
PIECES = {
    "adamw_8bit": lambda p: bnb.optim.AdamW8bit(p, **KW, min_8bit_size=0),
    "adamw_32bit": lambda p: bnb.optim.AdamW(p, **KW, optim_bits=32),
    "lion_8bit": lambda p: bnb.optim.Lion8bit(p, lr=1e-3, weight_decay=0.1, min_8bit_size=0),
    "lion_32bit": lambda p: bnb.optim.Lion32bit(p, lr=1e-3, weight_decay=0.1),
}


def stepped(make, shapes, rounding, steps=3, poison=False):
    """(weights, compensation buffers, state tensors) after the optimizer's first step and ``steps`` steps of the
    write-back, from fixed weights and gradients (``poison``: :func:`poisoned` ones in the write-back's steps)."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in shapes]
    opt = make(params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()
    opt.step()
    writeback = WeightWriteBack(opt, rounding, seed=7)
    for _ in range(steps):
        for p in params:
            p.grad = poisoned(p.numel(), gen)[0].view(p.shape) if poison else torch.randn(p.shape, generator=gen)\
                .bfloat16()
        opt.step()
    writeback.close()
    buffers = [opt.state[p].get("lightning_stale.compensation") for p in params]
    return [p.detach().clone() for p in params], buffers, checks.state_tensors(opt)


def same_bits(a, b):
    """Tensors (or None) equal bit for bit, NaNs included."""
    if a is None or b is None:
        return a is b
    if a.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32}
        a, b = a.view(bits[a.element_size()]), b.view(bits[b.element_size()])
    return a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(PIECES))
@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
def test_pieces_write_the_bits_of_one_pass(name, rounding, monkeypatch):
    """Stepped in pieces of 512 elements, every weight, residual, code and absmax is the one-pass step's, bit for bit
    (the stochastic noise continues at each piece's offset)."""
    whole = stepped(PIECES[name], SHAPES, rounding)
    monkeypatch.setattr(kernels, "EAGER_CHUNK", 512)
    cpu = torch.device("cpu")
    assert [len(bnb_family.pieces(math.prod(s), cpu)) for s in SHAPES] == [0, 1, 1, 1, 1, 1, 2, 2, 3, 3]
    pieces = stepped(PIECES[name], SHAPES, rounding)
    for before, after in zip(whole, pieces):
        assert len(before) == len(after) and all(same_bits(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_pieces_are_bitsandbytes_own_step_bit_for_bit(name, monkeypatch):
    """The conformance check with pieces of 512 elements (the model's 64 x 96 weight in 12 of them)."""
    monkeypatch.setattr(kernels, "EAGER_CHUNK", 512)
    lr = 1e-3 if name.startswith("lion") else LR
    assert checks.conformance(OPTIMIZERS[name], lr, closure=False) == (0.0, 0.0, True)


class LiveBytes(TorchDispatchMode):
    """The most bytes that tensors created under it hold at once: every op's outputs that alias none of its inputs
    (views and in-place results left out), each counted until its storage is freed."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        for result, returned in zip(results, func._schema.returns):
            if isinstance(result, torch.Tensor) and returned.alias_info is None:
                storage = result.untyped_storage()
                self.live.append((StorageWeakRef(storage), storage.nbytes()))
        self.live = [(ref, size) for ref, size in self.live if not ref.expired()]
        self.peak = max(self.peak, sum(size for _, size in self.live))
        return out


def step_peak(make, numel, rounding, poison=False):
    """The most bytes the write-back's second step of one bf16 parameter of ``numel`` elements creates at once (its
    first creates the compensation buffer)."""
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen).bfloat16())
    opt = make([param])
    param.grad = torch.randn(numel, generator=gen).bfloat16()
    opt.step()
    writeback = WeightWriteBack(opt, rounding)
    live = LiveBytes()
    for measured in (False, True):
        param.grad = torch.randn(numel, generator=gen).bfloat16()
        if poison:
            param.grad[::97] = float("nan")
        with live if measured else contextlib.nullcontext():
            opt.step()
    writeback.close()
    return live.peak


@pytest.mark.parametrize("name,rounding,poison", [("adamw_8bit", "stochastic", False),
                                                  ("adamw_8bit", "compensated", True),
                                                  ("lion_8bit", "stochastic", True),
                                                  ("adamw_32bit", "compensated", False)])
def test_peak_memory_is_a_constant_not_a_multiple_of_the_parameter(name, rounding, poison, monkeypatch):
    """The step's temporaries are bounded by the piece: a parameter of 64 pieces creates no more at once than one of
    2 (at most 32 bytes per element of a piece, measured), where its one-pass step creates 64 times as much."""
    if poison:
        monkeypatch.setattr(bnb_family, "cuda_kernels", lambda device: True)
    make = PIECES[name]
    one_pass = step_peak(make, 64 * 4096, rounding, poison)
    monkeypatch.setattr(kernels, "EAGER_CHUNK", 4096)
    small, large = step_peak(make, 2 * 4096, rounding, poison), step_peak(make, 64 * 4096, rounding, poison)
    assert large <= small <= 40 * 4096
    assert one_pass > 20 * large


def poisoned(numel, gen):
    """A flat bf16 gradient of ``numel`` (over 300) elements with NaN, +Inf, -Inf and NaN at its elements 3, 257, 300
    and its last (three blocks of 256), and the mask of its finite elements."""
    grad = torch.randn(numel, generator=gen).bfloat16()
    grad[[3, 257, 300, -1]] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")]).bfloat16()
    return grad, grad.isfinite()


# Non-finite gradient elements: bitsandbytes' CPU kernel lets them run through its arithmetic, its CUDA kernels treat
# them as below; the write-back follows the kernels of the optimizer's device (here forced to CUDA's on CPU tensors).
def cuda_adam_8bit(weight, grad, state, config):
    """bitsandbytes' 8-bit block-wise Adam/AdamW step as its CUDA kernel takes it
    (``kOptimizerStatic8bit2StateBlockwise``, ``csrc/kernels.cu`` of bitsandbytes 0.50.1), element by element: an
    element whose gradient is NaN or +-Inf gets s1 = s2 = 0 (lines 1034-1036) and its weight is left as it is, decay
    included (lines 1092-1105); the others take the update (here in the op order of its CPU kernel, which the
    write-back computes on every device); each block is requantized with its absmax over the new values (zeros for
    those elements). Returns the weight and the state (step, codes and absmax of m, of v)."""
    (beta1, beta2), lr, eps, wd, step = config["betas"][:2], config["lr"], config["eps"], config["weight_decay"], \
        state["step"] + 1
    ops = torch.ops.bitsandbytes
    m = ops.dequantize_blockwise(state["state1"], state["absmax1"], state["qmap1"], 256, torch.float32)
    v = ops.dequantize_blockwise(state["state2"], state["absmax2"], state["qmap2"], 256, torch.float32)
    new = weight.float().mul(1.0 - lr * wd)
    out, m_out, v_out = weight.clone(), torch.zeros_like(m), torch.zeros_like(v)
    for j in range(weight.numel()):
        g = grad[j].float()
        if not torch.isfinite(g):
            continue  # s1 = s2 = 0; p as it was
        m_out[j] = m[j].mul(beta1).add(g, alpha=1.0 - beta1)
        v_out[j] = v[j].mul(beta2).addcmul(g, g, value=1.0 - beta2)
        denom = (v_out[j].sqrt() / math.sqrt(1.0 - beta2**step)).add(eps)
        out[j] = new[j].addcdiv(m_out[j], denom, value=-lr / (1.0 - beta1**step))
    return out, [step, *ops.quantize_blockwise(m_out, state["qmap1"], 256),
                 *ops.quantize_blockwise(v_out, state["qmap2"], 256)]


def taken_over(make, numel, rounding, gen, steps=2):
    """(a bf16 parameter, its optimizer, the write-back) after the optimizer's first step and ``steps`` steps of the
    write-back (residuals to keep, with compensated rounding)."""
    weight = torch.nn.Parameter(torch.randn(numel, generator=gen).bfloat16())
    opt = make([weight])
    weight.grad = torch.randn(numel, generator=gen).bfloat16()
    opt.step()
    writeback = WeightWriteBack(opt, rounding)
    for _ in range(steps):
        weight.grad = torch.randn(numel, generator=gen).bfloat16()
        opt.step()
    return weight, opt, writeback


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "compensated"])
def test_cuda_adam_8bit_zeroes_the_moments_and_keeps_the_weight_of_non_finite_gradient_elements(rounding,
                                                                                                monkeypatch):
    monkeypatch.setattr(bnb_family, "cuda_kernels", lambda device: True)
    gen = torch.Generator().manual_seed(4)
    weight, opt, writeback = taken_over(PIECES["adamw_8bit"], 1000, rounding, gen)  # 4 blocks, the last one partial
    state = opt.state[weight]
    buffer = state.get("lightning_stale.compensation")
    kept = [weight.detach().clone(), None if buffer is None else buffer.clone()]
    weight.grad, finite = poisoned(1000, gen)
    expected_weight, expected_state = cuda_adam_8bit(weight.detach(), weight.grad, state,
                                                     opt.get_config(0, 0, opt.param_groups[0]))
    opt.step()
    writeback.close()
    stored = [state[k] for k in ("step", "state1", "absmax1", "state2", "absmax2")]
    # the kernel's rule at the non-finite elements: weight (and residual) bits as they were, m = v = 0
    assert same_bits(weight.detach()[~finite], kept[0][~finite])
    assert buffer is None or same_bits(buffer[~finite], kept[1][~finite])
    zero = [torch.ops.bitsandbytes.quantize_blockwise(torch.tensor([0.0, 1.0]), state[f"qmap{n}"], 256)[0][0]
            for n in (1, 2)]  # the codes of 0 (bitsandbytes' CPU op gives 0 the code of its map's nearest value above)
    assert (state["state1"][~finite] == zero[0]).all() and (state["state2"][~finite] == zero[1]).all()
    assert state["absmax1"].isfinite().all() and state["absmax2"].isfinite().all()
    assert (weight.detach()[finite] != kept[0][finite]).float().mean() > 0.5
    # the codes and scales of every block are the reference's (the zeros in the absmax); with nearest rounding the
    # weights too
    assert stored[0] == expected_state[0] and all(same_bits(a, b) for a, b in zip(stored[1:], expected_state[1:]))
    assert rounding != "nearest" or same_bits(weight.detach(), expected_weight)


def test_cuda_adam_32bit_lets_non_finite_gradients_through_as_on_cpu(monkeypatch):
    """``kOptimizer32bit2State`` tests no gradient element: NaN and Inf run into m, v and the weight, as on CPU."""
    on_cpu = stepped(PIECES["adamw_32bit"], [(1000,)], "stochastic", poison=True)
    monkeypatch.setattr(bnb_family, "cuda_kernels", lambda device: True)
    on_cuda = stepped(PIECES["adamw_32bit"], [(1000,)], "stochastic", poison=True)
    assert on_cpu[0][0].isnan().any()
    for a, b in zip(on_cpu, on_cuda):
        assert all(same_bits(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["lion_8bit", "lion_32bit"])
def test_lion_decays_without_moving_the_weight_of_nan_gradient_elements(name, monkeypatch):
    """Lion's CUDA kernels test no gradient element, but their ``sgn`` is 0 for NaN, as torch's sign (its CPU
    kernel's) is: a NaN gradient element's weight is decayed only (lr * weight_decay), on either kernels; +-Inf move it
    by lr. The state is the same either way (nearest rounding: the optimizer's own weights)."""
    runs = {}
    for cuda in (False, True):
        monkeypatch.setattr(bnb_family, "cuda_kernels", lambda device: cuda)
        gen = torch.Generator().manual_seed(5)
        weight, opt, writeback = taken_over(PIECES[name], 1000, "nearest", gen)
        before = weight.detach().clone()
        weight.grad, finite = poisoned(1000, gen)
        opt.step()
        writeback.close()
        runs[cuda] = before, weight.detach().clone(), checks.state_tensors(opt)
    (before, on_cpu, cpu_state), (_, on_cuda, cuda_state) = runs[False], runs[True]
    nan = weight.grad.isnan()
    assert same_bits(on_cuda, on_cpu) and all(same_bits(a, b) for a, b in zip(cpu_state, cuda_state))
    decayed = before.float().mul(1.0 - 1e-3 * 0.1)
    assert same_bits(on_cuda[nan], decayed[nan].bfloat16())
    infinite = ~finite & ~nan
    assert same_bits(on_cuda[infinite], decayed[infinite].add(weight.grad[infinite].float().sign(), alpha=-1e-3)
                     .bfloat16())


@pytest.mark.parametrize("name", sorted(PIECES))
def test_cpu_kernels_are_bitsandbytes_own_step_with_non_finite_gradients(name):
    """Where the optimizer runs on CPU, the write-back's step with NaN and Inf gradient elements is bitsandbytes' own
    CPU step, bit for bit (NaNs included)."""
    results = []
    for rounding in (None, "nearest"):
        gen = torch.Generator().manual_seed(6)
        weight = torch.nn.Parameter(torch.randn(1000, generator=gen).bfloat16())
        opt = PIECES[name]([weight])
        weight.grad = torch.randn(1000, generator=gen).bfloat16()
        opt.step()
        writeback = None if rounding is None else WeightWriteBack(opt, rounding)
        weight.grad = poisoned(1000, gen)[0]
        opt.step()
        if writeback is not None:
            writeback.close()
        results.append([weight.detach().clone(), *checks.state_tensors(opt)])
    assert results[0][0].isnan().any() or name.startswith("lion")
    assert all(same_bits(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_32bit"])
def test_states_bitsandbytes_created_strided_are_stepped_whole(name):
    """A parameter transposed at the optimizer's first step gets states with its strides (bitsandbytes then makes the
    parameter contiguous, not them): such a parameter is stepped whole, in the states' shape, as bitsandbytes' own
    step, bit for bit."""
    runs = []
    for rounding in (None, "nearest"):
        gen = torch.Generator().manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(40, 64, generator=gen).bfloat16().t())
        opt = PIECES[name]([weight])
        weight.grad = torch.randn(64, 40, generator=gen).bfloat16()
        opt.step()
        assert weight.is_contiguous() and not opt.state[weight]["state1"].is_contiguous()
        writeback = None if rounding is None else WeightWriteBack(opt, rounding)
        for _ in range(3):
            weight.grad = torch.randn(64, 40, generator=gen).bfloat16()
            opt.step()
        if writeback is not None:
            writeback.close()
        runs.append([weight.detach().clone(), *checks.state_tensors(opt)])
    assert all(same_bits(a, b) for a, b in zip(*runs))
