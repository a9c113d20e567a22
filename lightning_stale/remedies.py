"""The automatic remedy (``remedy="auto"``): per parameter, the fix its measured cause calls for.

Causes and remedies, from ``benchmarks/recovery.py`` (BENCHMARKS.md, "Loss recovery"):

- **v underflows** (stored exactly zero while the gradient is not): ``m / (sqrt(v) + eps)`` blows up. Remedy: the
  underflow guard (:mod:`lightning_stale.guard`) on that parameter from then on (underflow recurs in the formats
  that show it once, and the guard costs one pass over the parameter's state). This is what per-tensor fp8 states at
  a high learning rate need.
- **v drifts** out of ``[1 / drift_band, drift_band]`` times its fp32 EMA (nearest rounding ratchets v up over
  thousands of steps; :class:`~lightning_stale.policies.DriftReset`'s rule): stochastic rounding from then on where
  the optimizer offers it (``QuantizedAdamW``), which removes the bias at its source; a reset elsewhere.
- **stale but in band**: nothing. Hard resets of an unbiased state cost loss at every scale we measured.

Underflow is checked first because an underflowing v also reads as drifted low, and resetting it would not stop the
next underflow. Decisions are made on check steps from signals the monitor has already agreed across ranks, so every
rank applies the same remedy at the same step. Override :meth:`AutoRemedy.choose` for another rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_stale.policies import DriftReset
from lightning_stale.schedule import ResetSchedule
from lightning_stale.vocab import MOMENTS

REMEDIES = ("none", "guard", "reset", "stochastic")  # what the automatic remedy chose per parameter, by index
NONE, GUARD, RESET, STOCHASTIC = range(len(REMEDIES))
REMEDY_NAMES = ("auto",)  # the values of the front-ends' ``remedy`` argument besides None
GUARD_CHECKS = 3  # the guard window opened at each check, in check intervals (re-armed before it ends)


class AutoRemedy:
    """Chooses a remedy per parameter from the schedule's signals (``underflow``, ``drift``, ages).

    Args:
        drift_band: allowed ratio of stored v to its fp32 EMA before stochastic rounding or a reset (see
            ``DriftReset``).
        min_interval: fewest steps between two resets of a parameter.
        moments: the moments a reset restores.
        underflow_threshold: the guard goes on where the sampled fraction of v stored as zero (with a non-zero
            gradient) exceeds this; 0 means any sampled underflow.
    """

    def __init__(self, drift_band: float = 1.5, min_interval: int = 50, moments: Sequence[str] = MOMENTS,
                 underflow_threshold: float = 0.0) -> None:
        self.drift = DriftReset(drift_band, min_interval, moments)
        self.underflow_threshold = float(underflow_threshold)

    @property
    def moments(self) -> tuple[str, ...]:
        return self.drift.moments

    def choose(self, schedule: ResetSchedule) -> np.ndarray:
        """The index in :data:`REMEDIES` of each parameter's remedy (int array), from the latest readings: GUARD,
        RESET (for drift; the monitor turns it into STOCHASTIC where the optimizer can round stochastically) or
        NONE."""
        with np.errstate(invalid="ignore"):  # nan: not read yet, so no underflow evidence
            guard = schedule.arrays["underflow"] > self.underflow_threshold
        reset = self.drift.out_of_band(schedule.arrays["drift"], schedule.ages) & ~guard
        return np.where(guard, GUARD, np.where(reset, RESET, NONE))

    def __repr__(self) -> str:
        return (f"AutoRemedy(drift_band={self.drift.band}, min_interval={self.drift.min_interval}, "
                f"moments={self.moments}, underflow_threshold={self.underflow_threshold})")
