"""Reference optimizers with low-precision moment storage."""

from lightning_stale.optim.quantized_adamw import MOMENTS, QuantizedAdamW

__all__ = ["MOMENTS", "QuantizedAdamW"]
