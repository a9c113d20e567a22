"""The documented import path of the ``LIGHTNING_STALE`` entry points (:mod:`lightning_stale.integrations.factory`)."""

from lightning_stale.integrations.factory import (ENV_VAR, callbacks_from_env, fabric_callbacks_from_env,
                                                  options_from_env)

__all__ = ["ENV_VAR", "callbacks_from_env", "fabric_callbacks_from_env", "options_from_env"]
