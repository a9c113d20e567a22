"""The documented path of :mod:`lightning_stale.integrations.factory` (this name is that module)."""

import sys

from lightning_stale.integrations import factory as _module

sys.modules[__name__] = _module
