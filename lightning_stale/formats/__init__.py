"""Low-precision storage formats for optimizer moments, one class per file, each with its description and rounding.

``get_format(name, signed)`` returns a :class:`StateFormat`; ``signed`` selects the first-moment (signed) or
second-moment (non-negative) variant where a format has both (fp4, int8_dynamic). A new format is a
:class:`StateFormat` subclass passed to :func:`register_format`: ``QuantizedAdamW``, its adapter and the saved-state
reader then take it by name.
"""

from __future__ import annotations

from functools import lru_cache

from lightning_stale.formats.base import QuantizedState, StateFormat
from lightning_stale.formats.floats import Bf16Format, Fp16Format, Fp32Format
from lightning_stale.formats.fp4 import Fp4Format
from lightning_stale.formats.fp8 import Fp8E4M3Format
from lightning_stale.formats.int8_dynamic import Int8DynamicFormat
from lightning_stale.vocab import ROUNDINGS, check_choice, check_rounding

FORMATS: dict[str, type[StateFormat]] = {}  # name -> format class, the built-ins first, in registration order


def register_format(cls: type[StateFormat]) -> type[StateFormat]:
    """Make the :class:`StateFormat` subclass ``cls`` available under its ``name`` (a later registration of a name
    wins); returns ``cls``, so it also serves as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, StateFormat)):
        raise TypeError(f"a state format must be a StateFormat subclass, got {cls!r}")
    if not (isinstance(getattr(cls, "name", None), str) and cls.name):
        raise TypeError(f"{cls.__name__} needs a non-empty string `name`")
    FORMATS[cls.name] = cls
    return cls


for _builtin in (Fp32Format, Bf16Format, Fp16Format, Fp8E4M3Format, Fp4Format, Int8DynamicFormat):
    register_format(_builtin)
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)  # the built-in formats' names; FORMATS also holds registered ones


def check_format_name(name: object, argument: str = "state_format") -> None:
    """Raise a ValueError naming the allowed values unless ``name`` is a registered format name."""
    check_choice(argument, name, tuple(FORMATS))


def get_format(name: str, signed: bool) -> StateFormat:
    """The format registered as ``name`` for a signed (m) or unsigned (v) moment; one shared instance per class."""
    check_format_name(name, "name")
    return _shared(FORMATS[name], bool(signed))


@lru_cache(maxsize=None)
def _shared(cls: type[StateFormat], signed: bool) -> StateFormat:
    return cls(signed)


def zero_code(name: str, signed: bool) -> int | None:
    """The per-element code that stores an exact zero in format ``name`` whatever the scale (127 for the signed
    int8 map, 0 for the unsigned one and for float bit patterns), or None when the grid has no zero (fp4 unsigned)."""
    return get_format(name, signed).zero_code()


__all__ = [
    "FORMATS",
    "FORMAT_NAMES",
    "ROUNDINGS",
    "QuantizedState",
    "StateFormat",
    "check_format_name",
    "check_rounding",
    "get_format",
    "register_format",
    "zero_code",
]
