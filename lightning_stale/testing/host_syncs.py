"""HostSyncCounter: count, per optimizer step, the operations that would block the host on an accelerator.

On CUDA a host read of a device tensor (``.item()``, ``bool()``, ``float()``, ``.tolist()``, ``.numpy()``,
``.cpu()``), an operation whose output size depends on the data (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``), ``torch.equal``/``allclose`` and a host-to-device copy from pageable memory wait for
the device's queue to drain. While entered, the counter sees every aten operation (a ``TorchDispatchMode``) and every
torch function (a ``TorchFunctionMode``: some reads dispatch nothing on the CPU), attributes each event to the code
that caused it (by default only the package's steps, hooks and readouts count: not a user's forward pass nor the
optimizer's own step) and tallies it per optimizer step (torch's global step pre-hook starts a new step); steps that
log are marked apart.

On a CPU run every tensor is on the host, so the counter tells what would be on the device by its birth: a tensor
made from Python data or by a factory without a ``device`` argument or with ``device="cpu"`` (``torch.tensor(rows)``,
``torch.zeros(n)``, ``torch.from_numpy``, torch.optim's non-capturable ``step``), moved with ``.cpu()`` or
``.to("cpu")``, or computed only from such tensors, stays on the host on an accelerator too, and reading it blocks
nothing; every other tensor (parameters, gradients, optimizer state, what is made with ``device=param.device``)
would be on the device. Reads are counted there, and the copies of host data into device tensors (``copy_``); a
``.to(param.device)`` cannot be told from host work there, so uploads are counted exactly on a device run:
:class:`~lightning_stale.testing.meta.MetaStandIn` runs the step path on torch's ``meta`` device and counts them,
with whether they came from pinned memory.
"""

from __future__ import annotations

import sys
import sysconfig
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_stale import _compat

aten = torch.ops.aten

# Operations that block the host on CUDA whatever their arguments (their result is read or sized on the host).
READ_OPS = frozenset({
    aten._local_scalar_dense, aten.nonzero, aten.equal, aten.is_nonzero, aten.allclose, aten.masked_select,
    aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive,
})
_HOST_READS = frozenset({Tensor.tolist, Tensor.numpy, Tensor.__array__})  # read without dispatching on the CPU
_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})  # new tensors from Python data

_PACKAGE = Path(__file__).resolve().parent.parent
_SELF = Path(__file__).resolve().parent
_LIBRARIES = tuple(sorted({str(Path(p).resolve()) for key, p in sysconfig.get_paths().items()
                           if key in ("stdlib", "platstdlib", "purelib", "platlib")}
                          | {str(Path(torch.__file__).resolve().parent)}))


@dataclass(frozen=True)
class SyncEvent:
    """One operation that would block the host on an accelerator (or an upload that would not).

    Attributes:
        kind: ``"read"`` (a device value reaches the host) or ``"upload"`` (host data copied to a device).
        op: the operation (``aten._local_scalar_dense``, ``Tensor.tolist``, ``torch.tensor``, ...).
        where: ``file:line in function`` of the code it is attributed to (the package's innermost frame where it is
            the package's).
        ours: whether the package caused it (with ``scope=None`` the others are tallied too).
        pinned, non_blocking: for uploads, whether the source was pinned memory and the copy asked not to block (the
            one kind of upload that does not wait).
    """

    kind: str
    op: str
    where: str
    ours: bool
    pinned: bool = False
    non_blocking: bool = False

    @property
    def blocking(self) -> bool:
        """Whether it blocks the host: every read, and an upload unless it is pinned and non-blocking."""
        return self.kind == "read" or not (self.pinned and self.non_blocking)


@dataclass
class StepTally:
    """What one optimizer step caused: from torch's step pre-hook of that step to the next step's (its hooks, the
    write-back, and the logging that follows it). Step 0 is everything before the first optimizer step."""

    index: int
    logs: bool = False
    events: list[SyncEvent] = field(default_factory=list)

    @property
    def reads(self) -> int:
        """The host reads tallied in this step."""
        return sum(1 for e in self.events if e.kind == "read")

    @property
    def uploads(self) -> int:
        """The uploads tallied in this step (pinned and non-blocking or not)."""
        return sum(1 for e in self.events if e.kind == "upload")

    @property
    def syncs(self) -> int:
        """The tallied events that block the host: the reads and the uploads from pageable memory."""
        return sum(1 for e in self.events if e.blocking)


class HostSyncCounter:
    """Count the operations that would block the host on an accelerator, per optimizer step, while entered::

        with HostSyncCounter() as syncs:
            for step, batch in enumerate(loader):
                ...
                optimizer.step()
                if step % 50 == 0:
                    syncs.mark_logging()  # this step logs: its reads are tallied apart
                    print(monitor.compute())
        print(syncs.summary())  # per step: reads, uploads, and where they came from
        assert not syncs.offenders(after=3), syncs.summary(syncs.offenders(after=3))

    Enter it before the optimizer's first step (it tells host tensors from device ones by their birth, see the
    module). Every optimizer's step starts a new tally (two optimizers: two tallies per batch).

    Args:
        scope: ``"lightning_stale"`` (default): count only what the package causes (the innermost frame that is
            neither a library's nor an optimizer's own ``step`` lies in the package); ``None``: count everything
            (your own code, the optimizer's step, the framework's logging).

    A pair of torch modes: every tensor operation is slower while it is entered (for tests and one-off checks).
    ``torch.compile``d regions compile and run as they would without it, unseen (a whole graph holds no host read;
    what breaks a graph runs eagerly, and is counted).
    """

    device_type = "cpu"  # the device the run's parameters live on

    def __init__(self, scope: str | None = "lightning_stale") -> None:
        if scope not in ("lightning_stale", None):
            raise ValueError(f"scope must be 'lightning_stale' or None, got {scope!r}")
        self.scope = scope
        self.tallies: list[StepTally] = [StepTally(0)]
        self._modes: list[Any] = []
        self._undo: list[Any] = []
        self._kinds: dict[str, str] = {}  # file name -> "package" | "library" | "user"
        self._host: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()  # CPU run: host-born
        self._quiet = 0  # inside a read already recorded at the function level: its aten ops are not recorded again

    # -- use ---------------------------------------------------------------------------------------------------------
    def __enter__(self) -> HostSyncCounter:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        hook = register_optimizer_step_pre_hook(lambda *_: self._next_step())
        from_numpy = torch.from_numpy  # not a torch function a mode sees: wrapped, its tensors are host-born

        def host_from_numpy(array: Any) -> Tensor:
            return self._born_on_host(from_numpy(array))

        torch.from_numpy = host_from_numpy
        self._undo = [hook.remove, lambda: setattr(torch, "from_numpy", from_numpy)]
        self._modes = [_Functions(self), _compat.dispatch_mode(self._dispatch)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for undo in reversed(self._undo):
            undo()
        self._modes, self._undo = [], []

    def mark_logging(self) -> None:
        """Mark the current step as one that logs (its reads are expected: they do not grow with the tensors)."""
        self.tallies[-1].logs = True

    def offenders(self, after: int = 0) -> list[StepTally]:
        """The steps from step ``after`` on that do not log and block the host (what should be none after set-up)."""
        return [t for t in self.tallies[after:] if not t.logs and t.syncs]

    def summary(self, tallies: list[StepTally] | None = None) -> str:
        """The steps' counts and where each event came from, one line per step and place (for messages)."""
        lines = []
        for tally in self.tallies if tallies is None else tallies:
            places: dict[str, int] = {}
            for e in tally.events:
                place = f"{e.kind} {e.op}{'' if e.blocking else ' (pinned, non-blocking)'} at {e.where}"
                places[place] = places.get(place, 0) + 1
            lines.append(f"step {tally.index}{' (logs)' if tally.logs else ''}: {tally.reads} reads, "
                         f"{tally.uploads} uploads" + "".join(f"\n    {n} x {p}" for p, n in sorted(places.items())))
        return "\n".join(lines)

    # -- what lives where --------------------------------------------------------------------------------------------
    def is_host(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` lives on the host on the run's accelerator too (on a CPU run: born there, see the
        module)."""
        if tensor.device.type != "cpu":
            return False
        return self.device_type != "cpu" or self._host.get(id(tensor)) is tensor

    def is_pinned(self, tensor: Tensor) -> bool:
        """Whether the host tensor ``tensor`` is in pinned memory."""
        try:
            return bool(tensor.is_pinned())
        except RuntimeError:  # no accelerator to pin for
            return False

    def _born_on_host(self, out: Any, source: Any = None) -> Any:
        """Note the CPU tensors in ``out`` as host-born (on a CPU run), except ``source`` itself (a move to the host
        of a tensor already there returns it: it stays where it was born)."""
        if self.device_type == "cpu":
            for tensor in _tensors(out):
                if tensor.device.type == "cpu" and tensor is not source:
                    self._host[id(tensor)] = tensor
        return out

    # -- recording ---------------------------------------------------------------------------------------------------
    def _next_step(self) -> None:
        self.tallies.append(StepTally(len(self.tallies)))

    def record(self, kind: str, op: str, pinned: bool = False, non_blocking: bool = False) -> None:
        """Tally one event of the step in progress (where ``scope`` counts it)."""
        ours, where = self._attribute()
        if ours or self.scope is None:
            self.tallies[-1].events.append(SyncEvent(kind, op, where, ours, pinned, non_blocking))

    def _attribute(self) -> tuple[bool, str]:
        """Whether the package caused the event being recorded, and where: the innermost frame that is neither a
        library's (torch, the standard library, installed packages, generated code), nor this counter's or a torch
        mode's handler, decides; an optimizer's own ``step`` (its class not the package's) decides against."""
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            handler = frame.f_code.co_name in ("__torch_dispatch__", "__torch_function__")
            kind = "library" if handler else self._kind(frame.f_code.co_filename)
            if kind == "package":
                return True, _place(frame)
            if kind == "user" or (frame.f_code.co_name == "step"
                                  and isinstance(frame.f_locals.get("self"), torch.optim.Optimizer)):
                return False, _place(frame)
            frame = frame.f_back
        return False, "?"

    def _kind(self, filename: str) -> str:
        kind = self._kinds.get(filename)
        if kind is None:
            path = None if filename.startswith("<") else Path(filename).resolve()
            if path is None or "torchinductor" in filename or path.is_relative_to(_SELF):
                kind = "library"
            elif path.is_relative_to(_PACKAGE):
                kind = "package"
            else:
                kind = "library" if str(path).startswith(_LIBRARIES) else "user"
            self._kinds[filename] = kind
        return kind

    # -- the modes' handlers -----------------------------------------------------------------------------------------
    def _function(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Every torch function while entered: on a CPU run, tally the reads that dispatch nothing there
        (``tolist``, ``numpy``, ``cpu()``); tally the tensors made from Python data on an accelerator (a pageable
        upload); note the tensors born on the host."""
        first = args[0] if args else None
        moves = func in (Tensor.cpu, Tensor.to) and _to_host(func, args, kwargs)
        if isinstance(first, Tensor) and first.device.type == "cpu" and not self.is_host(first) and (
                func in _HOST_READS or moves):
            self.record("read", f"Tensor.{func.__name__}")
            self._quiet += 1
            try:
                out = func(*args, **kwargs)
            finally:
                self._quiet -= 1
            if out is first:  # cpu() of a CPU tensor is the tensor: its host copy is an alias, born on the host
                out = aten.alias(first)
            return self._born_on_host(out)
        if func in _FROM_DATA and not isinstance(first, Tensor) and _device_type(kwargs.get("device")) not in (
                None, "cpu"):
            self.record("upload", f"torch.{func.__name__}")
        out = func(*args, **kwargs)
        if moves or (_names_the_host(kwargs.get("device")) and next(_tensors((args, kwargs)), None) is None):
            self._born_on_host(out, first)  # moved to the host, or a factory or Python data made there
        return out

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Every aten operation while entered: tally the ones that would block the host, then run it; its outputs are
        host-born where all its tensor inputs are (and it moves nothing to a named device)."""
        packet = func.overloadpacket
        host = all(self.is_host(t) for t in _tensors((args, kwargs)))
        if not self._quiet:
            if not host and (packet in READ_OPS or (packet is aten.index and _bool_index(args))):
                self.record("read", str(packet))
            elif packet is aten.copy_ or packet is aten._to_copy:
                self._copy(packet, args, kwargs)
        out = func(*args, **kwargs)
        if host and not (packet is aten._to_copy and kwargs.get("device") is not None) \
                and next(_tensors((args, kwargs)), None) is not None:
            self._born_on_host(out)
        return out

    def _copy(self, packet: Any, args: tuple, kwargs: dict) -> None:
        """Tally a copy between the host and the device: a read (device to host) or an upload. On a CPU run, only a
        copy into or out of an existing host-born tensor is seen (``.to(param.device)`` is a copy to the CPU there)."""
        if packet is aten.copy_:
            target, source = args[0], args[1]
            if not isinstance(source, Tensor):
                return
            to_host, from_host = self.is_host(target), self.is_host(source)
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        elif self.device_type == "cpu":
            return
        else:
            source = args[0]
            to_host = (_device_type(kwargs.get("device")) or source.device.type) == "cpu"
            from_host, non_blocking = self.is_host(source), bool(kwargs.get("non_blocking", False))
        if to_host and not from_host:
            self.record("read", str(packet))
        elif from_host and not to_host:
            self.record("upload", str(packet), pinned=self.is_pinned(source), non_blocking=non_blocking)


class _Functions(TorchFunctionMode):
    """The counter's ``TorchFunctionMode`` (torch functions and Tensor methods, before they dispatch)."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if torch.compiler.is_compiling():  # traced by dynamo: a compiled region neither reads nor uploads unseen
            return func(*args, **(kwargs or {}))
        return self.counter._function(func, args, kwargs or {})


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in ``value`` and in the lists, tuples and dicts it holds."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _place(frame: FrameType) -> str:
    filename = frame.f_code.co_filename
    try:
        shown = str(Path(filename).resolve().relative_to(_PACKAGE.parent))
    except ValueError:
        shown = filename
    return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"


def _device_type(device: Any) -> str | None:
    return None if device is None else torch.device(device).type


def _names_the_host(device: Any) -> bool:
    """Whether a factory's ``device`` argument makes the tensor on the host on any machine: none given, or the CPU
    named by a string (``device=param.device`` is the device, also where that is the CPU)."""
    return device is None or (isinstance(device, str) and device.startswith("cpu"))


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.cpu`` or ``Tensor.to`` call moves a tensor to the host (``cpu()``, or ``to`` with a device
    named ``"cpu"`` by a string: ``to(param.device)`` is a move to the device, also where that is the CPU)."""
    if func is Tensor.cpu:
        return True
    device = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(device, str) and device.startswith("cpu")


def _bool_index(args: tuple) -> bool:
    """Whether an ``aten.index`` call indexes with a boolean mask (its output size is read on the host)."""
    return len(args) > 1 and any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
