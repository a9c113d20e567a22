"""The torch families' pass on a CUDA device: a bucket's whole update in one Triton launch (:mod:`.triton_kernels`).

:class:`TritonPass` takes a bucket's columns as :class:`.kernels.MultiTensor` does and launches one kernel over all of
them: one program per chunk of :data:`CHUNK` elements of one tensor, whatever the number of tensors. The tables the
kernel reads (addresses of the weights, residuals and moments, element counts, the chunk list) are built and uploaded
once per bucket (its state tensors are the same step after step); the gradients' addresses are read each step and
uploaded (pinned, without waiting) only when they differ from the last step's. Anything the kernel cannot take (no
Triton, a dtype it does not read, tensors that are not contiguous, a failed compile or launch) is found before any
tensor is touched: the caller then runs its eager ops (the same bits), and the reason is logged once.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale.act.writeback.kernels import SECOND_STREAM
from lightning_stale.transfers import to_device

BLOCK = 1024  # elements per step of a program's loop: 8 per thread at 4 warps (16-byte accesses of bf16)
CHUNK = 16 * BLOCK  # elements per program (multi_tensor_apply's chunks): the grid is the bucket's count of chunks
NUM_WARPS = 4
ALIGNMENT = 16  # bytes: where every address of a bucket is a multiple, the kernel reads and writes 16 bytes at once
STATE_DTYPES = (torch.bfloat16, torch.float16)  # weights, residuals and moments
GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNELS = {"adam": "adam_kernel", "sgd": "sgd_kernel"}
TRITON_MIN = (3, 4)  # the oldest Triton the kernels are checked on (3.2's interpreter cannot run them; torch 2.8+)


class _Tables:
    """A bucket's device tables, built once: the state columns' addresses (w, c, then the moments; 0 where None),
    element counts and chunk list (int32 (2, chunks): each one's tensor and its index there), the columns' storage
    dtypes, whether every address is aligned; and the last gradients' addresses, table and dtype."""

    __slots__ = ("aligned", "chunks", "device", "grad_dtype", "grads", "grads_aligned", "grads_table", "has_c",
                 "moments", "n", "n_chunks", "numels", "state", "weights")

    def __init__(self, columns: Sequence[Sequence[Any]], chunk: int) -> None:
        weights, moments = columns[0], columns[3] if len(columns) > 3 else [None]
        self.device, self.n = weights[0].device, len(weights)
        self.weights, self.moments = weights[0].dtype, None if moments[0] is None else moments[0].dtype
        self.has_c = columns[1][0] is not None
        numels = [t.numel() for t in weights]
        state = [column for j, column in enumerate(columns) if j != 2]
        host = torch.tensor([[0 if t is None else t.data_ptr() for t in column] for column in state] + [numels],
                            dtype=torch.int64)
        self.aligned = not bool((host[:-1] % ALIGNMENT).any())
        counts = (host[-1] + chunk - 1) // chunk
        self.n_chunks = int(counts.sum())
        owner = torch.repeat_interleave(torch.arange(self.n), counts)
        first = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        chunks = torch.stack([owner, torch.arange(self.n_chunks) - first]).to(torch.int32)
        self.state, self.numels = to_device(host[:-1], self.device), to_device(host[-1], self.device)
        self.chunks = to_device(chunks, self.device)
        self.grads: tuple[int, ...] | None = None
        self.grads_table: Tensor | None = None
        self.grads_aligned = False
        self.grad_dtype: torch.dtype | None = None


def _refusal(columns: Sequence[Sequence[Any]], flat: bool, chunk: int) -> str | None:
    """Why the kernel cannot take a bucket's state columns (checked once per bucket), or None: every column but
    the gradients (checked every step) one dtype it stores (the residuals the weights', the moments one), on the
    weights' device, contiguous, each tensor as large as its weight; the residuals and moments all there or all
    None; chunks that a grid and their int32 indices hold (tensors up to 2^31 chunks, 3.5e13 elements)."""
    if not flat:
        return "its tensors are not all contiguous"
    weights = columns[0]
    device, numels = weights[0].device, [t.numel() for t in weights]
    if sum(-(-numel // chunk) for numel in numels) >= 1 << 31:
        return "more chunks than a launch holds"
    moments = {column[0].dtype for column in columns[3:] if column[0] is not None}
    if len(moments) > 1 or (columns[1][0] is not None and columns[1][0].dtype != weights[0].dtype):
        return "moments or residuals of a dtype other than the weights'"
    for j, column in enumerate(columns):
        if j == 2 or (j > 0 and all(t is None for t in column)):
            continue
        dtype = column[0].dtype if column[0] is not None else None
        if dtype not in STATE_DTYPES:
            return f"state tensors of dtype {dtype}"
        for t, numel in zip(column, numels):
            if t is None or type(t) is not Tensor or t.dtype != dtype or t.device != device or not t.is_contiguous() \
                    or t.numel() != numel:
                return "state tensors of more than one kind (dtype, device, size or layout)"
    return None


def _rows_refusal(rows: Sequence[Tensor], device: torch.device) -> str | None:
    """Why the per-member tables (fp32 scalars, int32 noise keys) cannot be read by the kernel, or None."""
    scalars, keys = rows
    if scalars.dtype != torch.float32 or keys.dtype != torch.int32 or scalars.device != device \
            or keys.device != device:
        return "scalar or key tables of another dtype or device"
    return None


class TritonPass:
    """One Triton launch per bucket for the family update ``kernel`` (``"adam"`` or ``"sgd"``), on tensors of
    ``device_type``; returns False, having touched nothing, where the kernel cannot run (see the module).

    ``kernels``: the module of kernels (default: :mod:`.triton_kernels`, imported at the first call; a copy loaded
    under Triton's interpreter runs on CPU tensors). ``block``, ``chunk``: the elements of a program's step and of
    its chunk."""

    def __init__(self, kernel: str, device_type: str = "cuda", kernels: ModuleType | None = None,
                 block: int = BLOCK, chunk: int = CHUNK) -> None:
        self.kernel, self.device_type, self.block, self.chunk = KERNELS[kernel], device_type, block, chunk
        self._kernels = kernels
        self._loaded = False
        self.failed: str | None = None  # why no kernel runs in this process (no Triton, a failed launch)
        self._said: set[str] = set()

    def __call__(self, columns: Sequence[Sequence[Any]], rows: Sequence[Tensor], flags: tuple[Any, ...], flat: bool,
                 cache: dict[str, Any] | None = None) -> bool:
        """The update of the bucket ``columns`` (w, c, g, then the moments), ``rows`` (scalars, noise keys) and
        ``flags`` (weights' rounding, moments' rounding, the family's flag) in one launch: True; else False, and
        the reason logged once. ``cache``: the bucket's own dict, which keeps its tables from step to step."""
        why = self._load()
        if why is None:
            tables = self._tables(columns, flat, cache)
            why = tables if isinstance(tables, str) else (
                self._grads(tables, columns[2]) or _rows_refusal(rows, tables.device)
                or self._launch(tables, rows, flags))
        if why is None:
            return True
        if why not in self._said:
            self._said.add(why)
            _compat.log.info("[lightning_stale] the weight write-back's Triton kernel does not take a bucket (%s); "
                             "using eager ops", why)
        return False

    def _tables(self, columns: Sequence[Sequence[Any]], flat: bool, cache: dict[str, Any] | None) -> _Tables | str:
        """The bucket's tables, or why the kernel cannot take it: built at its first step, kept in ``cache`` (the
        state columns are the same lists of the same tensors until the bucket is rebuilt)."""
        key = "triton", tuple(id(column) for j, column in enumerate(columns) if j != 2)
        tables = None if cache is None else cache.get(key)
        if tables is None:
            tables = _refusal(columns, flat, self.chunk) or _Tables(columns, self.chunk)
            if cache is not None:
                cache[key] = tables
        return tables

    def _load(self) -> str | None:
        """Import the kernels at the first call; why not, where they cannot be imported or their Triton is older
        than :data:`TRITON_MIN` (then for good)."""
        if not self._loaded:
            self._loaded = True
            try:
                if self._kernels is None:
                    self._kernels = importlib.import_module("lightning_stale.act.writeback.triton_kernels")
                version = self._kernels.triton.__version__
            except Exception as error:  # noqa: BLE001 - no (working) Triton: the eager ops
                self.failed = f"Triton is unavailable: {error}"
            else:
                if _release(version) < TRITON_MIN:
                    self.failed = (f"Triton {version} is older than {'.'.join(map(str, TRITON_MIN))}, the oldest "
                                   "its kernels are checked on")
        return self.failed

    def _grads(self, tables: _Tables, grads: Sequence[Tensor]) -> str | None:
        """This step's gradients checked (plain contiguous tensors of one dtype the kernel reads) and their addresses
        uploaded where they changed since the last step (one pinned copy, no wait)."""
        kinds = {(g.dtype, g.is_contiguous() and type(g) is Tensor) for g in grads}
        ((dtype, plain),) = kinds if len(kinds) == 1 else ((None, False),)
        if dtype not in GRAD_DTYPES or not plain:
            return f"gradients of (dtype, contiguous) {sorted(map(str, kinds))}"
        tables.grad_dtype = dtype
        addresses = tuple(g.data_ptr() for g in grads)
        if addresses != tables.grads:
            host = torch.tensor(addresses, dtype=torch.int64)
            tables.grads, tables.grads_table = addresses, to_device(host, tables.device)
            tables.grads_aligned = not bool((host % ALIGNMENT).any())
        return None

    def _launch(self, tables: _Tables, rows: Sequence[Tensor], flags: tuple[Any, ...]) -> str | None:
        """The one launch (none for a bucket of empty tensors); why not, where compiling or launching fails (then
        for good: it failed before the kernel ran, so nothing was written)."""
        if tables.n_chunks == 0:
            return None
        kernels = self._kernels
        tl = kernels.tl  # type: ignore[union-attr]
        scalars, keys = (row.contiguous() for row in rows)
        names = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
        try:
            getattr(kernels, self.kernel)[(tables.n_chunks,)](
                tables.state, tables.grads_table, tables.numels, tables.chunks, tables.n_chunks, scalars, keys,
                tables.n, scalars.stride(0), W=names[tables.weights], G=names[tables.grad_dtype],
                S=names[tables.moments or tables.weights], HAS_C=tables.has_c, HAS_S=tables.moments is not None,
                FLAG=bool(flags[2]), STOCHASTIC_W=flags[0] == "stochastic", STOCHASTIC_M=flags[1] == "stochastic",
                ALIGN=ALIGNMENT if tables.aligned and tables.grads_aligned else 1, BLOCK=self.block,
                CHUNK=self.chunk, SECOND=SECOND_STREAM, num_warps=NUM_WARPS, enable_fp_fusion=False)
        except Exception as error:  # noqa: BLE001 - a kernel that does not compile or launch here: the eager ops
            self.failed = f"its launch failed: {type(error).__name__}: {error}"
            return self.failed
        return None


def _release(version: str) -> tuple[int, ...]:
    """The (major, minor) of a version string such as ``"3.4.0+git1234"``."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])
