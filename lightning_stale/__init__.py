"""lightning_stale: measure and reset stale low-precision optimizer states in PyTorch Lightning.

Heavy modules (Lightning, bitsandbytes) are imported on first use so that ``lightning-stale --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "StaleStateCallback": "lightning_stale.integrations.callback",
    "StaleStateMonitor": "lightning_stale.monitor.monitor",
    "StaleStateMetric": "lightning_stale.monitor.window",
    "MonitorOptions": "lightning_stale.monitor.options",
    "ResetEvent": "lightning_stale.act.interventions",
    "QuantizedAdamW": "lightning_stale.optim",
    "adapter_for": "lightning_stale.adapters",
    "register_adapter": "lightning_stale.adapters",
}

if TYPE_CHECKING:
    from lightning_stale.adapters import adapter_for, register_adapter
    from lightning_stale.integrations.callback import StaleStateCallback
    from lightning_stale.act.interventions import ResetEvent
    from lightning_stale.monitor.monitor import StaleStateMonitor
    from lightning_stale.monitor.window import StaleStateMetric
    from lightning_stale.monitor.options import MonitorOptions
    from lightning_stale.optim import QuantizedAdamW

__all__ = [
    "MonitorOptions", "ResetEvent", "StaleStateCallback", "StaleStateMetric", "StaleStateMonitor", "QuantizedAdamW",
    "adapter_for", "register_adapter",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_stale' has no attribute {name!r}")
