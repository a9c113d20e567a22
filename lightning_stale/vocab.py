"""The package's shared vocabulary: the names of the moments, of the quantities the engine measures and of the
rounding modes, and the checks of user arguments.

The checks give a bad value one message shape, ``ValueError("`name` must be <what>, got <value>")`` (:func:`invalid`),
and the options, the front-ends and ``QuantizedAdamW`` run them where the argument is given (construction or setup),
never inside a training step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar

Moment = Literal["m", "v"]
MOMENTS: tuple[Moment, ...] = ("m", "v")
# What the engine measures: the moments, and the weights where they are stored below fp32 (a bf16 weight's write
# stalls like a moment's). Only moments are reset.
WEIGHT = "w"
QUANTITIES: tuple[str, ...] = (*MOMENTS, WEIGHT)

Rounding = Literal["nearest", "stochastic"]
ROUNDINGS: tuple[Rounding, ...] = ("nearest", "stochastic")
# How the weight write-back stores a weight: a state rounding, or compensated summation (a residual buffer beside it).
WeightRounding = Literal["nearest", "stochastic", "compensated"]
WEIGHT_ROUNDINGS: tuple[WeightRounding, ...] = (*ROUNDINGS, "compensated")
# The monitors' ``weights`` option: off, or the write-back's weight rounding; "<rounding>+moments" also rounds the
# moments it writes in the parameter's dtype (torch.optim's bf16/fp16 states) stochastically instead of to nearest.
WEIGHT_WRITES: tuple[str, ...] = ("off", "stochastic", "compensated", "stochastic+moments", "compensated+moments")
# The optimizer-state key of a parameter's compensation buffer (its weight's rounding residual, in its dtype): not a
# moment; every front-end's optimizer checkpoint carries it.
COMPENSATION_KEY = "lightning_stale.compensation"

T = TypeVar("T")


def invalid(name: str, what: str, value: object) -> ValueError:
    """The one message shape for a bad argument: ```name` must be <what>, got <value>``."""
    return ValueError(f"`{name}` must be {what}, got {value!r}")


def check_choice(name: str, value: T, allowed: Sequence[T]) -> T:
    """``value`` if it is one of ``allowed``; otherwise a ValueError naming the argument and the allowed values."""
    if value not in allowed:
        raise invalid(name, f"one of {tuple(allowed)}", value)
    return value


def check_rounding(rounding: str, name: str = "rounding") -> Rounding:
    """``rounding`` if it is one of :data:`ROUNDINGS`."""
    return check_choice(name, rounding, ROUNDINGS)  # type: ignore[return-value]


def check_moments(moments: Sequence[str] | None, name: str = "moments") -> tuple[Moment, ...]:
    """The distinct moments of a non-empty tuple, in canonical order; ``None`` means both. A plain string is refused
    (``"v"`` reads as ``("v",)`` but ``"mv"`` would not), so ``moments=("v",)`` is spelled as a tuple everywhere."""
    if moments is None:
        return MOMENTS
    if isinstance(moments, str) or not moments or any(m not in MOMENTS for m in moments):
        raise invalid(name, f"a non-empty tuple drawn from {MOMENTS}", moments)
    return tuple(m for m in MOMENTS if m in moments)


def check_int(name: str, value: object, minimum: int = 1, unit: str = "") -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; ``unit`` names what it counts, for the
    message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise invalid(name, f"{what} ({unit})" if unit else what, value)
    return value


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise invalid(name, "True or False", value)
    return value


def check_open_unit(name: str, value: object, note: str = "") -> float:
    """``value`` as a float if it is a number strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise invalid(name, f"a float in (0, 1){note}", value)
    return float(value)
