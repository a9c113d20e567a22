"""The documented path of :mod:`lightning_stale.integrations.fabric` (this name is that module)."""

import sys

from lightning_stale.integrations import fabric as _module

sys.modules[__name__] = _module
