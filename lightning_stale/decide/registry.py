"""The names the front-ends accept for ``reset`` and ``remedy``, each with the arguments that configure it.

A policy or remedy registers itself once, in its own module (:func:`register_policy`, :func:`register_remedy`), and
everything that takes shortcut names reads this registry: :class:`~lightning_stale.MonitorOptions` (which arguments
exist, how each is checked, which shortcut uses it) and the ``LIGHTNING_STALE`` factory (which names it accepts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_stale.vocab import invalid

Validator = Callable[[Any], Any]  # returns the checked value (normalized), raises ValueError naming the argument


@dataclass(frozen=True)
class Shortcut:
    """One registered name: ``factory(**arguments)`` builds the object; ``arguments`` maps each front-end argument it
    takes to its validator (None: the factory checks it) and ``keywords`` renames those the factory spells
    differently; ``required`` names those that must be given, each with what it is (for the message)."""

    factory: Callable[..., Any]
    arguments: Mapping[str, Validator | None]
    keywords: Mapping[str, str] = field(default_factory=dict)
    required: Mapping[str, str] = field(default_factory=dict)

    def build(self, kind: str, name: str, given: Mapping[str, Any]) -> tuple[Any, set[str]]:
        """The object from the ``given`` front-end arguments it takes; returns it and their names."""
        for argument, what in self.required.items():
            if given.get(argument) is None:
                raise ValueError(f"{kind}={name!r} needs `{argument}` ({what})")
        used = {key for key in given if key in self.arguments}
        return self.factory(**{self.keywords.get(key, key): given[key] for key in used}), used


POLICY_SHORTCUTS: dict[str, Shortcut] = {}  # reset="<name>"
REMEDY_SHORTCUTS: dict[str, Shortcut] = {}  # remedy="<name>"


def register_policy(name: str, factory: Callable[..., Any], arguments: Mapping[str, Validator | None] | None = None,
                    keywords: Mapping[str, str] | None = None, required: Mapping[str, str] | None = None) -> None:
    """Accept ``reset=name``, built by ``factory`` from the front-end ``arguments`` it takes (see :class:`Shortcut`)."""
    _register(POLICY_SHORTCUTS, name,
              Shortcut(factory, dict(arguments or {}), dict(keywords or {}), dict(required or {})))


def register_remedy(name: str, factory: Callable[..., Any], arguments: Mapping[str, Validator | None] | None = None,
                    keywords: Mapping[str, str] | None = None) -> None:
    """Accept ``remedy=name``, built by ``factory`` from the front-end ``arguments`` it takes."""
    _register(REMEDY_SHORTCUTS, name, Shortcut(factory, dict(arguments or {}), dict(keywords or {})))


def _register(table: dict[str, Shortcut], name: str, shortcut: Shortcut) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"a shortcut name must be a non-empty string, got {name!r}")
    known = validators()
    for argument, check in shortcut.arguments.items():
        if check is not None and known.get(argument) not in (None, check):
            raise ValueError(f"`{argument}` is already checked by {known[argument].__name__}; register {name!r} with "
                             "that validator (or None) so one value means the same to every shortcut")
    table[name] = shortcut


def make(argument: str, value: Any, table: Mapping[str, Shortcut], base: type, allowed: str,
         given: Mapping[str, Any]) -> tuple[Any, set[str]]:
    """The object a front-end's ``argument`` (``reset``, ``remedy``) stands for: ``value`` itself when it is None or an
    instance of ``base``, else the registered shortcut built from the ``given`` arguments it takes (and their names);
    a ValueError naming the argument and ``allowed`` otherwise."""
    if value is None or isinstance(value, base):
        return value, set()
    if value not in table:
        raise invalid(argument, allowed, value)
    return table[value].build(argument, value, given)


def validators() -> dict[str, Validator | None]:
    """Every front-end argument some registered shortcut takes, with its validator (None: its factory checks it)."""
    found: dict[str, Validator | None] = {}
    for shortcut in (*POLICY_SHORTCUTS.values(), *REMEDY_SHORTCUTS.values()):
        for argument, check in shortcut.arguments.items():
            if found.get(argument) is None:
                found[argument] = check
    return found


def users(argument: str) -> list[str]:
    """The shortcuts that take ``argument``, as the front-ends spell them (``reset='periodic'``), for messages."""
    return [f"{kind}={name!r}" for kind, table in (("reset", POLICY_SHORTCUTS), ("remedy", REMEDY_SHORTCUTS))
            for name, shortcut in table.items() if argument in shortcut.arguments]

