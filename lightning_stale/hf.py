"""The documented import path of the Hugging Face Trainer front-end (:mod:`lightning_stale.integrations.hf`)."""

from lightning_stale.integrations.hf import StaleStateHFCallback, add_stale_callback

__all__ = ["StaleStateHFCallback", "add_stale_callback"]
