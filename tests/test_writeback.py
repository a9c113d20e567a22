"""The weight write-back's core: its hooks, its buffers in the optimizer's state, its checkpoints, its noise, its
compiled pass (the families' own tests: test_writeback_<family>.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import writeback_checks as checks
from lightning_stale import _compat
from lightning_stale.act.writeback import WeightWriteBack, family, kernels
from lightning_stale.formats.noise import NOISE_MASK, counter_hash
from lightning_stale.vocab import COMPENSATION_KEY

LR = 1e-2
KW = dict(lr=LR, weight_decay=0.1)


def _adamw(params):
    return torch.optim.AdamW(params, **KW)


def test_buffers_live_in_the_optimizer_state_from_its_own_first_step_on():
    """The optimizers initialise a parameter's state only while it is empty: the buffer appears after their first
    step for the parameter, shaped and typed like it, 2 bytes per bf16 element; fp32 parameters get none."""
    net = checks.model()
    extra = torch.nn.Parameter(torch.ones(5))  # fp32: the optimizer's alone
    opt = torch.optim.AdamW([*net.parameters(), extra], **KW)
    writeback = WeightWriteBack(opt, "compensated")
    assert writeback.buffer_bytes() == 0 and not opt.state
    checks.step(net, opt, torch.randn(8, 64).bfloat16())
    for p in net.parameters():
        buffer = opt.state[p][COMPENSATION_KEY]
        assert buffer.shape == p.shape and buffer.dtype == p.dtype and not buffer.any()  # made after torch's step
    assert COMPENSATION_KEY not in opt.state[extra]
    assert writeback.buffer_bytes() == 2 * sum(p.numel() for p in net.parameters())
    checks.step(net, opt, torch.randn(8, 64).bfloat16())
    assert any(opt.state[p][COMPENSATION_KEY].any() for p in net.parameters())  # the write-back's step kept residuals
    writeback.close()


def test_a_checkpoint_with_buffers_loads_into_the_plain_optimizer_which_trains_on():
    net = checks.model()
    opt = _adamw(net.parameters())
    writeback = WeightWriteBack(opt, "compensated", moments="stochastic")
    for _ in range(3):
        checks.step(net, opt, torch.randn(8, 64).bfloat16())
    writeback.close()
    saved = copy.deepcopy(opt.state_dict())
    plain = _adamw(net.parameters())
    plain.load_state_dict(saved)
    before = [p.detach().clone() for p in net.parameters()]
    checks.step(net, plain, torch.randn(8, 64).bfloat16())
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_resume_from_the_optimizer_state_and_the_write_back_state_is_bit_exact():
    """The buffers travel in ``optimizer.state_dict()``, the rest (roundings, seed, steps written, choice) in the
    write-back's own; a resumed "rank" with another global RNG state ends bit-identical."""
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(16, 64, generator=gen).bfloat16() for _ in range(6)]
    net = checks.model()
    opt = _adamw(net.parameters())
    writeback = WeightWriteBack(opt, "compensated", moments="stochastic", seed=4)
    for x in inputs[:3]:
        checks.step(net, opt, x)
    saved = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "wb": writeback.state_dict()})
    assert all(not isinstance(v, torch.Tensor) for v in saved["wb"].values())
    for x in inputs[3:]:
        checks.step(net, opt, x)
    torch.manual_seed(99)
    resumed = checks.model()
    resumed.load_state_dict(saved["model"])
    resumed_opt = _adamw(resumed.parameters())
    resumed_opt.load_state_dict(saved["opt"])
    resumed_writeback = WeightWriteBack(resumed_opt, "compensated", moments="stochastic", seed=0)
    resumed_writeback.load_state_dict(saved["wb"])
    for x in inputs[3:]:
        checks.step(resumed, resumed_opt, x)
    assert all(torch.equal(a, b) for a, b in zip(checks.state_tensors(opt), checks.state_tensors(resumed_opt)))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), resumed.parameters()))


def test_a_checkpoint_that_kept_the_buffers_in_the_callback_state_continues_exactly():
    """A checkpoint of the earlier layout (buffers by parameter index in the write-back's state, none in the
    optimizer's) continues exactly as the same checkpoint in today's layout: the buffers move into the optimizer's
    state, whichever of the two states is loaded first."""
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(16, 64, generator=gen).bfloat16() for _ in range(6)]
    net = checks.model()
    opt = _adamw(net.parameters())
    writeback = WeightWriteBack(opt, "compensated", moments="stochastic", seed=1)
    for x in inputs[:3]:
        checks.step(net, opt, x)
    saved = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "wb": writeback.state_dict()})
    for x in inputs[3:]:
        checks.step(net, opt, x)
    legacy_opt = copy.deepcopy(saved["opt"])
    buffers = {i: entry.pop(COMPENSATION_KEY) for i, entry in legacy_opt["state"].items()}
    legacy_wb = {"rounding": "compensated", "seed": saved["wb"]["seed"], "params": None, "compensation": buffers,
                 "count": saved["wb"]["count"]}
    for callback_first in (True, False):
        resumed = checks.model()
        resumed.load_state_dict(saved["model"])
        resumed_opt = _adamw(resumed.parameters())
        resumed_writeback = WeightWriteBack(resumed_opt, "compensated", moments="stochastic")
        if callback_first:
            resumed_writeback.load_state_dict(copy.deepcopy(legacy_wb))
        resumed_opt.load_state_dict(copy.deepcopy(legacy_opt))
        if not callback_first:
            resumed_writeback.load_state_dict(copy.deepcopy(legacy_wb))
        for x in inputs[3:]:
            checks.step(resumed, resumed_opt, x)
        assert all(torch.equal(a, b) for a, b in zip(net.parameters(), resumed.parameters()))
        assert all(torch.equal(opt.state[a][COMPENSATION_KEY], resumed_opt.state[b][COMPENSATION_KEY])
                   for a, b in zip(net.parameters(), resumed.parameters()))


def test_a_checkpoint_without_buffers_continues_from_zero_residuals_and_says_so(caplog):
    net = checks.model()
    opt = _adamw(net.parameters())
    writeback = WeightWriteBack(opt, "compensated")
    checks.step(net, opt, torch.randn(8, 64).bfloat16())
    checks.step(net, opt, torch.randn(8, 64).bfloat16())
    saved_opt, saved_wb = copy.deepcopy(opt.state_dict()), writeback.state_dict()
    for entry in saved_opt["state"].values():
        del entry[COMPENSATION_KEY]
    resumed_opt = _adamw(net.parameters())
    resumed_writeback = WeightWriteBack(resumed_opt, "compensated")
    resumed_writeback.load_state_dict(saved_wb)
    resumed_opt.load_state_dict(saved_opt)
    with caplog.at_level(logging.INFO, logger="lightning_stale"):
        checks.step(net, resumed_opt, torch.randn(8, 64).bfloat16())
    said = [r.getMessage() for r in caplog.records if "no compensation buffer" in r.getMessage()]
    assert len(said) == 1 and "for 4 parameter(s)" in said[0]
    assert all(COMPENSATION_KEY in resumed_opt.state[p] for p in net.parameters())


def test_a_compensated_write_refuses_a_stochastic_checkpoint_the_other_way_round():
    opt = _adamw(checks.model().parameters())
    state = WeightWriteBack(opt, "compensated").state_dict()
    WeightWriteBack(_adamw(checks.model().parameters()), "compensated").load_state_dict(
        WeightWriteBack(_adamw(checks.model().parameters()), "stochastic").state_dict())
    with pytest.raises(ValueError, match="rounding 'compensated'"):
        WeightWriteBack(_adamw(checks.model().parameters()), "stochastic").load_state_dict(state)


def test_gradients_are_hidden_only_inside_the_optimizers_update():
    """Other step hooks, registered before or after the write-back, see the gradients and the written weights, with
    a closure and without; a raising closure hides nothing; an error in the optimizer's own update (after the
    closure) gives the gradients back before it reaches the caller."""
    net = checks.model()
    opt = _adamw(net.parameters())
    seen = []
    opt.register_step_post_hook(lambda *_: seen.append([(p.grad is not None, p.detach().clone())
                                                        for p in net.parameters()]))
    writeback = WeightWriteBack(opt, "stochastic", moments="stochastic")
    opt.register_step_pre_hook(lambda *_: seen.append(all(p.grad is not None for p in net.parameters())))
    checks.step(net, opt, torch.randn(4, 64).bfloat16())
    net(torch.randn(4, 64).bfloat16()).float().sum().backward()
    grads = [p.grad for p in net.parameters()]
    opt.step()
    assert all(p.grad is g for p, g in zip(net.parameters(), grads))
    assert seen[-2] is True and all(has and torch.equal(w, p) for (has, w), p in zip(seen[-1], net.parameters()))

    def raising():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        opt.step(raising)
    assert all(p.grad is g for p, g in zip(net.parameters(), grads))
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.zeros(3, dtype=torch.bfloat16).to_sparse()  # torch's Adam refuses it after the write
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step(lambda: None)
    assert all(p.grad is g for p, g in zip(net.parameters(), grads))
    writeback.close()
    assert "step" not in opt.__dict__  # the instance-level error hook is gone


def test_the_error_hook_keeps_schedulers_built_before_and_after_it_working():
    net = checks.model()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    before = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    writeback = WeightWriteBack(opt, "stochastic")
    after = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=1.0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither "overridden after initialization" nor "step before optimizer.step"
        for _ in range(3):
            checks.step(net, opt, torch.randn(4, 64).bfloat16())
            before.step()
            after.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** 3)
    writeback.close()


def test_a_step_without_gradients_moves_nothing():
    net = checks.model()
    opt = _adamw(net.parameters())
    checks.step(net, opt, torch.randn(4, 64).bfloat16())
    writeback = WeightWriteBack(opt, "compensated", moments="stochastic")
    before = [p.detach().clone() for p in net.parameters()]
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert all(float(opt.state[p]["step"]) == 1.0 for p in net.parameters()) and writeback.count == 0
    writeback.close()


def test_a_partial_take_over_leaves_the_other_parameters_to_the_optimizer_bit_for_bit():
    """What the automatic remedy does: only the chosen parameters are the write-back's; the rest of their group (a
    bf16 bias, an fp32 gain) take the optimizer's own step, each step from the same state exactly as without it."""
    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.weight = torch.nn.Parameter(torch.randn(64, 96).mul(0.1).bfloat16())
            self.bias = torch.nn.Parameter(torch.randn(96).mul(0.1).bfloat16())
            self.gain = torch.nn.Parameter(torch.ones(96))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.weight + self.bias).float() * self.gain

    net = Mixed()
    opt = _adamw(net.parameters())
    gen = torch.Generator().manual_seed(1)
    checks.step(net, opt, torch.randn(32, 64, generator=gen).bfloat16())
    for _ in range(4):
        x = torch.randn(32, 64, generator=gen).bfloat16()
        twin, twin_opt = checks.twin(net, opt, _adamw)
        writeback = WeightWriteBack(twin_opt, "stochastic", params=[twin.weight])
        checks.step(net, opt, x)
        checks.step(twin, twin_opt, x)
        assert writeback.handled == 1
        writeback.close()
        assert not torch.equal(net.weight, twin.weight)
        assert torch.equal(net.bias, twin.bias) and torch.equal(net.gain, twin.gain)
        net.load_state_dict(twin.state_dict())
        opt.load_state_dict(twin_opt.state_dict())


def test_a_gradscaler_step_is_left_to_the_optimizer(caplog):
    """A fused optimizer handed GradScaler's scale and verdict (its ``grad_scale`` and ``found_inf``) steps its
    parameters itself: its gradients are still scaled and its kernel may skip the step. Said once."""
    net = checks.model()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
    checks.step(net, opt, torch.randn(4, 64).bfloat16())
    writeback = WeightWriteBack(opt, "stochastic")
    with caplog.at_level(logging.INFO, logger="lightning_stale"):
        for found_inf in (1.0, 0.0):
            opt.grad_scale, opt.found_inf = torch.ones(()), torch.tensor(found_inf)
            before = [p.detach().clone() for p in net.parameters()]
            checks.step(net, opt, torch.randn(4, 64).bfloat16())
            del opt.grad_scale, opt.found_inf
            assert all(torch.equal(a, b) for a, b in zip(before, net.parameters())) == bool(found_inf)
    assert writeback.count == 0 and sum("GradScaler" in r.getMessage() for r in caplog.records) == 1
    writeback.close()


def test_fp32_parameters_are_untouched():
    gen = torch.Generator().manual_seed(4)
    inputs = [torch.randn(8, 64, generator=gen) for _ in range(3)]
    runs = []
    for attach in (False, True):
        net = checks.model(torch.float32)
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
        writeback = WeightWriteBack(opt, "compensated") if attach else None
        for x in inputs:
            checks.step(net, opt, x)
        runs.append([p.detach().clone() for p in net.parameters()])
        if writeback is not None:
            assert writeback.buffer_bytes() == 0 and writeback.handled == 0
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_stochastic_rounding_is_unbiased_and_keyed_not_random():
    value = torch.full((200_000,), 1.0 + 1e-3)  # between bf16 1.0 and 1.0078125
    base = kernels.noise_base(torch.tensor([2], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    keys = kernels.noise_keys(kernels.step_key(3, 7), base)[0]
    state = torch.random.get_rng_state()
    bits = kernels.noise(value, keys) & NOISE_MASK
    from lightning_stale.formats.floats import on_grid

    for dtype in (torch.bfloat16, torch.float16):
        rounded = on_grid(value, dtype, bits)
        assert abs(rounded.mean().item() - (1.0 + 1e-3)) < 2e-5
    assert set(on_grid(value, torch.bfloat16, bits).unique().tolist()) == {1.0, 1.0078125}
    assert torch.equal(bits, kernels.noise(value, keys) & NOISE_MASK)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is never used
    other = kernels.noise_keys(kernels.step_key(3, 8), base)[0]
    assert not torch.equal(bits, kernels.noise(value, other) & NOISE_MASK)


def test_a_shards_noise_is_the_whole_parameters_from_its_start():
    """Noise follows each element's place in the whole parameter: a shard starting at element s draws what the whole
    parameter's elements from s on draw, so FSDP2 ranks draw disjointly and replicas alike."""
    key = kernels.step_key(5, 2)
    index = torch.tensor([7], dtype=torch.int32)
    whole = kernels.noise(torch.empty(1000), kernels.noise_keys(key, kernels.noise_base(index, index * 0))[0])
    shard = kernels.noise(torch.empty(600), kernels.noise_keys(key, kernels.noise_base(index, index * 0 + 400))[0])
    assert torch.equal(whole[400:], shard)


def test_noise_keys_are_the_hash_of_each_index_under_the_steps_key():
    """The per-parameter round of the hash is built once; each step's keys are the whole hash of the index under the
    step's key (and of the second stream's), plus the shard's start."""
    indices = torch.arange(-5, 300, 7, dtype=torch.int32)
    starts = torch.randint(-2**31, 2**31 - 1, indices.shape, dtype=torch.int32)
    base = kernels.noise_base(indices, starts)
    for count in (0, 1, 12345):
        key = kernels.step_key(11, count)
        second = torch.tensor(kernels.SECOND_STREAM, dtype=torch.int32)
        expected = torch.stack([counter_hash(indices, key) + starts, counter_hash(indices ^ second, key)], dim=1)
        assert torch.equal(kernels.noise_keys(key, base), expected)


def test_same_seed_same_weights_like_replicated_ranks():
    weights = []
    for rank in range(2):
        net = checks.model()
        opt = _adamw(net.parameters())
        writeback = WeightWriteBack(opt, "stochastic", moments="stochastic", seed=5)
        torch.manual_seed(123 + rank)  # the global RNG differs between the two "ranks"
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            checks.step(net, opt, torch.randn(8, 64, generator=gen).bfloat16())
        writeback.close()
        weights.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


@pytest.mark.parametrize("rounding,moments", [("compensated", "stochastic"), ("stochastic", "stochastic")])
def test_eager_pieces_write_what_whole_tensors_write(rounding, moments, monkeypatch):
    """Eagerly, flat tensors go through in pieces (the transient fp32 copies are bounded by the piece, not by the
    largest tensor); the weights, moments, residuals and noise are the whole tensors' bit for bit."""
    runs = []
    for piece in (kernels.EAGER_CHUNK, 1000):
        monkeypatch.setattr(kernels, "EAGER_CHUNK", piece)
        net = checks.model()
        opt = _adamw(net.parameters())
        writeback = WeightWriteBack(opt, rounding, moments=moments, seed=5)
        gen = torch.Generator().manual_seed(2)
        for _ in range(4):
            checks.step(net, opt, torch.randn(32, 64, generator=gen).bfloat16())
        writeback.close()
        runs.append([p.detach().clone() for p in net.parameters()] + checks.state_tensors(opt))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_compiled_calls_cover_every_tensor_once():
    """The compiled pass runs GROUP tensors per call, then halving tails (one graph per length): each tensor once."""
    assert kernels._groups(13) == ((0, 8), (8, 12), (12, 13))
    assert [b - a for a, b in kernels._groups(8)] == [8] and kernels._groups(0) == ()


EVERY_ROUNDING = (("compensated", "stochastic"), ("stochastic", "stochastic"), ("compensated", "nearest"))


@pytest.mark.skipif(not _compat.compiler_available(), reason="torch.compile needs a C++ compiler")
@pytest.mark.parametrize(("make", "roundings"), [
    (lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1), EVERY_ROUNDING),
    (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01), EVERY_ROUNDING),
    # Adam's gradient with its sign and coupled decay (AdamW's enters as it is): auto's write only
    (lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1, maximize=True), EVERY_ROUNDING[:1]),
], ids=["adamw", "sgd", "adam-l2-maximize"])
def test_the_compiled_pass_writes_the_eager_passes_bits(make, roundings, monkeypatch):
    """One torch.compile'd pass per bucket (groups of tensors) and the eager one-tensor-at-a-time pass give the same
    weights, moments and residuals, bit for bit, in every rounding (Inductor keeps the bf16 round trips that make a
    residual, and rounds square roots correctly)."""
    def run(compiled: bool, rounding: str, moments: str) -> list[torch.Tensor]:
        monkeypatch.setattr(family._compat, "compiles", lambda numel, device: compiled)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 40)).bfloat16()
        opt = make(net.parameters())
        writeback = WeightWriteBack(opt, rounding, moments=moments, seed=3)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            checks.step(net, opt, torch.randn(16, 256, generator=gen).bfloat16())
        writeback.close()
        return [p.detach().clone() for p in net.parameters()] + checks.state_tensors(opt)

    for rounding, moments in roundings:
        eager, compiled = run(False, rounding, moments), run(True, rounding, moments)
        assert len(eager) == len(compiled) and all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.skipif(not _compat.compiler_available(), reason="torch.compile needs a C++ compiler")
def test_fp16_compensated_weights_compiled_are_the_eager_bits(monkeypatch):
    """fp16 weights with the compensated write: the compiled pass keeps each weight's rounding residual (some
    compilers drop an fp32 -> fp16 -> fp32 round trip; the rounding is integer ops on the bits) and writes the eager
    pass's weights, moments and residuals bit for bit; the residuals are not all zero."""
    from lightning_stale.vocab import COMPENSATION_KEY

    def run(compiled: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        monkeypatch.setattr(family._compat, "compiles", lambda numel, device: compiled)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 40)).half()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, eps=1e-4, weight_decay=0.1)
        writeback = WeightWriteBack(opt, "compensated", moments="nearest", seed=3)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            checks.step(net, opt, torch.randn(16, 256, generator=gen).half())
        residuals = [opt.state[p][COMPENSATION_KEY].clone() for p in net.parameters()]
        writeback.close()
        return [p.detach().clone() for p in net.parameters()] + checks.state_tensors(opt), residuals

    (eager, eager_residuals), (compiled, residuals) = run(False), run(True)
    assert all(bool(r.ne(0).any()) for r in eager_residuals)
    assert all(torch.equal(a, b) for a, b in zip(eager_residuals, residuals))
    assert len(eager) == len(compiled) and all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.skipif(not _compat.compiler_available(), reason="torch.compile needs a C++ compiler")
def test_one_graph_per_call_length_whatever_the_ranks(monkeypatch):
    """Each tensor reaches the compiled pass flat and not as a view (a view's base would put its rank into the
    guards): 18 parameters whose 1-D and 2-D ones fall differently in each call compile one graph per call length
    (8 and 2), not one per pattern of ranks."""
    from torch._dynamo.utils import counters

    from lightning_stale.act.writeback.families import torch_adam

    monkeypatch.setattr(family._compat, "compiles", lambda numel, device: True)
    monkeypatch.setattr(torch_adam, "ADAM", kernels.MultiTensor(torch_adam.adam))  # a kernel no test compiled yet
    torch.manual_seed(0)
    blocks = [m for _ in range(6) for m in (torch.nn.Linear(32, 32), torch.nn.LayerNorm(32, bias=False))]
    net = torch.nn.Sequential(*blocks).bfloat16()  # ranks 2, 1, 1, 2, 1, 1, ...: the two calls of 8 differ
    opt = torch.optim.AdamW(net.parameters(), **KW)
    writeback = WeightWriteBack(opt, "compensated", moments="stochastic")
    before = counters["stats"]["unique_graphs"]
    for _ in range(3):
        checks.step(net, opt, torch.randn(4, 32).bfloat16())
    writeback.close()
    assert len(list(net.parameters())) == 18 and counters["stats"]["unique_graphs"] - before == 2


@pytest.mark.skipif(not _compat.compiler_available(), reason="torch.compile needs a C++ compiler")
def test_graphs_compile_on_stand_ins_then_run_without_dynamo_where_its_guards_would_pass():
    """Each graph (group length, flags, dtypes) compiles once, on zero stand-ins of COMPILE_NUMEL elements, whatever
    the first parameters are (Inductor tunes a graph's loops to the sizes it compiles with, on CPU a bf16 loop under
    32 elements gets half the vector width, and the graph serves every size; a group with a tensor of 0 or 1
    elements gets a graph of its own, as dynamo specializes those sizes); calls are then direct, skipping dynamo,
    except where its guards would not pass (a column of mixed dtypes, a tensor that needs a gradient, tensors of one
    parameter with different sizes), which go through dynamo. Every call writes the eager pass's bits."""
    import weakref

    from lightning_stale.act.writeback.families import torch_adam

    kernel = kernels.MultiTensor(torch_adam.adam)
    compiled = torch.compile(kernel._loop, dynamic=True, fullgraph=True, backend=kernel._capture)
    through_dynamo = []
    kernel._compiled = lambda columns, rows, flags: (through_dynamo.append([t.numel() for t in columns[0]]),
                                                     compiled(columns, rows, flags))
    index = torch.arange(2, dtype=torch.int32)  # calls of 2 tensors: small graphs, quick to compile
    rows = [torch.tensor([[0.1, 0.999, 0.001, 1.0, 0.0, 0.9999, -1e-3, 1e-8]] * 2),
            kernels.noise_keys(7, kernels.noise_base(index, torch.zeros_like(index)))]
    flags = ("compensated", "stochastic", True)

    def matches_eager(sizes, grad_dtypes=(torch.bfloat16,) * 2, needs_grad=False):
        gen = torch.Generator().manual_seed(len(through_dynamo))
        columns = [[torch.randn(n, generator=gen).bfloat16() for n in sizes] for _ in range(5)]
        columns[2] = [g.to(dtype) for g, dtype in zip(columns[2], grad_dtypes)]
        columns[4] = [v.abs() for v in columns[4]]
        columns[0][-1].requires_grad_(needs_grad)
        eager = [[t.detach().clone() for t in column] for column in columns]
        kernel(columns, rows, flags, compiled=True)
        kernel(eager, rows, flags, compiled=False)
        return all(torch.equal(a, b) for x, y in zip(columns, eager) for a, b in zip(x, y))

    assert matches_eager([4, 4]) and matches_eager([3000, 5])
    assert through_dynamo == [[kernels.COMPILE_NUMEL, kernels.COMPILE_NUMEL + 1]]  # the stand-ins' call only
    # a tensor of one element: a graph of its own, compiled on stand-ins of that size too, then called directly
    assert matches_eager([300, 1]) and matches_eager([20, 1])
    assert through_dynamo[1:] == [[kernels.COMPILE_NUMEL, 1]]
    assert matches_eager([300, 300], (torch.bfloat16, torch.float32)) and len(through_dynamo) == 3
    with torch.no_grad():
        assert matches_eager([300, 300], needs_grad=True) and len(through_dynamo) == 4
    assert matches_eager([300, 300]) and len(through_dynamo) == 4
    columns = [[torch.rand(300).bfloat16() for _ in range(2)] for _ in range(5)]
    kernel(columns, rows, flags, compiled=True)
    gradient = weakref.ref(columns[2][0])
    del columns
    assert gradient() is None  # what the kernel remembers of the lists it checked keeps no tensor alive
    columns = [[torch.rand(300).bfloat16() for _ in range(2)] for _ in range(5)]
    columns[3][1] = torch.rand(200).bfloat16()  # a moment of another size: never handed to a graph directly
    with pytest.raises(RuntimeError, match="size"):
        kernel(columns, rows, flags, compiled=True)
    assert len(through_dynamo) == 5


def test_refuses_optimizers_without_a_family():
    with pytest.raises(ValueError, match="Adagrad: not a supported optimizer family.*torch.optim.adamw.AdamW"):
        WeightWriteBack(torch.optim.Adagrad(checks.model().parameters()))
    with pytest.raises(ValueError, match="`rounding` must be one of"):
        WeightWriteBack(_adamw(checks.model().parameters()), "exact")


def test_a_checkpoint_of_the_released_version_continues_exactly():
    """A checkpoint written by lightning_stale 0.1 (tests/data/make_writeback_checkpoint.py: the buffers in the
    monitor's state) continues exactly as the same checkpoint in today's layout (the buffers in the optimizer's
    state), with the residuals it saved (without them the run differs), whichever state the loop loads first."""
    import importlib.util
    from pathlib import Path

    from lightning_stale import StaleStateMonitor

    data = Path(__file__).with_name("data")
    spec = importlib.util.spec_from_file_location("make_writeback_checkpoint", data / "make_writeback_checkpoint.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    saved = torch.load(data / "writeback_released.pt", weights_only=False)
    legacy = saved["monitor"]["optimizers"][0]["weights"]["compensation"]

    def today(zero: bool) -> dict:
        moved = copy.deepcopy(saved)
        del moved["monitor"]["optimizers"][0]["weights"]["compensation"]
        for index, buffer in legacy.items():
            moved["optimizer"]["state"][int(index)][COMPENSATION_KEY] = buffer.clone().zero_() if zero else buffer
        return moved

    def resume(checkpoint: dict, monitor_first: bool) -> list[torch.Tensor]:
        model, optimizer = maker.setup()
        model.load_state_dict(checkpoint["model"])
        monitor = StaleStateMonitor(optimizer, weights="compensated", names=model, coverage_steps=2)
        if monitor_first:
            monitor.load_state_dict(copy.deepcopy(checkpoint["monitor"]))
        optimizer.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
        if not monitor_first:
            monitor.load_state_dict(copy.deepcopy(checkpoint["monitor"]))
        maker.train(model, optimizer, maker.batches(6, start=maker.STEPS))
        monitor.close()
        return [p.detach().clone() for p in model.parameters()] + checks.state_tensors(optimizer)

    expected = resume(today(zero=False), monitor_first=False)
    assert not all(torch.equal(a, b) for a, b in zip(resume(today(zero=True), monitor_first=False), expected))
    for monitor_first in (True, False):
        ours = resume(saved, monitor_first)
        assert len(ours) == len(expected) and all(torch.equal(a, b) for a, b in zip(ours, expected))


def test_a_short_run_keeps_the_cpu_pass_eager_and_a_long_one_compiles(caplog):
    """Where the run's remaining steps are known, a bucket whose CPU pass would compile runs its first step eagerly,
    timed: it compiles from then on only if its eager steps over the rest of the run would cost more than the
    compile (a short run stays eager and says so once); with no plan, large buckets compile as before."""
    from lightning_stale.act.writeback import writeback

    def first_steps(plan: int | None, steps: int) -> WeightWriteBack:
        torch.manual_seed(0)
        layer = torch.nn.Linear(256, 256).to(torch.bfloat16)  # 65,792 elements: a bucket large enough to compile
        opt = _adamw(layer.parameters())
        wb = WeightWriteBack(opt, "compensated")
        if plan is not None:
            wb.plan_steps(plan)
        for _ in range(steps):
            layer(torch.randn(4, 256).to(torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        return wb

    with caplog.at_level(logging.INFO, logger="lightning_stale"):
        short = first_steps(plan=5, steps=3)  # the state appears at step 1, the first write is step 2: judged there
    assert not short._buckets[0].columns.compiled and not short._buckets[0].judge
    assert sum("stay on eager ops" in r.getMessage() for r in caplog.records) == 1
    long = first_steps(plan=writeback.COMPILE_SECONDS * 10**6, steps=2)  # judged, not yet compiled
    assert long._buckets[0].columns.compiled and not long._buckets[0].judge
    unplanned = first_steps(plan=None, steps=1)
    assert unplanned._plan()[0].columns.compiled and not unplanned._buckets[0].judge
