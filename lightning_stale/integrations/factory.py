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

The variable is typically set once for a whole cluster, so a callback it creates never stops a run: a value it does not
understand, an optimizer lightning_stale does not know, no optimizer at all or a strategy it does not support each give
one warning line (what is not supported, what to do) and the run trains on without the monitor. A callback constructed
explicitly keeps its errors at setup.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_stale import _compat
from lightning_stale.decide.registry import POLICY_SHORTCUTS, REMEDY_SHORTCUTS
from lightning_stale.messages import StaleStateWarning
from lightning_stale.monitor.options import POLICY_ARGUMENTS

ENV_VAR = "LIGHTNING_STALE"
DEFAULT_LOG_EVERY = 50  # the Fabric callback's rows: optimizer steps between two


def decline(reason: str, remedy: str) -> None:
    """The one line (a :class:`StaleStateWarning`, from rank zero) of an entry point that will not monitor: what it
    cannot do and what to do instead. Training goes on."""
    if _compat.global_rank() == 0:
        warnings.warn(f"{ENV_VAR}={os.environ.get(ENV_VAR, '')!r}: {reason}; training goes on without "
                      f"lightning_stale. {remedy}", StaleStateWarning, stacklevel=2)


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
    raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not understood; use {_allowed()}")


def _allowed() -> str:
    """The values ``LIGHTNING_STALE`` understands, for messages."""
    names = [*REMEDY_SHORTCUTS, *(n for n, s in POLICY_SHORTCUTS.items() if not s.required),
             *(f"{n}:<{next(iter(s.required))}>" for n, s in POLICY_SHORTCUTS.items() if s.required)]
    return f"1 (monitor), {', '.join(names[:-1])} or {names[-1]}"


def _requested() -> dict[str, Any] | None:
    """:func:`options_from_env`, with a value it does not understand declined in one line (None)."""
    try:
        return options_from_env()
    except ValueError:
        decline("the value is not understood", f"Use {_allowed()}, or unset it.")
        return None


def callbacks_from_env() -> list[Callback]:
    """Trainer callbacks requested by ``LIGHTNING_STALE`` (an empty list when it is unset, ``0`` or not understood)."""
    options = _requested()
    if options is None:
        return []
    from lightning_stale.integrations.callback import StaleStateCallback

    callback = StaleStateCallback(**options)
    callback.from_environment = True
    return [callback]


def fabric_callbacks_from_env() -> list[Any]:
    """Fabric callbacks requested by ``LIGHTNING_STALE`` (the ``lightning.fabric.callbacks_factory`` entry point):
    logs through the Fabric being constructed, every 50 optimizer steps (``LIGHTNING_STALE_LOG_EVERY`` overrides; a
    value that is not a non-negative int is warned about and the default kept)."""
    options = _requested()
    if options is None:
        return []
    from lightning_stale.integrations.fabric import StaleStateFabricCallback

    every = os.environ.get(f"{ENV_VAR}_LOG_EVERY", str(DEFAULT_LOG_EVERY)).strip()
    if not every.isdigit():
        if _compat.global_rank() == 0:
            warnings.warn(f"{ENV_VAR}_LOG_EVERY={every!r} is not a non-negative int (optimizer steps between rows): "
                          f"rows are logged every {DEFAULT_LOG_EVERY} steps", StaleStateWarning, stacklevel=2)
        every = str(DEFAULT_LOG_EVERY)
    callback = StaleStateFabricCallback(log_every_n_steps=int(every), fabric=_compat.find_fabric(), **options)
    callback.from_environment = True
    return [callback]
