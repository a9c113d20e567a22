"""The adapter protocol: how the tracker sees and resets one optimizer family's stored moments.

An adapter hides one library's state layout. It exposes the stored moments as :class:`Slot` objects (one per
parameter and moment) whose codes can be compared step to step, and it resets chosen moments in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

Moment = Literal["m", "v"]
MOMENTS: tuple[Moment, ...] = ("m", "v")


@dataclass(eq=False)
class Slot:
    """One stored moment of one parameter.

    Subclasses override the ``*_at`` methods when they can gather a few elements without touching the whole tensor
    (the tracker samples up to ``sample_size`` elements per slot every step).

    Attributes:
        param: the parameter this moment belongs to.
        moment: canonical moment name, ``"m"`` (signed EMA of g) or ``"v"`` (EMA of g**2).
        beta: EMA decay of this moment, or ``None`` when the buffer is not an EMA (SGD momentum, Adagrad sums).
        format: a name from :mod:`lightning_stale.formats` (``"int8_dynamic"``, ``"bf16"``, ``"fp8_e4m3"``,
            ``"fp4"``, ``"fp32"`` ...) or a free-form description of a foreign grid.
        key: the optimizer-state key (or a description) this slot reads, for messages and logging.
        signal: what the EMA averages: ``"g"`` for first moments, ``"g2"`` for second moments.
    """

    param: Tensor
    moment: Moment
    beta: float | None
    format: str
    key: str
    signal: Literal["g", "g2"] = "g"
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.codes().numel()

    def codes(self) -> Tensor:
        """A tensor (one element per stored value) whose unchanged elements mean the stored value did not move."""
        raise NotImplementedError

    def value(self) -> Tensor:
        """Dequantized fp32 values, flat."""
        raise NotImplementedError

    def spacing(self) -> Tensor | None:
        """Absolute local grid spacing at each stored value (ulp convention), flat; ``None`` if unknown."""
        return None

    def codes_at(self, index: Tensor) -> Tensor:
        """Codes at flat indices ``index``."""
        return self.codes().reshape(-1)[index]

    def value_at(self, index: Tensor) -> Tensor:
        """Dequantized fp32 values at flat indices ``index``."""
        return self.value().reshape(-1)[index]

    def grad_at(self, index: Tensor) -> Tensor | None:
        """The gradient elements that fed this slot's last update (fp32), or ``None`` when there is no gradient."""
        grad = self.param.grad
        if grad is None:
            return None
        return grad.reshape(-1)[index].float()

    def zero_code_mask_at(self, index: Tensor) -> Tensor:
        """True where the stored value at ``index`` is exactly zero (used for the v-underflow metric)."""
        return self.value_at(index) == 0


class OptimizerAdapter(ABC):
    """Reads and resets the stored moments of one optimizer instance.

    Attributes:
        family: short name of the optimizer family shown in logs (``"bitsandbytes"``, ``"torchao"``, ...).
        exact_moment_reset: True when a single moment can be reset with its own bias-correction age (the paper's
            asymmetric reset); False when the optimizer shares one step counter and a safe approximation is used.
    """

    family: str = "unknown"
    exact_moment_reset: bool = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @abstractmethod
    def slots(self) -> list[Slot]:
        """The state slots that exist now (state appears lazily after the first step)."""

    @abstractmethod
    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        """Reset the chosen moments (None = all) of the chosen params (None = all) in place, bias-correction age
        included, to the state a freshly constructed optimizer would have."""

    def builtin_stall_counts(self) -> dict[tuple[int, Moment], tuple[int, int]] | None:
        """Per ``(id(param), moment)``: (stalled, counted) of the last step, when the optimizer counts them itself."""
        return None

    def describe(self) -> str:
        """One line for the fit-start summary."""
        return f"{type(self.optimizer).__name__} ({self.family})"
