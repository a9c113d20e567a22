"""The fallback adapter for optimizers nobody registered (``adapter_for(..., strict=False)``).

It guesses: every floating or integer tensor with at least one dimension in ``optimizer.state[p]`` (except
``step``) is a slot; keys that look like a second moment (``sq``, ``var``, ``nu``, ``second``) are "v", all others
"m"; beta is unknown (None). The stall test is bitwise value equality. A reset zeroes the chosen tensors in place
and, when both moments are reset, zeroes ``step`` (tensor or number). Every other entry (numbers, 0-dim tensors such as
NAdam's ``mu_product``, bool or complex tensors) is left alone, so a reset may not restore a fresh optimizer's state:
the warning names those entries and the guessed slots. Nothing here knows the optimizer's grid or its bias
correction, so prefer registering a real adapter.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_stale._compat import local_tensor
from lightning_stale.adapters.layouts import FLOAT_FORMATS, FloatSlot
from lightning_stale.adapters.protocol import Moment, OptimizerAdapter, Slot, resolve_moments
from lightning_stale.vocab import COMPENSATION_KEY

_SECOND_MOMENT = re.compile(r"sq|var|nu|second", re.IGNORECASE)


def guess_moment(key: str) -> Moment:
    """"v" for keys that look like a second moment, else "m"."""
    return "v" if _SECOND_MOMENT.search(key) else "m"


def _is_state_tensor(key: str, value: object) -> bool:
    return (key not in ("step", COMPENSATION_KEY) and isinstance(value, Tensor) and value.dim() > 0
            and (value.is_floating_point() or not (value.is_complex() or value.dtype == torch.bool)))


def _kind(value: object) -> str:
    """What an entry the generic adapter leaves alone is, for the warning."""
    if isinstance(value, Tensor):
        return "0-dim tensor" if value.dim() == 0 else f"{str(value.dtype).removeprefix('torch.')} tensor"
    return type(value).__name__


class GenericAdapter(OptimizerAdapter):
    """Every float/int tensor of the state is a slot, compared by value; reset zeroes in place. Warns once per key
    with what it guessed and what a reset leaves alone."""

    family = "generic"
    exact_moment_reset = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._announced: set[str] = set()

    def slots(self) -> list[Slot]:
        out: list[Slot] = []
        for _, p, state in self.stepped():
            for key, value in state.items():
                if _is_state_tensor(key, value):
                    moment = guess_moment(key)
                    fmt = FLOAT_FORMATS.get(value.dtype, str(value.dtype).removeprefix("torch."))
                    out.append(FloatSlot(p, moment, None, fmt, key, tensor=local_tensor(value)))
        self._announce()
        return out

    def _announce(self) -> None:
        """Warn about state keys not announced yet: the guessed slots and the entries a reset leaves alone."""
        guessed: set[str] = set()
        untouched: set[str] = set()
        for _, _, state in self.stepped():
            for key, value in state.items():
                if _is_state_tensor(key, value):
                    guessed.add(f"{key}->{guess_moment(key)}")
                elif key not in ("step", COMPENSATION_KEY):
                    untouched.add(f"{key} ({_kind(value)})")
        guessed -= self._announced
        untouched -= self._announced
        if not (guessed or untouched):
            return
        self._announced |= guessed | untouched
        parts = []
        if guessed:
            parts.append(f"guessed the state slots {', '.join(sorted(guessed))} from their key names (beta unknown, "
                         "value equality as the stall test, unknown grid)")
        if untouched:
            parts.append(f"leaves {', '.join(sorted(untouched))} alone on reset, so a reset may not restore a fresh "
                         "optimizer's state")
        warnings.warn(f"{type(self.optimizer).__name__}: generic adapter {'; it '.join(parts)}; register a real "
                      "adapter to vouch for them", stacklevel=3)

    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        chosen = resolve_moments(moments)
        self._announce()
        for _, _, state in self.stepped(params):
            for key, value in state.items():
                if _is_state_tensor(key, value) and guess_moment(key) in chosen:
                    value.zero_()
            if chosen == {"m", "v"} and "step" in state:
                if isinstance(state["step"], Tensor):
                    state["step"].zero_()
                else:
                    state["step"] = 0
