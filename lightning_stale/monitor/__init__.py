"""The monitor itself: StaleStateMonitor, the per-optimizer pipeline, the window as a torchmetrics Metric and the
arithmetic of its row, the fit-start announcement and the options."""

from __future__ import annotations

from lightning_stale.act.interventions import ResetEvent, ResetListener
from lightning_stale.messages import StaleStateInternalWarning, StaleStateWarning
from lightning_stale.monitor.monitor import StaleStateMonitor
from lightning_stale.monitor.options import MonitorOptions
from lightning_stale.monitor.window import StaleStateMetric

__all__ = ["MonitorOptions", "ResetEvent", "ResetListener", "StaleStateInternalWarning", "StaleStateMetric",
           "StaleStateMonitor", "StaleStateWarning"]
