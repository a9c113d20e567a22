"""The documented import path of the reset policies (:mod:`lightning_stale.decide.policies`)."""

from lightning_stale.decide.policies import (AdaptiveReset, DriftReset, PeriodicReset, ResetPolicy, TheoryReset,
                                             check_band, check_min_interval, check_s0, make_policy)

__all__ = ["AdaptiveReset", "DriftReset", "PeriodicReset", "ResetPolicy", "TheoryReset", "check_band",
           "check_min_interval", "check_s0", "make_policy"]
