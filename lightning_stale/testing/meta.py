"""MetaStandIn: run the package's step path on a device that is not the CPU, without one, and count its host syncs.

torch's ``meta`` device holds shapes, dtypes and devices but no data, on the CPU build. A CPU tensor of more than 0
dimensions meeting a meta one raises, as it does with a CUDA one, so every tensor made on the wrong device shows up.
What cannot run on meta is a read of a value: :class:`MetaStandIn` answers each one (``.item()``, ``bool()``,
``float()``, ``.tolist()``, ``.cpu()``, ``nonzero``, a boolean mask, ...) with zeros and counts it like
:class:`~lightning_stale.testing.HostSyncCounter`, which it is. It also sees every upload exactly (a CPU tensor
copied to meta, a tensor made from Python data on meta) and whether it came from pinned memory without blocking
(``pin_memory()`` is stood in for: the copy is marked pinned), and it raises where a random draw would take a
generator of another device than the tensor it fills (CUDA raises there; meta does not).

What it cannot stand in for: kernels without a meta implementation (torch's fused AdamW refuses meta parameters,
bitsandbytes' 8-bit kernels read the codes on the host) and ``torch.compile`` (no compiler for meta: the package's
kernels run their eager form there).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from lightning_stale.testing.host_syncs import HostSyncCounter, _bool_index, _tensors

aten = torch.ops.aten
_FALSE_READS = frozenset({aten.equal, aten.is_nonzero, aten.allclose})
# operations that move data between the host and the device by design (counted as reads and uploads)
_CROSSING = frozenset({aten.copy_, aten._to_copy, aten._copy_from, aten._copy_from_and_resize, aten._pin_memory,
                       aten.is_pinned, aten.lift_fresh, aten.lift_fresh_copy, aten.detach, aten.alias})
_INDEXING = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})


class MetaStandIn(HostSyncCounter):
    """A :class:`HostSyncCounter` for a run whose parameters, gradients and optimizer state live on ``meta``::

        with torch.device("meta"):
            model = build_model()
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        monitor = StaleStateMonitor(optimizer, remedy="auto")
        with MetaStandIn() as meta:
            for step in range(20):
                model(torch.randn(8, 32, device="meta")).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        assert not meta.offenders(after=2), meta.summary()

    Reads of meta tensors are answered with zeros (by anyone: a framework's loss logging too), and counted where
    ``scope`` says; an upload counts as blocking unless it came from ``pin_memory()`` and asked ``non_blocking``.
    """

    device_type = "meta"

    def __init__(self, scope: str | None = "lightning_stale") -> None:
        super().__init__(scope)
        self._pinned: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    def is_pinned(self, tensor: Tensor) -> bool:
        return self._pinned.get(id(tensor)) is tensor

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        packet = func.overloadpacket
        if packet is aten._pin_memory:  # no accelerator to pin for: a copy marked as pinned
            copy = args[0].clone()
            self._pinned[id(copy)] = copy
            return copy
        if packet is aten.is_pinned:
            return self.is_pinned(args[0])
        _check_generators(args, kwargs)
        if packet not in _CROSSING:
            self._check_devices(packet, args, kwargs)
        if any(isinstance(a, Tensor) and a.device.type == "meta" for a in args):
            answer = self._answer(packet, args, kwargs)
            if answer is not _NONE:
                return answer
        return super()._dispatch(func, args, kwargs)

    def _check_devices(self, packet: Any, args: tuple, kwargs: dict) -> None:
        """Raise, as CUDA does, where a host tensor of more than 0 dimensions meets a meta one (some meta kernels let
        an in-place operation through); an index on the host is an implicit upload there (counted)."""
        tensors = list(_tensors((args, kwargs)))
        if not any(t.device.type == "meta" for t in tensors):
            return
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if not host:
            return
        if packet in _INDEXING:
            self.record("upload", f"{packet} (a host index)")
            return
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, meta and "
                           f"cpu! ({packet})")

    def _answer(self, packet: Any, args: tuple, kwargs: dict) -> Any:
        """The stand-in result of a host read of a meta tensor (recorded), or _NONE where it is not one."""
        first = args[0]
        if packet is aten._local_scalar_dense:
            self.record("read", str(packet))
            return False if first.dtype == torch.bool else 0 if not first.dtype.is_floating_point else 0.0
        if packet in _FALSE_READS:
            self.record("read", str(packet))
            return False
        if packet is aten.nonzero:
            self.record("read", str(packet))
            return torch.empty((0, first.dim()), dtype=torch.long, device=first.device)
        if packet is aten.masked_select:
            self.record("read", str(packet))
            return first.new_empty(0)
        if packet is aten.index and _bool_index(args):
            self.record("read", str(packet))
            none = torch.empty(0, dtype=torch.long, device=first.device)
            indices = [[none] * i.dim() if isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) else [i]
                       for i in args[1]]
            return aten.index(first, [i for group in indices for i in group])
        if packet is aten._to_copy and first.device.type == "meta" and torch.device(
                kwargs.get("device") or first.device).type == "cpu":
            self.record("read", str(packet))
            return torch.zeros(first.shape, dtype=kwargs.get("dtype") or first.dtype)
        if packet is aten.copy_ and first.device.type == "cpu" and args[1].device.type == "meta":
            self.record("read", str(packet))
            return first.zero_()
        return _NONE

    def _function(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in (Tensor.numpy, Tensor.__array__) and args and isinstance(args[0], Tensor) \
                and args[0].device.type == "meta":
            self.record("read", f"Tensor.{func.__name__}")
            return func(torch.zeros(args[0].shape, dtype=args[0].dtype), *args[1:], **kwargs)
        return super()._function(func, args, kwargs)


_NONE = object()  # no stand-in answer: the operation runs as it is


def _check_generators(args: tuple, kwargs: dict) -> None:
    """Raise, as CUDA does, where a random draw takes a generator of another device type than the tensor it makes
    or fills."""
    generators = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)]
    if not generators:
        return
    device = kwargs.get("device")
    if device is None:
        device = next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))
    for generator in generators:
        if generator.device.type != torch.device(device).type:
            raise RuntimeError(f"Expected a '{torch.device(device).type}' device type for generator but found "
                               f"'{generator.device.type}'")
