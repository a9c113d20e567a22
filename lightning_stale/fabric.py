"""The documented import path of the Lightning Fabric front-end (:mod:`lightning_stale.integrations.fabric`)."""

from lightning_stale.integrations.fabric import StaleStateFabricCallback

__all__ = ["StaleStateFabricCallback"]
