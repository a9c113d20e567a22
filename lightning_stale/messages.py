"""What the monitor tells the user: its warning categories, one-time warnings, rank-zero info lines and readable
parameter names."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

from torch import Tensor, nn

from lightning_stale._compat import fabric_original_module, rank_zero_info, unwrap_compiled


class StaleStateWarning(UserWarning):
    """A measurement the monitor skipped (it keeps trying); training is not affected."""


class StaleStateInternalWarning(StaleStateWarning):
    """An unexpected error inside a step hook: the monitor skipped that step (a bug; please report it)."""


def info(message: str) -> None:
    """One line for the user, from rank zero only."""
    rank_zero_info(message)


class Notices:
    """Warnings given once per key (a slot that keeps failing warns once, not every step)."""

    def __init__(self) -> None:
        self._given: set[str] = set()

    def warn_once(self, key: str, message: str, category: type[Warning] = StaleStateWarning) -> None:
        if key not in self._given:
            self._given.add(key)
            warnings.warn(message, category, stacklevel=3)


class ParamNames:
    """Readable parameter names (from the model's ``named_parameters`` or a mapping), falling back to unit keys; with
    several optimizers each name is prefixed with its optimizer's ``opt<i>``."""

    def __init__(self, names: nn.Module | Mapping[str, Tensor] | None, optimizers: int = 1) -> None:
        if isinstance(names, nn.Module):
            # Fabric's and torch.compile's wrappers prefix every name ("_forward_module.", "_orig_mod.")
            names = unwrap_compiled(fabric_original_module(names))
        pairs: Iterable[tuple[str, Tensor]] = () if names is None else (
            names.named_parameters() if isinstance(names, nn.Module) else names.items())
        self._by_id = {id(p): n for n, p in pairs}
        self._prefixed = optimizers > 1

    def __call__(self, param: Tensor, key: str, prefix: str) -> str:
        name = self._by_id.get(id(param), key)
        return f"{prefix}/{name}" if self._prefixed else name
