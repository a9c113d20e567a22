"""The monitor itself: StaleStateMonitor, the per-optimizer pipeline, the logged metrics, the fit-start announcement
and the options."""

from __future__ import annotations

from lightning_stale.act.interventions import ResetEvent, ResetListener
from lightning_stale.messages import StaleStateInternalWarning, StaleStateWarning
from lightning_stale.monitor.monitor import StaleStateMonitor
from lightning_stale.monitor.options import MonitorOptions

__all__ = ["MonitorOptions", "ResetEvent", "ResetListener", "StaleStateInternalWarning", "StaleStateMonitor",
           "StaleStateWarning"]
