"""The documented path of :mod:`lightning_stale.decide.policies` (this name is that module)."""

import sys

from lightning_stale.decide import policies as _module

sys.modules[__name__] = _module
