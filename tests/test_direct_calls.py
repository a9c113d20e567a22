"""The write-back's compiled graphs called without dynamo: every check that stands in for one of dynamo's guards,
each shown to refuse what that guard would refuse, and the private settings the graphs compile under, each restored
and each allowed to be missing."""

from __future__ import annotations

import types

import pytest
import torch

from helpers import torch_older_than
from lightning_stale import _compat
from lightning_stale.act.writeback import kernels
from lightning_stale.act.writeback.families import torch_adam

FLAGS = ("compensated", "stochastic", True)


def _rows(n: int) -> list[torch.Tensor]:
    index = torch.arange(n, dtype=torch.int32)
    return [torch.tensor([[0.1, 0.999, 0.001, 1.0, 0.0, 0.9999, -1e-3, 1e-8]] * n),
            kernels.noise_keys(7, kernels.noise_base(index, torch.zeros_like(index)))]


def _columns(sizes, seed: int = 0) -> list[list[torch.Tensor]]:
    """Weights, residuals, gradients, m and v (bf16) of parameters of ``sizes`` elements."""
    gen = torch.Generator().manual_seed(seed)
    columns = [[torch.randn(n, generator=gen).bfloat16() for n in sizes] for _ in range(5)]
    columns[4] = [v.abs() for v in columns[4]]
    return columns


def _mutations():
    """(name, change of a valid call) for each check: the change alone makes dynamo's guards fail or the graph wrong."""
    meta = torch.device("meta")

    def entry(column, index, make):
        def change(columns, rows):
            columns[column][index] = make(columns[column][index])
        return change

    def table(make):
        def change(columns, rows):
            rows[0] = make(rows[0])
        return change

    class Sub(torch.Tensor):
        pass

    return {
        "dtype": entry(2, 1, lambda t: t.float()),
        "type": entry(3, 0, lambda t: t.as_subclass(Sub)),
        "needs a gradient": entry(0, 1, lambda t: t.detach().requires_grad_()),
        "device": entry(4, 1, lambda t: torch.empty_like(t, device=meta)),
        "rank": entry(2, 0, lambda t: t.view(1, -1)),
        "strides": entry(1, 1, lambda t: torch.empty(2 * t.numel(), dtype=t.dtype)[::2]),
        "one size per parameter": entry(3, 1, lambda t: t[:-1]),
        "a column on another device": lambda columns, rows: columns.__setitem__(
            1, [torch.empty_like(t, device=meta) for t in columns[1]]),
        "table strides": table(lambda r: torch.cat([r, r], dim=1)[:, ::2]),
        "table device": table(lambda r: torch.empty_like(r, device=meta)),
    }


MUTATIONS = _mutations()


def _direct(columns, rows) -> bool:
    kernel = kernels.MultiTensor(torch_adam.adam)
    return kernel._direct([kernel._kind(j, column) for j, column in enumerate(columns)], rows)


def test_a_call_that_passes_every_check_goes_direct():
    assert _direct(_columns([300, 7]), _rows(2))


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_check_refuses_what_dynamos_guards_would(name):
    columns, rows = _columns([300, 7]), _rows(2)
    MUTATIONS[name](columns, rows)
    assert not _direct(columns, rows), name


def test_tensors_past_32_bit_indexing_never_go_direct():
    """A graph's generated code may index with 32-bit integers below 2^31 elements (dynamo guards that and
    recompiles); tensors of the meta device stand in for the 4 GiB ones a real case needs."""
    sizes = [kernels.INDEX_LIMIT - 1, 5]
    columns = [[torch.empty(n, dtype=torch.bfloat16, device="meta") for n in sizes] for _ in range(5)]
    rows = [torch.empty_like(r, device="meta") for r in _rows(2)]
    assert _direct(columns, rows)
    big = [[torch.empty(n, dtype=torch.bfloat16, device="meta") for n in (kernels.INDEX_LIMIT, 5)] for _ in range(5)]
    assert not _direct(big, rows)


def test_tensors_of_different_sizes_keep_their_own_sizes_where_duck_shaping_is_on():
    """With duck shaping (torch's default, and what a torch without the setting does), stand-ins of equal sizes would
    share one size in the graph, and a direct call would loop over the first tensor's size in every tensor; the
    stand-ins' sizes differ, so each keeps its own. The first tensor is the smaller one: a failure writes too
    little (the bits differ), never out of bounds."""
    import torch.fx.experimental._config as fx_config

    kernel = kernels.MultiTensor(torch_adam.adam)
    compiled = torch.compile(kernel._loop, dynamic=True, fullgraph=True, backend=kernel._capture)
    through_dynamo = []
    kernel._compiled = lambda columns, rows, flags: (through_dynamo.append(1), compiled(columns, rows, flags))
    rows = _rows(2)
    for sizes in ([4, 4], [5, 3000]):
        columns = _columns(sizes, seed=sizes[1])
        eager = [[t.clone() for t in column] for column in columns]
        with fx_config.patch(use_duck_shape=True):
            kernel(columns, rows, FLAGS, compiled=True)
        kernel(eager, rows, FLAGS, compiled=False)
        assert all(torch.equal(a, b) for x, y in zip(columns, eager) for a, b in zip(x, y)), sizes
    assert through_dynamo == [1]  # the stand-ins' compile; both real calls direct


class _NoSources(_compat.CapturingInductor):
    """The backend on a dynamo that keeps no sources where the backend looks for them."""

    def __call__(self, gm, example_inputs):
        kept = {node: node.meta.pop("grapharg") for node in gm.graph.find_nodes(op="placeholder")}
        try:
            return super().__call__(gm, example_inputs)
        finally:
            for node, grapharg in kept.items():  # dynamo reads them after its backend
                node.meta["grapharg"] = grapharg


def test_graphs_without_readable_inputs_go_through_dynamo_with_the_same_bits():
    kernel = kernels.MultiTensor(torch_adam.adam)
    kernel._capture = _NoSources()
    columns = _columns([300, 7])
    eager = [[t.clone() for t in column] for column in columns]
    kernel(columns, _rows(2), FLAGS, compiled=True)
    kernel(eager, _rows(2), FLAGS, compiled=False)
    assert not kernel.failed and all(graph is None for graphs in kernel._graphs.values() for graph in graphs.values())
    assert all(torch.equal(a, b) for x, y in zip(columns, eager) for a, b in zip(x, y))


def test_multi_tensor_compile_sets_and_restores_its_settings():
    """Inside: no size assertions in Inductor's wrappers, room for more graphs; outside, everything as it was (also
    after an error inside)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    limit = _compat.recompile_limit_name(dynamo_config)  # cache_size_limit before torch 2.7

    def settings():
        return inductor_config.size_asserts, getattr(dynamo_config, limit)

    before = settings()
    with pytest.raises(RuntimeError, match="inside"), _compat.multi_tensor_compile():
        assert not inductor_config.size_asserts
        assert getattr(dynamo_config, limit) >= 64
        raise RuntimeError("inside")
    assert settings() == before


def test_an_inherited_codegen_method_is_overridden_inside_and_inherited_again_after(monkeypatch):
    """Where the vector codegen inherits ``to_dtype_bitcast`` (older torch), the override is the class's own inside
    the block and gone after it (not copied down from the base class, not left behind)."""
    from torch._inductor.codegen import cpp

    monkeypatch.delattr(cpp.CppVecOverrides, "to_dtype_bitcast")
    inherited = cpp.CppVecOverrides.to_dtype_bitcast
    with _compat.multi_tensor_compile():
        assert getattr(vars(cpp.CppVecOverrides)["to_dtype_bitcast"].__func__, "_lightning_stale", False)
    assert "to_dtype_bitcast" not in vars(cpp.CppVecOverrides)
    assert cpp.CppVecOverrides.to_dtype_bitcast is inherited


def test_the_graph_limit_is_found_under_either_name_and_restored(monkeypatch):
    """torch 2.7 renamed dynamo's ``cache_size_limit`` to ``recompile_limit`` (the old name an alias since)."""
    import torch._dynamo.config as dynamo_config

    own = "cache_size_limit" if torch_older_than("2.7") else "recompile_limit"
    assert _compat.recompile_limit_name(dynamo_config) == own
    assert _compat.recompile_limit_name(types.SimpleNamespace(cache_size_limit=8)) == "cache_size_limit"
    assert _compat.recompile_limit_name(types.SimpleNamespace()) is None
    monkeypatch.setattr(_compat, "recompile_limit_name", lambda config: "cache_size_limit")
    before = dynamo_config.cache_size_limit
    with _compat.multi_tensor_compile():
        assert dynamo_config.cache_size_limit >= 64
    assert dynamo_config.cache_size_limit == before
    monkeypatch.setattr(_compat, "recompile_limit_name", lambda config: None)
    with _compat.multi_tensor_compile():
        assert dynamo_config.cache_size_limit == before


def test_a_vector_codegen_without_its_vector_count_keeps_torchs_own_cast():
    """The vectorized bit cast asks Inductor's private kernel for its vector count; without it, torch's cast."""
    calls = []
    patched = _compat._vectorized_bitcast(lambda x, dtype, src: calls.append((x, dtype, src)) or "original")
    from torch._inductor.virtualized import V

    with V.set_kernel_handler(types.SimpleNamespace()):
        assert patched("x", torch.int32, torch.float32) == "original"
    assert calls == [("x", torch.int32, torch.float32)]
