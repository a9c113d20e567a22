"""Keyed rows: which key (a slot's or a parameter's) each row of a component's arrays holds, and the values of the keys
it does not hold now. One helper, so that the counts, the drift shadows, the forecast and the ledger all keep a key's
values the same way when its slot stays, goes away (a reset that deletes a buffer) or comes back (or first appears
after a checkpoint was loaded)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

Row = TypeVar("Row")


@dataclass
class Moves(Generic[Row]):
    """Where each key of a new row order takes its values from; a key in neither dict is new and starts afresh."""

    kept: dict[str, int]  # key -> its row in the previous order (the component copies it over)
    returned: dict[str, Row]  # key -> the values stashed for it (they left the stash)


class KeyedRows(Generic[Row]):
    """The key of each row a component holds, and a stash of the values of the keys it does not hold (gone away, or
    loaded from a checkpoint before their slot appears). The component stores the values; this decides which go
    where."""

    def __init__(self) -> None:
        self.keys: list[str] = []  # the key of each row held now, in row order
        self.stash: dict[str, Row] = {}
        self._row: dict[str, int] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._row

    def row(self, key: str) -> int:
        """The row that holds ``key``."""
        return self._row[key]

    def rebuild(self, keys: Iterable[str], save: Callable[[str, int], Row],
                live: Collection[str] | None = None) -> Moves[Row]:
        """Move to the row order ``keys``: each held key that is no longer ``live`` (default: not in ``keys``) has
        ``save(key, its row)`` stashed until it returns; a held key that stays live but leaves ``keys`` is dropped (a
        component that holds only some of the live keys). Call it before the component replaces its arrays."""
        keys = list(keys)
        live = set(keys) if live is None else live
        for key, row in self._row.items():
            if key not in live:
                self.stash[key] = save(key, row)
        moves = Moves({key: self._row[key] for key in keys if key in self._row},
                      {key: self.stash.pop(key) for key in keys if key not in self._row and key in self.stash})
        self.keys, self._row = keys, {key: i for i, key in enumerate(keys)}
        return moves

    def peek(self, key: str) -> Row | None:
        """The stashed values of ``key`` (left in the stash), or None."""
        return self.stash.get(key)

    def restart(self, saved: Mapping[str, Row]) -> None:
        """Hold no row and stash ``saved`` (a checkpoint's rows, each taken when its key appears)."""
        self.keys, self._row, self.stash = [], {}, dict(saved)

    def state_dict(self, held: Mapping[str, Row]) -> dict[str, Row]:
        """Every row by key: the stashed ones and ``held`` (the component's own rows, read out by key)."""
        return {**self.stash, **held}
