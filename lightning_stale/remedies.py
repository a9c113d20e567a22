"""The documented import path of the remedies (:mod:`lightning_stale.decide.remedies`): the rule objects, and the
remedy each parameter has (an index into ``REMEDIES``: ``NONE``, ``GUARD``, ``RESET``, ``STOCHASTIC``)."""

from lightning_stale.decide.remedies import (GUARD, GUARD_CHECKS, NONE, REMEDIES, RESET, STOCHASTIC, AutoRemedy, Remedy,
                                             make_remedy)

__all__ = ["GUARD", "GUARD_CHECKS", "NONE", "REMEDIES", "RESET", "STOCHASTIC", "AutoRemedy", "Remedy", "make_remedy"]
