"""Zero-code activation through Lightning's ``lightning.pytorch.callbacks_factory`` entry point.

Every Trainer asks installed factories for extra callbacks. This one adds a :class:`StaleStateCallback` only when
the environment variable ``LIGHTNING_STALE`` is set, so installing the package changes nothing by itself:

- ``LIGHTNING_STALE=1`` (or ``monitor``): monitor only;
- ``LIGHTNING_STALE=theory`` / ``adaptive``: that reset policy;
- ``LIGHTNING_STALE=periodic:500``: periodic resets every 500 steps;
- unset, empty or ``0``: inactive.

A callback passed to the Trainer explicitly wins: the one from the variable then steps aside (with an info line)
instead of colliding with it.
"""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import Callback

ENV_VAR = "LIGHTNING_STALE"


def callbacks_from_env() -> list[Callback]:
    """The callbacks requested by ``LIGHTNING_STALE`` (an empty list when it is unset or ``0``)."""
    spec = os.environ.get(ENV_VAR, "").strip().lower()
    if spec in ("", "0", "false", "off"):
        return []
    from lightning_stale.callback import StaleStateCallback

    if spec in ("1", "true", "on", "monitor"):
        callback = StaleStateCallback()
    elif spec in ("theory", "adaptive"):
        callback = StaleStateCallback(reset=spec)
    else:
        name, _, every = spec.partition(":")
        if not (name == "periodic" and every.isdigit() and int(every) > 0):
            raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not understood; use 1 (monitor), theory, "
                             "adaptive or periodic:<steps>")
        callback = StaleStateCallback(reset="periodic", every=int(every))
    callback.from_environment = True
    return [callback]
