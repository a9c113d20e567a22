"""The write-back's shared kernels: per-element noise, the weight and moment writes, and the multi-tensor pass.

A family's update is a function of one parameter's tensors (``one``) that reads them in their storage dtype, computes
in fp32 and writes them back in place. :class:`MultiTensor` runs it over lists of tensors: ``torch.compile``d in
groups of :data:`GROUP` tensors (one generated kernel loop per tensor, one Python call per group, no per-tensor
dispatch), or eagerly one tensor at a time for small buckets and where no compiler works. Both give the same bits on
CPU: the math is separate products and sums (no fused multiply-add) and the eager square root goes through fp64 (the
compiled one is correctly rounded; torch's eager fp32 CPU sqrt is off by an ulp for some inputs).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale.formats.floats import nearest_on_grid, on_grid
from lightning_stale.formats.noise import NOISE_MASK, as_int32, counter_hash, counter_mix, keyed_hash, mix32

if TYPE_CHECKING:
    from lightning_stale.act.writeback.triton_pass import TritonPass

GROUP = 8  # tensors per compiled call; a shorter tail runs as groups of 4, 2 and 1 (one graph per length)
# Elements per eager call: the eager ops materialize a dozen fp32 temporaries of what they are given, so flat
# tensors go through in pieces of this size (compiled calls fuse everything into one loop and hold no temporaries).
EAGER_CHUNK = 1 << 20
# The same on an accelerator, where each eager op is a kernel launch of some microseconds: pieces of 16M elements
# (about 0.5 GB of fp32 temporaries) keep a large parameter's launches per step few.
ACCELERATOR_CHUNK = 1 << 24


def eager_chunk(device: torch.device) -> int:
    """Elements per eager call on ``device`` (:data:`EAGER_CHUNK` on the CPU, :data:`ACCELERATOR_CHUNK` elsewhere)."""
    return EAGER_CHUNK if device.type == "cpu" else ACCELERATOR_CHUNK
# Elements of each tensor of a graph's first call: Inductor tunes the loops it generates to the sizes it compiles with
# (on CPU a low-precision loop under 32 elements gets half the vector width; on GPU the block sizes), and the graph
# then serves every size, so each graph compiles on stand-ins of about this size, whatever the first parameters are.
# The i-th tensor's stand-ins have COMPILE_NUMEL + i elements: tensors of different sizes then get sizes of their own
# in the graph even where duck shaping (equal sizes made one) cannot be switched off.
COMPILE_NUMEL = 4096
# Tensors of at least this many elements never go to a graph directly: the code generated for a graph may index
# them with 32-bit integers, which dynamo's guards protect (it recompiles for such sizes) and a direct call skips.
INDEX_LIMIT = 1 << 31
SECOND_STREAM = 0x6D6F6D73  # the key of a second, independent hash of the same counter


def sqrt(x: Tensor) -> Tensor:
    """A correctly rounded fp32 square root, eager and compiled alike."""
    return x.sqrt() if torch.compiler.is_compiling() else x.double().sqrt().float()


def step_key(seed: int, count: int) -> int:
    """The int32 key of the write-back's ``count``-th step under ``seed``, from which every parameter's noise keys
    follow (:func:`noise_keys`)."""
    return as_int32(mix32(mix32(seed) ^ count))


def noise_base(indices: Tensor, starts: Tensor) -> Tensor:
    """What :func:`noise_keys` needs of each parameter, int32 (n, 4) on ``indices``' device, built once per set of
    parameters: the key-independent round of the hash of its ``indices`` (its position among the optimizer's
    parameters, the same on every rank) and of their second stream, and (``starts``, 0): the flat position of this
    process's shard in the whole parameter. No rank enters: replicated ranks draw alike, and shards draw what the
    whole parameter would."""
    return torch.stack([counter_mix(indices), counter_mix(indices ^ SECOND_STREAM), starts,
                        torch.zeros_like(starts)], dim=1)


def noise_keys(key: int, base: Tensor) -> Tensor:
    """(counter offset, hash key) per parameter, int32 (n, 2), for the step's ``key``: the hash of each parameter's
    index under ``key`` plus its shard's start, and the hash of its second stream (``base``: :func:`noise_base`; a
    dozen small ops per step whatever the number of parameters)."""
    return keyed_hash(base[:, :2], key) + base[:, 2:]


def noise(like: Tensor, keys: Tensor, second: bool = False) -> Tensor:
    """32 random bits (int32) per element of the flat ``like``: the hash of the element's position plus the
    parameter's counter offset, under its key (``keys``: that parameter's row of :func:`noise_keys`); ``second``: an
    independent second draw for the same elements."""
    counter = torch.arange(like.numel(), dtype=torch.int32, device=like.device).view(like.shape) + keys[0]
    key = keys[1] ^ SECOND_STREAM if second else keys[1]
    return counter_hash(counter, key)


def write_weight(param: Tensor, buffer: Tensor | None, new: Tensor, rounding: str, bits: Tensor | None) -> None:
    """The fp32 weight ``new`` written into ``param`` (its storage dtype), in place: ``"nearest"``; ``"stochastic"``
    (``bits``' low half as noise); ``"compensated"``: to nearest, with what that rounding left out (exact in fp32, at
    most half a grid gap) stored into ``buffer``, which the next update adds back in."""
    if rounding == "stochastic":
        param.copy_(on_grid(new, param.dtype, bits & NOISE_MASK))
    elif buffer is None:
        param.copy_(new)
    else:
        rounded = nearest_on_grid(new, param.dtype)
        buffer.copy_(new - rounded)
        param.copy_(rounded)


def write_moments(stored: Sequence[Tensor], values: Sequence[Tensor], rounding: str, bits: Tensor | None) -> None:
    """fp32 ``values`` (one or two moments) written into their ``stored`` tensors (the parameter's dtype), in place:
    to nearest, or stochastically (the first with ``bits``' low half as noise, the second with its high half)."""
    for i, (target, value) in enumerate(zip(stored, values)):
        if rounding == "stochastic":
            value = on_grid(value, target.dtype, (bits >> 16 if i else bits) & NOISE_MASK)
        target.copy_(value)


def weight_target(param: Tensor, buffer: Tensor | None) -> Tensor:
    """The weight being optimized, in fp32: the stored one plus its compensation residual."""
    return param.float() if buffer is None else param.float() + buffer.float()


def _loop(columns: Sequence[Sequence[Any]], rows: Sequence[Tensor], flags: tuple[Any, ...]) -> None:
    """``one`` over the tensors at each position of ``columns`` with the same rows of the per-tensor ``rows`` tables
    (the template of every :class:`MultiTensor`'s compiled function; ``one`` is its global)."""
    for i in range(len(columns[0])):
        one(*[column[i] for column in columns], *[row[i] for row in rows], *flags)  # noqa: F821 - a global of its copy


def _small(numels: Sequence[int]) -> tuple[int, ...] | None:
    """A group's part of its graph's key: None where every tensor has at least 2 elements, else each one's numel
    capped at 2 (dynamo specializes sizes 0 and 1, so such a group needs a graph of its own)."""
    return None if min(numels) > 1 else tuple(min(n, 2) for n in numels)


@cache
def _groups(count: int) -> tuple[tuple[int, int], ...]:
    """(start, stop) of the compiled calls over ``count`` tensors: groups of GROUP, then halving lengths."""
    out, start, length = [], 0, GROUP
    while start < count:
        while start + length > count:
            length //= 2
        out.append((start, start + length))
        start += length
    return tuple(out)


class MultiTensor:
    """A one-tensor update ``one(*tensors, *rows, *flags)`` run over lists of tensors.

    ``columns``: equally long lists (flat, contiguous tensors, or None entries; tensors of their own shape where
    ``flat`` is False), ``rows``: per-tensor tables (one row each; the last are the noise keys of :func:`noise_keys`),
    ``flags``: constants (rounding names, dtypes) each combination of which compiles once. Compiled calls take
    :data:`GROUP` tensors at a time with dynamic sizes, so one graph serves any sizes; each graph is compiled on
    stand-ins of about :data:`COMPILE_NUMEL` elements and then called directly (dynamo's per-call work, most of a
    small call's cost, is done once), where the call passes what dynamo's guards would check (:meth:`_direct`), else
    through dynamo. Each kernel has its own code object, hence its own dynamo cache. Eagerly, flat tensors go through
    in pieces of :func:`eager_chunk` elements (a piece's noise counter starts where it starts: the same bits).
    Should compiling fail, the eager loop is used from then on (same bits). On the device of ``device_pass`` (CUDA:
    :class:`.triton_pass.TritonPass`, one kernel launch per call) that pass runs instead, both compiled and not, and
    the eager loop where it declines."""

    def __init__(self, one: Callable[..., None], device_pass: TritonPass | None = None) -> None:
        self.one = one
        self.device_pass = device_pass
        code = _loop.__code__.replace(co_name=f"{one.__name__}_multi_tensor")
        self._loop = types.FunctionType(code, {**_loop.__globals__, "one": one}, code.co_name)
        self._capture = _compat.CapturingInductor()
        self._compiled: Callable[..., None] | None = None
        # (flags, column kinds, table kinds) -> (group length, :func:`_small`) -> the graph's direct call (None:
        # through dynamo only)
        self._graphs: dict[tuple[Any, ...], dict[tuple[Any, ...], tuple[Callable[..., Any], Any] | None]] = {}
        # column position -> (id and length of the list last checked there, a weak reference to its first tensor,
        # its kind): no reference that would keep a step's gradients alive
        self._checked: dict[int, tuple[int, int, Any, Any]] = {}
        self.failed = False

    def __call__(self, columns: Sequence[Sequence[Any]], rows: Sequence[Tensor], flags: tuple[Any, ...],
                 compiled: bool, flat: bool = True, cache: dict[str, Any] | None = None) -> None:
        """The update over ``columns``; ``cache``: the bucket's own dict, where a device pass keeps its tables."""
        device = self.device_pass
        if device is not None and columns[0] and columns[0][0].device.type == device.device_type:
            if device(columns, rows, flags, flat, cache):
                return
            compiled = False  # what it declines runs eagerly (the same bits)
        if compiled and not self.failed:
            try:
                self._run_compiled(columns, rows, flags)
                return
            except Exception as error:  # noqa: BLE001 - no working compiler here: the eager ops give the same bits
                self.failed = True
                _compat.log.info("[lightning_stale] the compiled weight write-back is unavailable (%s); using eager "
                                 "ops", error)
        chunk = eager_chunk(rows[-1].device)
        for i in range(len(columns[0])):
            tensors, table = [column[i] for column in columns], [row[i] for row in rows]
            numel = tensors[0].numel()
            if not flat or numel <= chunk:
                self.one(*tensors, *table, *flags)
                continue
            for start in range(0, numel, chunk):
                piece = [None if t is None else t[start:start + chunk] for t in tensors]
                keys = table[-1].clone()
                keys[0] += as_int32(start)  # the piece's counter offset (int32, wrapping), without an upload
                self.one(*piece, *table[:-1], keys, *flags)

    def _run_compiled(self, columns: Sequence[Sequence[Any]], rows: Sequence[Tensor], flags: tuple[Any, ...]) -> None:
        """Every graph this call needs compiled first (so a failure to compile touches no tensor), then one call per
        group: directly where the call passes what the graph's guards would check (:meth:`_direct`), else through
        dynamo (its guards pick or compile the graph). A group with tensors of 0 or 1 elements has a graph of its
        own (:func:`_small`)."""
        if self._compiled is None:
            self._compiled = torch.compile(self._loop, dynamic=True, fullgraph=True, backend=self._capture)
        checked = [self._kind(j, column) for j, column in enumerate(columns)]
        direct = self._direct(checked, rows)
        with _compat.multi_tensor_compile():
            groups = _groups(len(columns[0]))
            pieces = [row.split([stop - start for start, stop in groups]) for row in rows]  # one call per table
            numels = next(kind[2] for kind in checked if kind) if direct else tuple(t.numel() for t in columns[0])
            kinds = tuple(None if column[0] is None else (column[0].dtype, column[0].device) for column in columns)
            tables = tuple((row.dtype, row.device, row.shape[1:]) for row in rows)
            graphs = self._graphs.setdefault((flags, kinds, tables), {})
            shapes = [(stop - start, _small(numels[start:stop])) for start, stop in groups]
            for g, shape in enumerate(shapes):
                if shape not in graphs:
                    graphs[shape] = self._compile(shape, kinds, [piece[g] for piece in pieces], flags)
            for g, (start, stop) in enumerate(groups):
                group, table = [column[start:stop] for column in columns], [piece[g] for piece in pieces]
                graph = graphs[shapes[g]] if direct else None
                if graph is None:
                    self._compiled(group, table, flags)
                else:
                    call, read = graph
                    call(*read({"columns": group, "rows": table, "flags": flags}))

    @staticmethod
    def _direct(checked: Sequence[Any], rows: Sequence[Tensor]) -> bool:
        """Whether a call whose columns are ``checked`` (:meth:`_kind` of each) may skip dynamo: everything its guards
        check of the inputs that the graph (keyed by flags, each column's first dtype and device, the tables' dtypes,
        devices and widths, the group length and :func:`_small`) does not fix: each column plain 1-D contiguous
        tensors of one dtype and device that need no gradient (or all None); a parameter's tensors of one size in
        every column (each gets one size in the graph, which dynamo's guards unify: a direct call would loop over
        one column's size in all); every size under :data:`INDEX_LIMIT`; contiguous tables on the columns' device.
        Tensors of one call that share storage are distinct parameters' or states' (no element written twice)."""
        if False in checked:
            return False
        kinds = [kind for kind in checked if kind]
        sizes, device = kinds[0][2], kinds[0][1]
        return (all(kind[2] == sizes and kind[1] == device for kind in kinds) and max(sizes, default=0) < INDEX_LIMIT
                and all(row.is_contiguous() and row.device == device for row in rows))

    def _compile(self, shape: tuple[int, tuple[int, ...] | None], kinds: tuple[Any, ...], rows: Sequence[Tensor],
                 flags: tuple[Any, ...]) -> tuple[Callable[..., Any], Any] | None:
        """The graph for a group of ``shape`` (its length and :func:`_small`) and column ``kinds`` compiled on zero
        stand-ins (what it computes on them is discarded): of ``COMPILE_NUMEL + i`` elements for the i-th tensor, or
        of the 0 or 1 elements of the group's tensors that have so few (dynamo gives those sizes graphs of their own);
        and its direct call (None where dynamo reused a graph it had)."""
        length, small = shape
        numels = [COMPILE_NUMEL + i if small is None or small[i] > 1 else small[i] for i in range(length)]
        stand_ins = [[None if kind is None else torch.zeros(n, dtype=kind[0], device=kind[1]) for n in numels]
                     for kind in kinds]
        self._capture.last = None
        self._compiled(stand_ins, [torch.zeros_like(row) for row in rows], flags)
        return self._capture.last

    def _kind(self, position: int, column: Sequence[Any]) -> Any:
        """What every entry of ``column`` is, as far as a graph compiled for its first entry could be called on all of
        them without dynamo's guards: None (all None), (dtype, device, numels) for plain 1-D contiguous tensors of
        one dtype and device that need no gradient, False otherwise. A list is checked once while it is the last one
        seen at its position (a bucket's state columns are the same lists step after step, with the same first
        tensor; its gradients are new each step)."""
        first = column[0]
        last = self._checked.get(position)
        if last is not None and last[:2] == (id(column), len(column)) and (last[2] is None if first is None
                                                                           else last[2]() is first):
            return last[3]
        if first is None:
            kind = None if all(t is None for t in column) else False
        else:
            dtype, device = first.dtype, first.device
            plain = all(type(t) is Tensor and t.dtype == dtype and t.device == device and not t.requires_grad
                        and t.dim() == 1 and t.is_contiguous() for t in column)
            kind = (dtype, device, tuple(t.numel() for t in column)) if plain else False
        self._checked[position] = (id(column), len(column), None if first is None else weakref.ref(first), kind)
        return kind
