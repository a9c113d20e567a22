"""The monitor's state carried inside each watched optimizer's own state dict, so that a loop that saves and loads only
``optimizer.state_dict()`` (LitGPT, torchtitan-style loops, ``torch.save(optimizer.state_dict())``) resumes the monitor
exactly without knowing it.

It travels under one reserved key of the first parameter group: torch's ``Optimizer.load_state_dict`` (and
bitsandbytes') keeps a saved group's extra keys where it drops unknown top-level ones, so a state loaded before the
monitor attaches waits in the optimizer's first group until the monitor takes it, and one loaded later is taken
before the next step. It holds plain values and tensors only (it loads with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

from typing import Any

from lightning_stale import _compat

KEY = "lightning_stale"


def put(state_dict: dict[str, Any], state: dict[str, Any]) -> None:
    """Carry ``state`` in ``state_dict`` (what ``optimizer.state_dict()`` returned), leaving the optimizer's own groups
    untouched. Not inside torch's distributed state-dict functions: their load side builds its template from a fresh
    optimizer's state dict and refuses keys the checkpoint lacks (those front-ends save the callback's state)."""
    groups = state_dict.get("param_groups")
    if not groups or _compat.in_distributed_state_dict():
        return
    state_dict["param_groups"] = [{**groups[0], KEY: state}, *groups[1:]]


def waiting(optimizer: Any) -> bool:
    """Whether a loaded state dict left a carried state in ``optimizer``'s first group (one dict look-up)."""
    groups = optimizer.param_groups
    return bool(groups) and KEY in groups[0]


def take(optimizer: Any) -> dict[str, Any] | None:
    """The carried state waiting in ``optimizer``'s first group, removed from it; None when there is none."""
    state = optimizer.param_groups[0].pop(KEY, None) if waiting(optimizer) else None
    return state if isinstance(state, dict) else None
