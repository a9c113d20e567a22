"""Remedies chosen per parameter from its measured cause (``remedy="auto"``), applied on check steps.

A :class:`Remedy` judges each parameter once from the theory, as soon as its rho-hat is known (:meth:`Remedy.foresee`),
and maps the signals every check step agrees across ranks (the ledger's ``underflow``, ``drift`` and ages) to a
choice per parameter, an index into :data:`REMEDIES`; the monitor applies both. :class:`AutoRemedy`:

- **predicted drift** (before any measurement): nearest rounding of a state whose updates mostly stall lets v go up
  but rarely down; where stochastic rounding's own noise is small (bf16, not fp8 per tensor or 8-bit maps) and the
  optimizer has it, stochastic rounding from the next step on.
- **v underflows** (stored exactly zero while the gradient is not): ``m / (sqrt(v) + eps)`` blows up. Remedy: the
  underflow guard (:mod:`lightning_stale.act.guard`) on that parameter from then on (underflow recurs in the formats
  that show it once, and the guard costs one pass over the parameter's state).
- **v drifts** out of ``[1 / drift_band, drift_band]`` times its fp32 EMA (nearest rounding ratchets v up over
  thousands of steps; :class:`~lightning_stale.policies.DriftReset`'s rule): stochastic rounding from then on where
  the optimizer offers it (``QuantizedAdamW``), which removes the bias at its source; a reset elsewhere.
- **stale but in band**: nothing (hard resets of an unbiased state cost loss; see BENCHMARKS.md).

Underflow is checked first because an underflowing v also reads as drifted low, and resetting it would not stop the
next underflow. Every rank applies the same remedy at the same step. Subclass :class:`Remedy` (or override
:meth:`AutoRemedy.choose`) for another rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_stale.decide.ledger import Ledger
from lightning_stale.decide.policies import DriftReset, check_band, check_min_interval
from lightning_stale.decide.registry import REMEDY_SHORTCUTS
from lightning_stale.decide.registry import make, register_remedy
from lightning_stale.vocab import MOMENTS, check_moments

REMEDIES = ("none", "guard", "reset", "stochastic")  # what a remedy chose per parameter, by index
NONE, GUARD, RESET, STOCHASTIC = range(len(REMEDIES))
GUARD_CHECKS = 3  # the guard window opened at each check, in check intervals (re-armed before it ends)


class Remedy:
    """Base class: chooses, on every check step, a remedy per parameter. ``moments`` names the moments its resets
    restore; how soon a parameter may be reset again is the subclass's rule (:class:`AutoRemedy`'s ``min_interval``)."""

    moments: tuple[str, ...] = MOMENTS

    def choose(self, ledger: Ledger) -> np.ndarray:
        """The index in :data:`REMEDIES` of each parameter's remedy (int array) from the latest readings: GUARD,
        RESET (the monitor turns it into STOCHASTIC where the optimizer can round stochastically) or NONE."""
        raise NotImplementedError

    def describe_drift(self) -> str:
        """The drift rule, for messages (``"out of [1/b, b] x its fp32 EMA"``)."""
        return "drifted"

    def foresee(self, rho: float | None, beta: float | None, rounding: str) -> str | None:
        """Before any measurement, when a parameter's rho-hat is known: why the theory calls for stochastic rounding
        of its stored v (where the optimizer has it), or None."""
        return None

    def weights(self, ledger: Ledger) -> np.ndarray:
        """Which parameters' weight writes to take over (bool per parameter) from the latest readings; none by
        default."""
        return np.zeros(len(ledger.keys), dtype=bool)

    def weights_foreseen(self, past_threshold: np.ndarray) -> np.ndarray:
        """Before any measurement: which parameters' weight writes to take over, from the share of their stored
        weights already past the threshold where an update of about lr rounds away; none by default."""
        return np.zeros(len(past_threshold), dtype=bool)


class AutoRemedy(Remedy):
    """Stochastic rounding from the start where the theory predicts drift and stochastic rounding's noise is small
    (and the optimizer has it), the guard where v underflows, stochastic rounding (else a reset) where v is measured to
    drift out of band, nothing otherwise.

    Args:
        drift_band: allowed ratio of stored v to its fp32 EMA before stochastic rounding or a reset (see
            ``DriftReset``).
        min_interval: fewest steps between two resets of a parameter.
        moments: the moments a reset restores.
        underflow_threshold: the guard goes on where the sampled fraction of v stored as zero (with a non-zero
            gradient) exceeds this; 0 means any sampled underflow.
        drift_rho: rho-hat from which nearest rounding is predicted to make v drift.
        rounding_noise: the largest stationary noise of stochastic rounding (relative std of v) for which it is
            chosen before any measurement (see :meth:`foresee`).
        weight_stall: the weight write-back (compensated summation: see
            :func:`~lightning_stale.act.writeback.writeback_for`) takes over a bf16/fp16 weight where more than this
            share of its elements stalls: predicted (past the threshold at the current lr) or measured.
    """

    def __init__(self, drift_band: float = 1.5, min_interval: int = 50, moments: Sequence[str] = MOMENTS,
                 underflow_threshold: float = 0.0, drift_rho: float = 1.0, rounding_noise: float = 0.1,
                 weight_stall: float = 0.05) -> None:
        self.drift = DriftReset(drift_band, min_interval, moments)
        self.weight_stall = float(weight_stall)
        self.underflow_threshold = float(underflow_threshold)
        self.drift_rho, self.rounding_noise = float(drift_rho), float(rounding_noise)

    @property
    def moments(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.drift.moments

    def choose(self, ledger: Ledger) -> np.ndarray:
        with np.errstate(invalid="ignore"):  # nan: not read yet, so no underflow evidence
            guard = ledger.arrays["underflow"] > self.underflow_threshold
        reset = self.drift.out_of_band(ledger.arrays["drift"], ledger.ages) & ~guard
        return np.where(guard, GUARD, np.where(reset, RESET, NONE))

    def describe_drift(self) -> str:
        return f"drifted out of [1/{self.drift.band:g}, {self.drift.band:g}] x its fp32 EMA"

    def weights(self, ledger: Ledger) -> np.ndarray:
        with np.errstate(invalid="ignore"):  # nan: not read
            return ledger.arrays["weight_stall"] > self.weight_stall

    def weights_foreseen(self, past_threshold: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return past_threshold > self.weight_stall

    def foresee(self, rho: float | None, beta: float | None, rounding: str) -> str | None:
        """Nearest rounding of a state whose updates mostly stall (rho-hat >= ``drift_rho``) lets v go up but rarely
        down: it drifts, slowly, and what that costs builds up over the whole run. Stochastic rounding removes the
        bias but adds noise: each write errs by up to one grid step, and the EMA keeps a relative deviation of
        ``rho-hat * sqrt((1 - beta) / 2)`` (its stationary std). It pays where that noise stays under
        ``rounding_noise`` (bf16 at b2 = 0.999: 6%), not on coarse grids (fp8 per tensor: 96%)."""
        if rounding != "nearest" or rho is None or beta is None or rho < self.drift_rho:
            return None
        noise = rho * math.sqrt((1.0 - beta) / 2.0)
        if noise > self.rounding_noise:
            return None
        return f"predicted drift (rho-hat {rho:.3g}, nearest rounding; stochastic rounding's noise {noise:.0%} of v)"

    def __repr__(self) -> str:
        return (f"AutoRemedy(drift_band={self.drift.band}, min_interval={self.drift.min_interval}, "
                f"moments={self.moments}, underflow_threshold={self.underflow_threshold}, drift_rho={self.drift_rho}, "
                f"rounding_noise={self.rounding_noise}, weight_stall={self.weight_stall})")


register_remedy("auto", AutoRemedy, {"drift_band": check_band, "min_interval": check_min_interval,
                                     "moments": check_moments})


def make_remedy(remedy: str | Remedy | None, arguments: Mapping[str, Any]) -> tuple[Remedy | None, set[str]]:
    """Turn the front-ends' ``remedy`` into a remedy object (``None``: none) from the arguments the user passed;
    returns it and the arguments used."""
    return make("remedy", remedy, REMEDY_SHORTCUTS, Remedy,
                f"one of {(None, *REMEDY_SHORTCUTS)} or a Remedy instance", arguments)
