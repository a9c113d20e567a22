"""The documented path of :mod:`lightning_stale.decide.remedies` (this name is that module)."""

import sys

from lightning_stale.decide import remedies as _module

sys.modules[__name__] = _module
