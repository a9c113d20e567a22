"""Zero-code activation through Lightning's ``lightning.pytorch.callbacks_factory`` and
``lightning.fabric.callbacks_factory`` entry points.

Every Trainer and every Fabric asks installed factories for extra callbacks. These add a
:class:`~lightning_stale.StaleStateCallback` (Trainer) or a :class:`~lightning_stale.fabric.StaleStateFabricCallback`
(Fabric, e.g. LitGPT) only when the environment variable ``LIGHTNING_STALE`` is set, so installing the package
changes nothing by itself:

- ``LIGHTNING_STALE=1`` (or ``monitor``): monitor only;
- ``LIGHTNING_STALE=theory`` / ``adaptive`` / ``drift``: that reset policy;
- ``LIGHTNING_STALE=periodic:500``: periodic resets every 500 steps;
- ``LIGHTNING_STALE=auto``: the automatic remedy (``remedy="auto"``);
- any other registered reset or remedy name (:mod:`lightning_stale.decide.registry`), ``<name>:<n>`` for a policy with
  one required argument (a positive int, as ``periodic``'s);
- unset, empty or ``0``: inactive.

A callback passed to the Trainer explicitly wins: the one from the variable then steps aside (with an info line)
instead of colliding with it.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_stale.decide.registry import POLICY_SHORTCUTS, REMEDY_SHORTCUTS
from lightning_stale.monitor.options import POLICY_ARGUMENTS

ENV_VAR = "LIGHTNING_STALE"


def options_from_env() -> dict[str, Any] | None:
    """The monitor options ``LIGHTNING_STALE`` asks for, or None when it is unset or ``0``."""
    spec = os.environ.get(ENV_VAR, "").strip().lower()
    if spec in ("", "0", "false", "off"):
        return None
    if spec in ("1", "true", "on", "monitor"):
        return {}
    name, _, value = spec.partition(":")
    if name in REMEDY_SHORTCUTS and not value:
        return {"remedy": name}
    required = list(POLICY_SHORTCUTS[name].required) if name in POLICY_SHORTCUTS else None
    if required == [] and not value:
        return {"reset": name}
    if required is not None and len(required) == 1 and value.isdigit() and int(value) > 0:
        if required[0] in POLICY_ARGUMENTS:
            return {"reset": name, required[0]: int(value)}
        return {"reset": name, "policy_args": {required[0]: int(value)}}
    names = [*REMEDY_SHORTCUTS, *(n for n, s in POLICY_SHORTCUTS.items() if not s.required),
             *(f"{n}:<{next(iter(s.required))}>" for n, s in POLICY_SHORTCUTS.items() if s.required)]
    raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not understood; use 1 (monitor), "
                     f"{', '.join(names[:-1])} or {names[-1]}")


def callbacks_from_env() -> list[Callback]:
    """Trainer callbacks requested by ``LIGHTNING_STALE`` (an empty list when it is unset or ``0``)."""
    options = options_from_env()
    if options is None:
        return []
    from lightning_stale.integrations.callback import StaleStateCallback

    callback = StaleStateCallback(**options)
    callback.from_environment = True
    return [callback]


def fabric_callbacks_from_env() -> list[Any]:
    """Fabric callbacks requested by ``LIGHTNING_STALE`` (the ``lightning.fabric.callbacks_factory`` entry point):
    logs through the Fabric being constructed, every 50 optimizer steps (``LIGHTNING_STALE_LOG_EVERY`` overrides)."""
    options = options_from_env()
    if options is None:
        return []
    from lightning_stale import _compat
    from lightning_stale.integrations.fabric import StaleStateFabricCallback

    every = os.environ.get(f"{ENV_VAR}_LOG_EVERY", "50")
    if not every.isdigit():
        raise ValueError(f"{ENV_VAR}_LOG_EVERY={every!r} must be a non-negative int (optimizer steps between rows)")
    return [StaleStateFabricCallback(log_every_n_steps=int(every), fabric=_compat.find_fabric(), **options)]
