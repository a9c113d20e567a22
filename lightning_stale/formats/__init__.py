"""Low-precision storage formats for optimizer moments, with their local grid spacing.

``get_format(name, signed)`` returns a :class:`StateFormat`; ``signed`` selects the first-moment (signed) or
second-moment (non-negative) variant where a format has both (fp4, int8_dynamic).
"""

from __future__ import annotations

from functools import lru_cache

from lightning_stale.formats.base import QuantizedState, StateFormat
from lightning_stale.formats.floats import Bf16Format, Fp16Format, Fp32Format
from lightning_stale.formats.fp4 import Fp4Format
from lightning_stale.formats.fp8 import Fp8E4M3Format
from lightning_stale.formats.int8_dynamic import Int8DynamicFormat
from lightning_stale.vocab import ROUNDINGS, check_choice, check_rounding

_FORMATS: dict[str, type[StateFormat]] = {
    "fp32": Fp32Format,
    "bf16": Bf16Format,
    "fp16": Fp16Format,
    "fp8_e4m3": Fp8E4M3Format,
    "fp4": Fp4Format,
    "int8_dynamic": Int8DynamicFormat,
}
FORMAT_NAMES: tuple[str, ...] = tuple(_FORMATS)


def check_format_name(name: object, argument: str = "state_format") -> None:
    """Raise a ValueError naming the allowed values unless ``name`` is a known format name."""
    check_choice(argument, name, FORMAT_NAMES)


@lru_cache(maxsize=None)
def get_format(name: str, signed: bool) -> StateFormat:
    """The format ``name`` (one of :data:`FORMAT_NAMES`) for a signed (m) or unsigned (v) moment; shared instances."""
    check_format_name(name, "name")
    return _FORMATS[name](bool(signed))


def zero_code(name: str, signed: bool) -> int | None:
    """The per-element code that stores an exact zero in format ``name`` whatever the scale (127 for the signed
    int8 map, 0 for the unsigned one and for float bit patterns), or None when the grid has no zero (fp4 unsigned)."""
    return get_format(name, signed).zero_code()


__all__ = [
    "FORMAT_NAMES",
    "ROUNDINGS",
    "QuantizedState",
    "StateFormat",
    "check_format_name",
    "check_rounding",
    "get_format",
    "zero_code",
]
