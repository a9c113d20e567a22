"""The documented path of :mod:`lightning_stale.integrations.hf` (this name is that module)."""

import sys

from lightning_stale.integrations import hf as _module

sys.modules[__name__] = _module
