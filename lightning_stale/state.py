"""The monitor's saved state: the version written now, the upgrade of the earlier ones it reads, and its JSON form.

Version 4 keeps each component's part under its own key per optimizer (``engine``, ``forecast``, ``ledger``,
``interventions``); version 3 saved the ledger's part under ``schedule``; version 2 (lightning_stale 0.1 before the
components) kept the prediction sums inside the engine's rows and the reset counters at the top level.
"""

from __future__ import annotations

from typing import Any

import torch

STATE_VERSION = 4
OLDEST_VERSION = 2


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` in the current layout; ValueError for a state this version cannot read (newer, or not a monitor's)."""
    version = state.get("version") if isinstance(state, dict) else None
    if not isinstance(version, int) or "optimizers" not in state:
        raise ValueError("the saved state is not a lightning_stale monitor's (it has no 'version' and 'optimizers'); "
                         "drop it or pass the state saved from StaleStateMonitor.state_dict()")
    if version > STATE_VERSION:
        raise ValueError(f"the saved monitor state has version {version}, newer than this lightning_stale reads "
                         f"({STATE_VERSION}): upgrade lightning_stale to resume with it, or drop the saved monitor "
                         "state")
    if version < OLDEST_VERSION:
        raise ValueError(f"the saved monitor state has version {version}, older than this lightning_stale reads "
                         f"({OLDEST_VERSION} to {STATE_VERSION}): drop the saved monitor state to resume")
    while state["version"] < STATE_VERSION:  # one version at a time
        state = (_from_v2 if state["version"] == 2 else _from_v3)(state)
    return state


def _from_v3(state: dict[str, Any]) -> dict[str, Any]:
    """A version 3 state in the version 4 layout: the ledger's part under its own name."""
    optimizers = [{("ledger" if key == "schedule" else key): value for key, value in part.items()}
                  for part in state["optimizers"]]
    return {**state, "version": 4, "optimizers": optimizers}


def _from_v2(state: dict[str, Any]) -> dict[str, Any]:
    """A version 2 state in the version 3 layout."""
    optimizers = []
    for i, saved in enumerate(state["optimizers"]):
        engine, rows = saved["engine"], saved["engine"]["totals"]  # rows: "host" = [measured, prediction sum, count]
        first = i == 0  # version 2 counted resets for the whole monitor: the first optimizer carries them
        optimizers.append({
            "steps": saved["steps"],
            "engine": {"cursor": engine["cursor"], "shadows": engine["shadows"],
                       "totals": {key: {"totals": row["totals"], "measured": row["host"][0]}
                                  for key, row in rows.items()}},
            "forecast": {"window": {key: list(row["host"][1:3]) for key, row in rows.items()}},
            "schedule": saved["schedule"],
            "interventions": {"resets": state.get("reset_events", 0) if first else 0,
                              "remedy_resets": state.get("remedy_resets", 0) if first else 0},
        })
    kept = {key: value for key, value in state.items() if key not in ("reset_events", "remedy_resets", "optimizers")}
    return {**kept, "version": 3, "optimizers": optimizers}


def to_json(state: Any) -> Any:
    """``state`` with every tensor as ``{"tensor": values, "dtype": name, "shape": dims}``: what a JSON file can hold
    (Hugging Face keeps callback states in ``trainer_state.json``); floats round-trip exactly."""
    if isinstance(state, torch.Tensor):
        return {"tensor": state.detach().cpu().reshape(-1).tolist(), "dtype": str(state.dtype).removeprefix("torch."),
                "shape": list(state.shape)}
    if isinstance(state, dict):
        return {key: to_json(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return [to_json(value) for value in state]
    return state


def from_json(state: Any) -> Any:
    """The inverse of :func:`to_json`."""
    if isinstance(state, dict):
        if set(state) == {"tensor", "dtype", "shape"}:
            return torch.tensor(state["tensor"], dtype=getattr(torch, state["dtype"])).reshape(state["shape"])
        return {key: from_json(value) for key, value in state.items()}
    if isinstance(state, list):
        return [from_json(value) for value in state]
    return state
