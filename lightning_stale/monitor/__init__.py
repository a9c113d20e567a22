"""The monitor itself: StaleStateMonitor, the per-optimizer pipeline, the cross-rank sum, the logged metrics, the
fit-start announcement, the saved state's version, the options and the messages.

``from lightning_stale.monitor import StaleStateMonitor`` is resolved on first use, so that the lower layers can import
:mod:`lightning_stale.monitor.messages` and friends without importing the monitor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_LAZY = {
    "StaleStateMonitor": "lightning_stale.monitor.monitor",
    "MonitorOptions": "lightning_stale.monitor.options",
    "ResetEvent": "lightning_stale.act.interventions",
    "ResetListener": "lightning_stale.act.interventions",
    "StaleStateInternalWarning": "lightning_stale.monitor.messages",
    "StaleStateWarning": "lightning_stale.monitor.messages",
}

if TYPE_CHECKING:
    from lightning_stale.act.interventions import ResetEvent, ResetListener
    from lightning_stale.monitor.messages import StaleStateInternalWarning, StaleStateWarning
    from lightning_stale.monitor.monitor import StaleStateMonitor
    from lightning_stale.monitor.options import MonitorOptions

__all__ = ["MonitorOptions", "ResetEvent", "ResetListener", "StaleStateInternalWarning", "StaleStateMonitor",
           "StaleStateWarning"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_stale.monitor' has no attribute {name!r}")
