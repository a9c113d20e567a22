"""The write-back's CUDA pass (one Triton launch per bucket) on a machine without a GPU: its kernels under Triton's
interpreter on CPU tensors, bit for bit against the eager ops of :func:`adam` and :func:`sgd` in every rounding and on
every kind of size; their compiled form for a GPU read for what the interpreter cannot show (no fused multiply-add,
correctly rounded division and square root, 64-bit offsets, 16-byte accesses); the fallback to the eager ops."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import writeback_checks as checks
from lightning_stale.act.writeback import WeightWriteBack, kernels, triton_pass
from lightning_stale.act.writeback.families import torch_adam, torch_sgd
from lightning_stale.act.writeback.families.torch_adam import adam
from lightning_stale.act.writeback.families.torch_sgd import sgd
from lightning_stale.act.writeback.kernels import SECOND_STREAM, MultiTensor, noise_base, noise_keys
from lightning_stale.formats.noise import as_int32

triton = pytest.importorskip("triton", minversion="3.4",
                             reason="Triton 3.4+ is not installed (the CUDA write-back's kernels need it)")

BLOCK, CHUNK = 16, 32  # small blocks and chunks: every size below straddles some
ONE = {"adam": adam, "sgd": sgd}


def load_kernels(interpret: bool) -> types.ModuleType:
    """A fresh copy of the kernels' module, its functions decorated under Triton's interpreter (they then run on CPU
    tensors) or not; the package's own copy and the process's environment are left as they were."""
    path = importlib.util.find_spec("lightning_stale.act.writeback.triton_kernels").origin
    spec = importlib.util.spec_from_file_location(f"triton_kernels_{'interpreted' if interpret else 'compiled'}", path)
    module = importlib.util.module_from_spec(spec)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def interpreted() -> types.ModuleType:
    return load_kernels(interpret=True)


def interpreted_pass(kernels: types.ModuleType, kind: str, block: int = BLOCK, chunk: int = CHUNK):
    return triton_pass.TritonPass(kind, device_type="cpu", kernels=kernels, block=block, chunk=chunk)


def bucket(kind: str, sizes: list[int], weights: torch.dtype, grads: torch.dtype, compensated: bool,
           moments: bool = True, seed: int = 0) -> tuple[list[list], list[torch.Tensor]]:
    """A bucket's columns (w, c, g, then m and v, or the momentum buffer) and rows (scalars, noise keys) with values
    over many binades: zeros, subnormal squares, large gradients; members of two parameter groups (the second
    maximizes with weight decay)."""
    gen = torch.Generator().manual_seed(seed)

    def spread(n: int, low: float, high: float) -> torch.Tensor:
        return torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * (high - low) + low)

    w = [spread(n, -3, 0).to(weights) for n in sizes]
    c = [spread(n, -6, -4).to(weights) if compensated else None for n in sizes]
    g = [spread(n, -25, 1) for n in sizes]
    for t in g[1:2]:
        t.zero_()
    g = [t.to(grads) for t in g]
    n = len(sizes)
    if kind == "adam":
        state = [[spread(k, -6, -1).to(weights) for k in sizes], [spread(k, -12, -2).abs().to(weights) for k in sizes]]
        rows = [(0.1, 0.999, 0.001, 1.0, 0.0, 0.999, -1e-3, 1e-8), (0.1, 0.99, 0.01, -1.0, 0.05, 1.0, -3e-4, 1e-10)]
    else:
        state = [[spread(k, -6, -1).to(weights) if moments else None for k in sizes]]
        rows = [(-1e-2, 0.9, 0.9, 1.0, 0.0), (-3e-3, 0.8, 1.0, -1.0, 1e-2)]
    scalars = torch.tensor([rows[i % 2] for i in range(n)], dtype=torch.float32)
    starts = torch.tensor([as_int32(i * 977_000_003) for i in range(n)], dtype=torch.int32)
    keys = noise_keys(as_int32(seed * 0x9E3779B9), noise_base(torch.arange(n, dtype=torch.int32) * 3, starts))
    return [w, c, g, *state], [scalars, keys]


def copied(columns: list[list]) -> list[list]:
    return [[None if t is None else t.clone() for t in column] for column in columns]


def eager(kind: str, columns: list[list], rows: list[torch.Tensor], flags: tuple) -> list[list]:
    out = copied(columns)
    MultiTensor(ONE[kind])(out, rows, flags, compiled=False)
    return out


def assert_same_bits(got: list[list], expected: list[list]) -> None:
    """Every tensor of every column the same bits (a NaN matches a NaN: its payload is the cast's, which differs
    between torch's own scalar and vector casts)."""
    for j, (a_column, b_column) in enumerate(zip(got, expected)):
        for i, (a, b) in enumerate(zip(a_column, b_column)):
            if a is None:
                assert b is None
                continue
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            same = (a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())
            assert bool(same.all()), f"column {j}, tensor {i} ({a.numel()} elements): {int((~same).sum())} differ"


def run_pass(step, columns: list[list], rows: list[torch.Tensor], flags: tuple) -> list[list]:
    out = copied(columns)
    with np.errstate(all="ignore"):  # the interpreter's numpy on masked-off lanes
        assert step(out, rows, flags, True, {})
    return out


ADAM_CASES = list(itertools.product(("nearest", "stochastic", "compensated"), ("nearest", "stochastic"),
                                    (True, False), ("bf16", "fp16")))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SGD_CASES = [(weights, moments, momentum, nesterov, dtype)
             for weights, (moments, momentum, nesterov), dtype in itertools.product(
                 ("nearest", "stochastic", "compensated"),
                 (("nearest", False, False), ("nearest", True, False), ("stochastic", True, False),
                  ("nearest", True, True), ("stochastic", True, True)),
                 ("bf16", "fp16"))]


@pytest.mark.parametrize(("weights", "moments", "as_is", "dtype"), ADAM_CASES)
def test_adam_kernel_writes_the_eager_bits(interpreted, weights, moments, as_is, dtype):
    """Every weights rounding, moments rounding, gradient form (as it is: AdamW; with its sign and coupled decay:
    maximize, Adam's L2) and weight dtype: the same weights, residuals and moments, bit for bit; tensors of 0, 1 and
    more than a block of elements, in one launch; fp32 gradients, or the weights' dtype."""
    columns, rows = bucket("adam", [0, 1, 19], DTYPES[dtype], DTYPES[dtype] if as_is else torch.float32,
                           weights == "compensated", seed=1)
    flags = (weights, moments, as_is)
    assert_same_bits(run_pass(interpreted_pass(interpreted, "adam"), columns, rows, flags),
                     eager("adam", columns, rows, flags))


@pytest.mark.parametrize(("weights", "moments", "momentum", "nesterov", "dtype"), SGD_CASES)
def test_sgd_kernel_writes_the_eager_bits(interpreted, weights, moments, momentum, nesterov, dtype):
    """Every weights rounding, with no momentum, momentum with dampening (its buffer to nearest or stochastically)
    and Nesterov, maximize and weight decay in one of the groups, bf16 and fp16."""
    columns, rows = bucket("sgd", [19, 0, 1], DTYPES[dtype], torch.float32, weights == "compensated", momentum, seed=7)
    flags = (weights, moments, nesterov)
    assert_same_bits(run_pass(interpreted_pass(interpreted, "sgd"), columns, rows, flags),
                     eager("sgd", columns, rows, flags))


@pytest.mark.parametrize(("block", "chunk", "sizes"), [
    (BLOCK, CHUNK, [0, 1, 15, 16, 17, 31, 32, 33, 35, 37, 65, 0, 1]),  # around blocks and chunks, mixed in one bucket
    (triton_pass.BLOCK, triton_pass.CHUNK, [1, 1001, triton_pass.BLOCK - 1, triton_pass.BLOCK + 1, 0,
                                            2 * triton_pass.BLOCK + 3]),  # the kernel's own sizes
], ids=["small-blocks", "kernel-blocks"])
@pytest.mark.parametrize(("kind", "flags", "grads"), [
    ("adam", ("compensated", "stochastic", False), torch.bfloat16),
    ("sgd", ("stochastic", "stochastic", True), torch.float16),
], ids=["adam", "sgd"])
def test_every_size_around_blocks_and_chunks(interpreted, block, chunk, sizes, kind, flags, grads):
    """Tensors of 0 and 1 elements, odd sizes, a block and a chunk plus and minus one, all in one bucket: each element
    once, with its own noise."""
    columns, rows = bucket(kind, sizes, torch.bfloat16, grads, flags[0] == "compensated", seed=3)
    assert_same_bits(run_pass(interpreted_pass(interpreted, kind, block, chunk), columns, rows, flags),
                     eager(kind, columns, rows, flags))


@pytest.mark.parametrize(("weights", "grads"), [("bf16", torch.float32), ("bf16", torch.bfloat16),
                                               ("fp16", torch.float16), ("fp16", torch.float32)])
def test_infinities_and_nans_go_where_the_eager_ones_go(interpreted, weights, grads):
    """A gradient with inf and NaN, weights at their dtype's largest values and a step size that takes them past it:
    the same infinities and NaNs (stochastic rounding saturates; to nearest overflows as the cast does)."""
    dtype = DTYPES[weights]
    for rounding in ("stochastic", "compensated"):
        columns, rows = bucket("adam", [21], dtype, grads, rounding == "compensated", seed=5)
        columns[2][0][:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e30]).to(grads)
        columns[0][0][4:8] = torch.tensor([1.0, -1.0, 0.999, -0.999]) * torch.finfo(dtype).max
        rows[0][0, 6] = -0.01 * torch.finfo(dtype).max
        flags = (rounding, "stochastic", False)
        assert_same_bits(run_pass(interpreted_pass(interpreted, "adam"), columns, rows, flags),
                         eager("adam", columns, rows, flags))


def test_the_wrapping_integer_ops_pass_tritons_overflow_checks(interpreted, monkeypatch):
    """Under ``TRITON_DEBUG`` Triton checks every int32 add and product for overflow (a failed check ends the run on
    a GPU): the hash's products and the rounding's adds on NaN patterns wrap on purpose and are marked so. Run with
    the interpreter's checks on, NaNs and infinities in every rounding."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.interpreter_builder, "options", interpreter.InterpreterOptions(debug=True))
    for dtype, rounding, moments in itertools.product(DTYPES.values(), ("stochastic", "compensated"),
                                                      ("stochastic", "nearest")):
        columns, rows = bucket("adam", [21], dtype, torch.float32, rounding == "compensated", seed=5)
        columns[2][0][:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e30])
        flags = (rounding, moments, False)
        assert_same_bits(run_pass(interpreted_pass(interpreted, "adam"), columns, rows, flags),
                         eager("adam", columns, rows, flags))


def test_offsets_past_two_to_the_31_are_64_bit(interpreted):
    """A stand-in for a tensor of more than 2^31 elements: its address table entry points 2^31 elements before a
    real buffer and the chunk list holds only the chunks past 2^31, so the kernel writes the buffer only where its
    offsets are 64-bit (an int32 offset would wrap to 2^31 elements below it); its noise counter wraps as the eager
    pieces' does."""
    sizes, past = [40], 1 << 31
    columns, rows = bucket("adam", sizes, torch.bfloat16, torch.float32, True, seed=11)
    flags = ("compensated", "stochastic", False)
    out = copied(columns)
    state = torch.tensor([[t[0].data_ptr() - past * t[0].element_size()] for j, t in enumerate(out) if j != 2])
    grads = torch.tensor([out[2][0].data_ptr() - past * 4])
    first = past // CHUNK
    chunks = torch.tensor([[0, 0], [first, first + 1]], dtype=torch.int32)
    dtypes = dict(W=interpreted.tl.bfloat16, G=interpreted.tl.float32, S=interpreted.tl.bfloat16)
    with np.errstate(all="ignore"):
        interpreted.adam_kernel[(2,)](state, grads, torch.tensor([past + 40]), chunks, 2, rows[0], rows[1], 1, 8,
                                      **dtypes, HAS_C=True, HAS_S=True, FLAG=False, STOCHASTIC_W=False,
                                      STOCHASTIC_M=True, ALIGN=1, BLOCK=BLOCK, CHUNK=CHUNK, SECOND=SECOND_STREAM)
    shifted = rows[1].clone()
    shifted[0, 0] = as_int32(int(shifted[0, 0]) + past)  # the eager pieces' counter offset at element 2^31
    assert_same_bits(out, eager("adam", columns, [rows[0], shifted], flags))


def test_chunk_tables_of_a_tensor_past_two_to_the_31(monkeypatch):
    """The host side of a parameter of more than 2^31 elements (meta tensors: no memory, address 0): its chunks'
    indices fit int32 and reach its end; a bucket of more chunks than a launch holds is declined."""
    monkeypatch.setattr(triton_pass, "to_device", lambda host, device: host)
    numel = (1 << 31) + 5
    columns = [[torch.empty(numel, dtype=torch.bfloat16, device="meta")], [None], [None],
               [torch.empty(numel, dtype=torch.bfloat16, device="meta")]]
    tables = triton_pass._Tables(columns, triton_pass.CHUNK)
    last = tables.chunks[:, -1].tolist()
    assert tables.chunks.dtype == torch.int32 and tables.n_chunks == -(-numel // triton_pass.CHUNK)
    assert last == [0, tables.n_chunks - 1] and last[1] * triton_pass.CHUNK < numel <= (last[1] + 1) * triton_pass.CHUNK
    assert triton_pass._refusal(columns, True, triton_pass.CHUNK) is None
    assert "more chunks" in triton_pass._refusal(columns, True, 1)


class _Counted:
    """A kernel whose launches are counted."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


class _Failing:
    """A kernel whose launch fails (as one that does not compile or fit the device)."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("out of resources")

        return launch


@pytest.mark.parametrize(("kind", "make", "rounding", "moments"), [
    ("adam", lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), "compensated", "stochastic"),
    ("adam", lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, maximize=True), "stochastic", "nearest"),
    ("sgd", lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01), "stochastic",
     "stochastic"),
], ids=["adamw", "adam-l2-maximize", "sgd-nesterov"])
def test_the_write_back_through_the_kernel_is_the_eager_write_back(interpreted, kind, make, rounding, moments,
                                                                   monkeypatch):
    """WeightWriteBack with the families' device pass on this device: every step one launch per bucket, and the
    weights and the optimizer's state bit for bit the eager write-back's; the bucket's tables built once."""
    def run(device_pass) -> list[torch.Tensor]:
        for family in (torch_adam.ADAM, torch_sgd.SGD):
            monkeypatch.setattr(family, "device_pass", device_pass)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).bfloat16()
        opt = make(net.parameters())
        writeback = WeightWriteBack(opt, rounding, moments=moments, seed=3)
        gen = torch.Generator().manual_seed(1)
        with np.errstate(all="ignore"):
            for _ in range(4):
                checks.step(net, opt, torch.randn(4, 6, generator=gen).bfloat16())
        tables = [bucket.columns.cache for bucket in writeback._buckets]
        writeback.close()
        return [p.detach().clone() for p in net.parameters()] + checks.state_tensors(opt), tables

    launches: list = []
    counted = types.SimpleNamespace(triton=interpreted.triton, tl=interpreted.tl,
                                    adam_kernel=_Counted(interpreted.adam_kernel, launches),
                                    sgd_kernel=_Counted(interpreted.sgd_kernel, launches))
    (got, tables), (expected, _) = run(interpreted_pass(counted, kind)), run(None)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert len(launches) == 3 and all(len(cache) == 1 for cache in tables)  # steps 2-4 (the first is torch's own)


def test_what_the_kernel_cannot_take_runs_eagerly_once_said(interpreted, caplog):
    """No Triton, a dtype the kernel does not read, tensors that are not contiguous, a launch that fails: the eager
    ops run (the same bits, each tensor once) and each reason is logged once."""
    caplog.set_level(logging.INFO, logger="lightning_stale")
    flags = ("stochastic", "stochastic", True)

    def check(step: MultiTensor, columns, rows, flat: bool = True) -> None:
        for _ in range(2):
            out = copied(columns)
            step(out, rows, flags, compiled=False, flat=flat, cache={})
            assert_same_bits(out, eager("adam", columns, rows, flags))

    columns, rows = bucket("adam", [3, 5], torch.bfloat16, torch.float32, False)
    missing = interpreted_pass(None, "adam")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "lightning_stale.act.writeback.triton_kernels", None)
        check(MultiTensor(adam, missing), columns, rows)
    float64 = [[t.double() for t in column] if j == 2 else column for j, column in enumerate(columns)]
    check(MultiTensor(adam, interpreted_pass(interpreted, "adam")), float64, rows)
    check(MultiTensor(adam, interpreted_pass(interpreted, "adam")), columns, rows, flat=False)

    failing = interpreted_pass(types.SimpleNamespace(triton=interpreted.triton, tl=interpreted.tl,
                                                     adam_kernel=_Failing()), "adam")
    check(MultiTensor(adam, failing), columns, rows)
    assert failing.failed and "out of resources" in failing.failed
    said = [r.getMessage() for r in caplog.records if "Triton kernel does not take" in r.getMessage()]
    assert len(said) == 4, said
    assert any("Triton is unavailable" in s for s in said) and any("torch.float64" in s for s in said)
    assert any("not all contiguous" in s for s in said) and any("launch failed" in s for s in said)


@pytest.fixture(scope="module")
def compiled() -> types.ModuleType:
    return load_kernels(interpret=False)


class _StandInDriver:
    """What Triton's JIT asks of a driver to bind a launch: a device, a stream and an H100's target."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def compiled_as_launched(kernels: types.ModuleType, kind: str, columns: list[list], rows: list[torch.Tensor],
                         flags: tuple) -> tuple[dict, dict]:
    """The compile request of :class:`TritonPass`'s launch, as Triton's own JIT binds it (on a stand-in driver: no
    GPU; its compile hook takes the request, so nothing compiles or launches there), and the code it compiles to
    for an H100 (up to the machine code, which needs no GPU either)."""
    from triton.compiler import ASTSource
    from triton.runtime.driver import driver

    requests = []

    def capture(*, compile, **_):
        requests.append(compile)
        return True

    previous = driver._active
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.jit_cache_hook = capture
        driver.set_active(_StandInDriver())
        try:
            assert triton_pass.TritonPass(kind, device_type="cpu", kernels=kernels)(columns, rows, flags, True, {})
        finally:
            driver.set_active(previous)
    (request,) = requests
    source = ASTSource(getattr(kernels, triton_pass.KERNELS[kind]), request["signature"],
                       constexprs=request["constants"], attrs=request["configs"][0])
    options = {"num_warps": request["num_warps"], "enable_fp_fusion": request["enable_fp_fusion"]}
    return request, triton.compile(source, target=_StandInDriver().get_current_target(), options=options).asm


@pytest.mark.parametrize(("kind", "flags", "grads"), [
    ("adam", ("compensated", "stochastic", False), torch.float32),  # every op: the residual, v, the sign and decay
    ("sgd", ("stochastic", "nearest", True), torch.bfloat16),
], ids=["adam", "sgd-nesterov"])
def test_the_gpu_code_has_no_fused_multiply_add_and_64_bit_offsets(compiled, kind, flags, grads):
    """What the interpreter cannot show, read from the code the pass's launch compiles to for a GPU: fusion off in
    its options, no fused multiply-add (the eager ops round every product), the correctly rounded division and
    square root and no flushing of subnormals, every element address from int64 offsets, and 16-byte loads and
    stores of whole blocks where the addresses are aligned (as these are)."""
    columns, rows = bucket(kind, [0, 1, 19, 4096], torch.bfloat16, grads, flags[0] == "compensated")
    request, asm = compiled_as_launched(compiled, kind, columns, rows, flags)
    assert request["enable_fp_fusion"] is False and request["num_warps"] == triton_pass.NUM_WARPS
    ptx, ttir = asm["ptx"], asm["ttir"]
    assert "fma." not in ptx and ".ftz" not in ptx and ".approx" not in ptx
    if kind == "adam":
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
    element_addresses = [line for line in ttir.splitlines() if "tt.addptr" in line and "tensor<" in line]
    assert element_addresses and all("xi64>" in line.split(":")[-1] for line in element_addresses)
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx


def test_the_eager_fallback_takes_a_parameter_past_two_to_the_31(monkeypatch):
    """The eager pass a declined bucket takes walks a parameter of more than 2^31 elements in pieces whose noise
    counters start past 2^31 (wrapping as int32, as the kernel's): meta tensors, no memory, with tables on the CPU
    (which check the int32 range; the per-element values are 0-d and mix with meta)."""
    monkeypatch.setattr(kernels, "EAGER_CHUNK", 1 << 30)
    numel = (1 << 31) + 5
    meta = [[torch.empty(numel, dtype=torch.bfloat16, device="meta")] for _ in range(5)]
    meta[1] = [None]
    rows = [torch.zeros(1, 8), torch.zeros(1, 2, dtype=torch.int32)]
    MultiTensor(adam)(meta, rows, ("stochastic", "stochastic", True), compiled=False)


def test_only_the_kernels_module_imports_triton():
    """The package imports and runs without Triton: only the kernels' module imports it, and only the CUDA pass
    imports that, at its first call."""
    package = Path(triton_pass.__file__).resolve().parents[2]
    importers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                       if any(isinstance(node, (ast.Import, ast.ImportFrom))
                              and any(name.split(".")[0] == "triton" for name in _imported(node))
                              for node in ast.walk(ast.parse(path.read_text()))))
    assert importers == ["act/writeback/triton_kernels.py"]


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA (the interpreter tests above stand in)")


def on_cuda(columns: list[list], rows: list[torch.Tensor]) -> tuple[list[list], list[torch.Tensor]]:
    return ([[None if t is None else t.cuda() for t in column] for column in columns], [r.cuda() for r in rows])


@CUDA
@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cuda_kernel_writes_the_eager_bits_on_the_gpu(kind, dtype):
    """On a GPU: the package's own kernels (one launch per call) against the eager ops on the same device, in every
    rounding, on sizes around the real block and chunk and a tensor of millions of elements; each call once."""
    sizes = [0, 1, 37, triton_pass.BLOCK - 1, triton_pass.BLOCK + 1, triton_pass.CHUNK + 1, 2 * triton_pass.CHUNK + 3,
             3_000_001]
    cases = ADAM_CASES if kind == "adam" else SGD_CASES
    for case in (c for c in cases if c[-1] == dtype):
        weights, moments = case[0], case[1]
        flag = case[2] if kind == "adam" else case[3]
        columns, rows = on_cuda(*bucket(kind, sizes, DTYPES[dtype], torch.float32, weights == "compensated",
                                        moments=kind == "adam" or case[2], seed=3))
        flags = (weights, moments, flag)
        got = copied(columns)
        step = triton_pass.TritonPass(kind)
        assert step(got, rows, flags, True, {}), step.failed
        assert_same_bits(got, eager(kind, columns, rows, flags))
