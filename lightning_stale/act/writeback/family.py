"""The optimizer-family protocol of the weight write-back, and the registry that finds a family by optimizer class.

A family is one file (``families/<name>.py``): the whole update of the parameters the write-back takes over, as that
optimizer computes it but in fp32 and with the weight written by the chosen rounding (:mod:`.kernels`); how its
moments are read and written; when its state for a parameter exists; what it refuses and why. The write-back core
(:mod:`.writeback`) owns the hooks, the choice of parameters, the compensation buffers and the checkpoints, and calls
the family once per bucket of parameters per step.
"""

from __future__ import annotations

import importlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale.act.writeback.kernels import noise_base
from lightning_stale.formats.noise import as_int32
from lightning_stale.transfers import to_device


@dataclass(eq=False)
class Member:
    """One parameter the write-back takes over, as its bucket holds it (built when the taken-over set changes).

    Attributes:
        index: its position among all the optimizer's parameters (the same on every rank).
        param: the parameter (a DTensor under FSDP2).
        group: its parameter group; ``position``: (group index, index in the group).
        local: this process's elements of it (the shard's storage under FSDP2, else the parameter).
        buffer: this process's elements of its compensation buffer (compensated rounding), else None.
        start: flat position of ``local``'s first element in the whole parameter (noise keys).
    """

    index: int
    param: Tensor
    group: dict[str, Any]
    position: tuple[int, int]
    local: Tensor
    buffer: Tensor | None
    start: int


@dataclass(eq=False)
class Write:
    """How this step writes: the weights' rounding, the moments' rounding (families that store moments in the
    parameter's dtype), the step's noise key (:func:`.kernels.step_key`) and the bucket's table of this step
    (:meth:`Family.scalars`, on the bucket's device; None where the family has none)."""

    weights: str
    moments: str
    key: int
    scalars: Tensor | None = None


@dataclass(eq=False)
class Columns:
    """Per-member data of a bucket, aligned with its members: Python lists (tensors, numbers) and tensors indexed by
    member; :meth:`subset` keeps the members that step now (the ones with a gradient)."""

    lists: dict[str, list[Any]] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    flat: bool = True  # every tensor is taken flat (all contiguous: :func:`flat_alias`); else in its own shape, eagerly
    compiled: bool = False  # the bucket's pass runs torch.compile'd (flat, enough elements, a compiler)
    sharded: bool = False  # the members are DTensors (their gradients too): the passes take their local shards
    cache: dict[str, Any] = field(default_factory=dict)  # a device pass's tables of these members (a subset: none)

    def view(self, tensor: Tensor) -> Tensor:
        """``tensor`` as this bucket's passes take it: flat (:func:`flat_alias`) where the bucket is, else as it is."""
        return flat_alias(tensor) if self.flat else tensor

    def subset(self, take: Sequence[int]) -> Columns:
        """The columns of the members at ``take``: their rows stacked from views (no index tensor to upload)."""
        return Columns({name: [values[i] for i in take] for name, values in self.lists.items()},
                       {name: torch.stack([t[i] for i in take]) for name, t in self.tensors.items()}, self.flat,
                       self.compiled, self.sharded)


def flat_alias(tensor: Tensor) -> Tensor:
    """``tensor``'s elements as a 1-D tensor that is not a view (the same storage and version counter where it is
    contiguous, as every tensor a bucket writes is; a copy of a gradient that is not): Dynamo guards a view's base,
    whose rank differs between parameters (1-D norms, 2-D matrices), and would compile, and check on every call, one
    graph per pattern of ranks in a group of tensors."""
    return tensor.reshape(-1).detach()


def member_columns(members: list[Member]) -> Columns:
    """The columns every family's bucket has: the weights ``w`` and compensation buffers ``c`` (None where there is
    none) as the passes take them, the members' ``noise`` table (:func:`.kernels.noise_base` of their indices and
    shard starts, on their device), and each one's param ``group`` (int64 on the host: it picks rows of the host
    table of the groups' hyper-parameters, which go to the device with every bucket's in one copy per step)."""
    device = members[0].local.device
    contiguous = all(m.local.is_contiguous() for m in members)
    compiled = contiguous and _compat.compiles(sum(m.local.numel() for m in members), device)
    columns = Columns(flat=contiguous, compiled=compiled, sharded=any(_compat.is_dtensor(m.param) for m in members))
    columns.lists["w"] = [columns.view(m.local) for m in members]
    columns.lists["c"] = [None if m.buffer is None else columns.view(m.buffer) for m in members]
    columns.tensors["noise"] = to_device(noise_base(torch.tensor([m.index for m in members], dtype=torch.int32),
                                                    torch.tensor([as_int32(m.start) for m in members],
                                                                 dtype=torch.int32)), device)
    columns.tensors["group"] = torch.tensor([m.position[0] for m in members], dtype=torch.long)
    return columns


class Family(ABC):
    """One optimizer family's whole update of the parameters taken over, computed in fp32 (see the module).

    Subclasses set ``moment_roundings`` (the roundings of the moments they can write: ``("nearest",)`` where the
    optimizer stores them in its own format, with ``"stochastic"`` where they are stored in the parameter's dtype)."""

    moment_roundings: ClassVar[tuple[str, ...]] = ("nearest",)

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def refusal(self) -> str | None:
        """Why this optimizer's configuration cannot be taken over (a user error), or None."""
        return None

    @abstractmethod
    def ready(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        """Whether the optimizer has initialised its state (``state``, empty if none) for a parameter of ``group``:
        the write-back takes it over from then on (optimizers initialise a parameter's state only while it is
        empty, so nothing of the write-back's may be there first)."""

    def bucket_key(self, member: Member) -> tuple[Any, ...]:
        """Members with equal keys are updated in one multi-tensor pass (default: device, dtype and whether they can
        be taken flat)."""
        return member.local.device, member.local.dtype, member.local.is_contiguous()

    @abstractmethod
    def prepare(self, members: list[Member]) -> Columns:
        """The per-member data of one bucket that stays until the taken-over set changes (state tensors' flat views,
        step counters, group indices)."""

    def scalars(self, members: list[Member], columns: Columns) -> Tensor | None:
        """This step's table of ``members`` (those of a bucket with a gradient this step), called before any bucket
        is updated: the optimizer's step counters advanced and, where it needs them, its per-member numbers of this
        step (hyper-parameters, bias corrections) on the host, or on the device where the counters live there. The
        write-back copies the host tables of every bucket of a device there in one pinned, non-blocking upload per
        step and hands each bucket its own as ``write.scalars``. None (the default): no table."""
        return None

    @abstractmethod
    def update(self, members: list[Member], columns: Columns, grads: list[Tensor], write: Write) -> None:
        """The whole step of ``members`` (those of a bucket with a gradient this step; ``columns`` and ``grads``
        aligned with them, gradients this process's flat elements): moments, weights and compensation buffers in
        place, and the optimizer's step counters advanced (where :meth:`scalars` did not). The optimizer's own step
        then skips them."""


_REGISTRY: dict[type, type[Family]] = {}
_LOADED: set[str] = set()
# Built-in family modules, each registered once its library (the key) is imported.
_BUILTINS = {
    "torch": ("torch_adam", "torch_sgd"),
    "bitsandbytes": ("bnb_adam", "bnb_lion"),
    "lightning_stale.optim": ("quantized",),
}


def register_family(optimizer_cls: type, family_cls: type[Family]) -> None:
    """Take over the weights of ``optimizer_cls`` (that exact class: a subclass may change the update) with
    ``family_cls``."""
    if not (isinstance(family_cls, type) and issubclass(family_cls, Family)):
        raise TypeError(f"family_cls must be a Family subclass, got {family_cls!r}")
    _REGISTRY[optimizer_cls] = family_cls


def _load_builtins() -> None:
    """Register the built-in families of the libraries imported so far (nothing heavy is imported here)."""
    for library, modules in _BUILTINS.items():
        if library not in sys.modules:
            continue
        for name in modules:
            module = f"lightning_stale.act.writeback.families.{name}"
            if module not in _LOADED:
                _LOADED.add(module)
                for optimizer_cls, family_cls in importlib.import_module(module).FAMILIES.items():
                    _REGISTRY.setdefault(optimizer_cls, family_cls)


def family_for(optimizer: torch.optim.Optimizer) -> Family | None:
    """The family that takes over ``optimizer``'s weights (its exact class), or None."""
    _load_builtins()
    family_cls = _REGISTRY.get(type(optimizer))
    return None if family_cls is None else family_cls(optimizer)


def supported() -> str:
    """The optimizer classes with a family, for messages."""
    _load_builtins()
    return ", ".join(sorted(f"{c.__module__}.{c.__qualname__}" for c in _REGISTRY))
