"""Tools for tests that see the accelerator's step path on a CPU-only machine: :class:`HostSyncCounter` counts, per
optimizer step, the operations that would block the host on an accelerator; :class:`MetaStandIn` runs the step path
on torch's ``meta`` device (a non-CPU device without data) and counts the same, uploads included."""

from lightning_stale.testing.host_syncs import HostSyncCounter, StepTally, SyncEvent
from lightning_stale.testing.meta import MetaStandIn

__all__ = ["HostSyncCounter", "MetaStandIn", "StepTally", "SyncEvent"]
