"""Find the adapter that reads and resets an optimizer's stored moments.

Built-in adapters cover torch.optim, bitsandbytes, torchao and :class:`lightning_stale.optim.QuantizedAdamW`; the
library adapters are registered only when the library is already imported (an optimizer of that library exists,
so nothing heavy is imported here). Other packages add adapters with :func:`register_adapter` or through the
entry-point group ``lightning_stale.adapters``: each entry point loads either a zero-argument callable (called once;
it calls :func:`register_adapter` itself) or an ``(optimizer_cls, adapter_cls)`` pair.
"""

from __future__ import annotations

import sys
import warnings
from importlib.metadata import entry_points

import torch

from lightning_stale import _compat
from lightning_stale.adapters.protocol import MOMENTS, Moment, OptimizerAdapter, Slot

__all__ = ["ENTRY_POINT_GROUP", "MOMENTS", "Moment", "OptimizerAdapter", "Slot", "adapter_for", "has_adapter",
           "inner_optimizer", "register_adapter"]

ENTRY_POINT_GROUP = "lightning_stale.adapters"

_REGISTRY: dict[type, type[OptimizerAdapter]] = {}
_LOADED: set[str] = set()

# Built-in adapter modules, each registered once its library (the key) is imported.
_BUILTINS = {
    "torch": "lightning_stale.adapters.torch_optim",
    "bitsandbytes": "lightning_stale.adapters.bitsandbytes",
    "torchao.optim": "lightning_stale.adapters.torchao",
    "lightning_stale.optim": "lightning_stale.adapters.quantized",
}


def register_adapter(optimizer_cls: type, adapter_cls: type[OptimizerAdapter]) -> None:
    """Use ``adapter_cls`` for ``optimizer_cls`` and its subclasses (a later registration for a class wins)."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
    if not (isinstance(adapter_cls, type) and issubclass(adapter_cls, OptimizerAdapter)):
        raise TypeError(f"adapter_cls must be an OptimizerAdapter subclass, got {adapter_cls!r}")
    _REGISTRY[optimizer_cls] = adapter_cls


def _load_registrations() -> None:
    """Register built-in adapters of imported libraries and, once, the entry points of installed packages."""
    import importlib

    for library, module in _BUILTINS.items():
        if library in sys.modules and module not in _LOADED:
            _LOADED.add(module)
            try:
                adapters = importlib.import_module(module).ADAPTERS
            except Exception as error:  # noqa: BLE001 - a library release whose internals moved: its optimizers only
                warnings.warn(f"lightning_stale cannot read {library} optimizers with this installation "
                              f"({type(error).__name__}: {error}); other optimizers are unaffected", stacklevel=3)
                continue
            for optimizer_cls, adapter_cls in adapters.items():
                _REGISTRY.setdefault(optimizer_cls, adapter_cls)
    if ENTRY_POINT_GROUP not in _LOADED:
        _LOADED.add(ENTRY_POINT_GROUP)
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            loaded = entry.load()
            if isinstance(loaded, tuple) and len(loaded) == 2:
                register_adapter(*loaded)
            elif callable(loaded):
                loaded()
            else:
                raise TypeError(
                    f"entry point {entry.name!r} in {ENTRY_POINT_GROUP!r} must load a callable register() or an "
                    f"(optimizer_cls, adapter_cls) pair, got {type(loaded).__name__}"
                )


def _lookup(optimizer: object) -> type[OptimizerAdapter] | None:
    for cls in type(optimizer).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return None


def unwrap(optimizer: object) -> object:
    """Strip Lightning's ``LightningOptimizer`` wrapper."""
    return _compat.unwrap_lightning_optimizer(optimizer)


def inner_optimizer(optimizer: object) -> object:
    """The optimizer that ``optimizer`` stands for: Lightning's wrapper stripped, and wrappers that hold one as
    ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, DeepSpeed's) followed down to a registered class."""
    _load_registrations()
    inner = unwrap(optimizer)
    while _lookup(inner) is None and isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = unwrap(inner.optimizer)
    return inner


def has_adapter(optimizer: object) -> bool:
    """Whether an adapter is registered for ``optimizer`` (or the optimizer it wraps), as :func:`adapter_for` finds
    it with ``strict=True``."""
    return _lookup(inner_optimizer(optimizer)) is not None


def adapter_for(optimizer: object, strict: bool = True) -> OptimizerAdapter:
    """The adapter for ``optimizer`` (a torch optimizer, a ``LightningOptimizer`` or a DeepSpeed-style wrapper with
    an ``.optimizer`` attribute).

    With ``strict=False`` an unknown optimizer gets the generic adapter (every tensor in its state is a slot) and a
    warning; with ``strict=True`` it raises TypeError.
    """
    inner = inner_optimizer(optimizer)
    adapter_cls = _lookup(inner)
    if adapter_cls is not None:
        return adapter_cls(inner)
    name = f"{type(inner).__module__}.{type(inner).__qualname__}"
    if strict:
        supported = ", ".join(sorted(f"{c.__module__}.{c.__qualname__}" for c in _REGISTRY)) or "none"
        raise TypeError(
            f"no lightning_stale adapter for optimizer {name}. Supported (with subclasses): {supported}; "
            "bitsandbytes, torchao and lightning_stale.optim optimizers are added once their library is imported. "
            "Register one with lightning_stale.register_adapter(OptimizerClass, AdapterClass) or the entry-point "
            f"group {ENTRY_POINT_GROUP!r} (see examples/custom_optimizer_adapter.py), or pass strict=False to "
            "treat every tensor in optimizer.state as a slot."
        )
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a wrapper of one), got {name}")
    from lightning_stale.adapters.generic import GenericAdapter

    warnings.warn(f"no adapter registered for {name}: using the generic adapter (guessing from state keys)",
                  stacklevel=2)
    return GenericAdapter(inner)
