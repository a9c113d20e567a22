"""Reset policies: decide, per parameter, when to reset which stored moments.

A policy sees one :class:`LedgerRow` per parameter (its slots, the real optimizer steps since its last reset, the
measured stall fractions of the current cycle) and answers :meth:`ResetPolicy.should_reset`. Override that method
(as with Lightning's ``WeightAveraging.should_update``) for a custom rule, on :class:`ResetPolicy` or on a built-in
policy: the built-ins answer for every parameter at once with array comparisons (``_due_all``), which a subclass that
overrides ``should_reset`` replaces by its own rule.

A reset happens after the optimizer step that completes the period: with ``PeriodicReset(5)`` after steps 5, 10, ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_stale.decide import slot_theory
from lightning_stale.decide.ledger import NO_PERIOD, Ledger, LedgerRow
from lightning_stale.decide.registry import POLICY_SHORTCUTS, make, register_policy
from lightning_stale.theory import statistical_error
from lightning_stale.vocab import MOMENTS, check_int, check_moments, check_open_unit, invalid


def check_s0(s0: float) -> float:
    return check_open_unit("s0", s0, " (the paper uses 0.6)")


def check_min_interval(min_interval: int) -> int:
    return check_int("min_interval", min_interval, unit="optimizer steps")


def check_band(band: float) -> float:
    if isinstance(band, bool) or not isinstance(band, (int, float)) or not band > 1.0 or not math.isfinite(band):
        raise invalid("drift_band", "a finite float > 1 (the allowed ratio of stored v to its fp32 EMA)", band)
    return float(band)


class ResetPolicy:
    """Base class. ``moments`` names the moments a reset restores; ``needs_sync`` says whether decisions depend on
    per-rank measurements (then the monitor sums them across ranks so every rank resets at the same step);
    ``needs_measurement`` asks for each measured step's stall fractions (:meth:`observe`), which the monitor keeps
    on the device and hands over at check steps (every ``coverage_steps``, in the order they were measured: no host
    read on the steps between). The drift readings of check steps (``unit.drift``, already agreed across ranks) are
    there for every policy."""

    needs_sync: bool = True
    needs_measurement: bool = False

    def __init__(self, moments: Sequence[str] = MOMENTS) -> None:
        self.moments = check_moments(moments)

    def configure(self, unit: LedgerRow) -> None:
        """Called when a parameter's state first appears, and again whenever its rho-hat estimate changes (e.g. to
        choose its period)."""

    def observe(self, unit: LedgerRow, stall_fraction: float) -> None:
        """Called with the driver slot's stall fraction of each measured step, at the next check step."""

    def should_reset(self, unit: LedgerRow, step: int) -> bool:
        """Whether to reset ``unit`` now, right after its optimizer's ``step``-th real step (skipped steps do not
        count), which is the ``unit.age``-th step since the unit's last reset."""
        raise NotImplementedError

    def due(self, ledger: Ledger, step: int) -> np.ndarray:
        """:meth:`should_reset` for every parameter of ``ledger`` as a bool array: the built-ins' ``_due_all`` (array
        comparisons, no Python loop per parameter per step) unless a subclass overrides ``should_reset`` below it."""
        fast = getattr(self, "_due_all", None)
        if fast is not None and _defined_by(type(self), "_due_all") is _defined_by(type(self), "should_reset"):
            return fast(ledger, step)
        return np.fromiter((self.should_reset(u, step) for u in ledger.rows), dtype=bool, count=len(ledger.rows))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class PeriodicReset(ResetPolicy):
    """Reset every ``every`` optimizer steps of each parameter."""

    needs_sync = False

    def __init__(self, every: int, moments: Sequence[str] = MOMENTS) -> None:
        self.every = check_int("every", every, unit="optimizer steps between resets")
        super().__init__(moments)

    def configure(self, unit: LedgerRow) -> None:
        unit.period, unit.period_source = self.every, "fixed"

    def should_reset(self, unit: LedgerRow, step: int) -> bool:
        return unit.age >= self.every

    def _due_all(self, ledger: Ledger, step: int) -> np.ndarray:
        return ledger.ages >= self.every


class TheoryReset(ResetPolicy):
    """Reset at the theory-guided period K* (paper Prop. 5.2) of each parameter's driver slot.

    K* comes from the slot's float format and beta, or, for grids that are not float formats (8-bit dynamic maps,
    foreign layouts), from the generalized grid estimate on the stored values (made once the state holds data, from a
    rank-independent sample, so every rank agrees). Slots for which the theory predicts no staleness worth a reset
    (fp32, or rho-hat < 1) are never reset.
    """

    needs_sync = False

    def __init__(self, s0: float = 0.6, moments: Sequence[str] = MOMENTS) -> None:
        super().__init__(moments)
        self.s0 = check_s0(s0)

    def configure(self, unit: LedgerRow) -> None:
        driver = unit.driver()
        unit.period, reason = slot_theory.reset_period(unit.rho, None if driver is None else driver.beta, self.s0)
        if unit.rho is None and driver is not None:
            closed, why, needs_estimate = slot_theory.closed_form_rho(driver)
            reason = reason if needs_estimate else why  # e.g. "fp32 (no staleness)" rather than "no theory"
        unit.period_source = reason or "theory"

    def should_reset(self, unit: LedgerRow, step: int) -> bool:
        return unit.period is not None and unit.age >= unit.period

    def _due_all(self, ledger: Ledger, step: int) -> np.ndarray:
        periods = ledger.arrays["period"]
        return (periods != NO_PERIOD) & (ledger.ages >= periods)


class AdaptiveReset(ResetPolicy):
    """Reset when the cycle-averaged excess staleness reaches the EMA's remaining statistical error (paper Alg. 2).

    For every measured step ``A += max(0, (S - s0) / (1 - s0))`` with ``S`` the driver slot's stall fraction
    (``P_ss := 1``), and the unit resets once ``A / n >= E(k)``, ``k`` its age, and ``k >= min_interval``. The
    measured fractions reach the policy at check steps (every ``coverage_steps``: one host read then, none on the
    steps between), so ``A`` and ``n`` are those of the steps up to the last check, while ``k`` is the current age.
    """

    needs_measurement = True

    def __init__(self, s0: float = 0.6, min_interval: int = 50, moments: Sequence[str] = MOMENTS) -> None:
        check_min_interval(min_interval)
        super().__init__(moments)
        self.s0 = check_s0(s0)
        self.min_interval = min_interval

    def configure(self, unit: LedgerRow) -> None:
        unit.period_source = "adaptive"

    def observe(self, unit: LedgerRow, stall_fraction: float) -> None:
        if math.isfinite(stall_fraction):
            unit.accumulator += max(0.0, (stall_fraction - self.s0) / (1.0 - self.s0))
            unit.measured += 1

    def should_reset(self, unit: LedgerRow, step: int) -> bool:
        driver = unit.driver()
        if driver is None or driver.beta is None or unit.age < self.min_interval or unit.measured == 0:
            return False
        return unit.accumulator / unit.measured >= float(statistical_error(unit.age, driver.beta))

    def _due_all(self, ledger: Ledger, step: int) -> np.ndarray:
        ages, measured = ledger.ages, ledger.arrays["measured"]
        ready = (ages >= self.min_interval) & (measured > 0) & ~np.isnan(ledger.betas)
        if not ready.any():
            return ready
        betas = np.where(ready, ledger.betas, 0.5)
        error = 2.0 * betas**ages / (1.0 + betas**ages)  # statistical_error, for every parameter at once
        return ready & (ledger.arrays["accumulator"] / np.maximum(measured, 1) >= error)


class DriftReset(ResetPolicy):
    """Reset a parameter when its stored second moment has drifted out of ``[1 / band, band]`` times an fp32 EMA of
    the same gradients, and it is at least ``min_interval`` steps old.

    Drift is read on check steps (every ``coverage_steps``, one host synchronisation each) on the engine's drift
    panel, which shadows at least one parameter of every (moment, format, beta) group; every parameter of a group
    takes its group's reading (averaged across ranks). It catches the slow bias of nearest rounding ("v can only go
    up"), which stall counts alone do not size. Parameters driven by a first moment (no v) have no drift band and
    are never reset.
    """

    needs_sync = False

    def __init__(self, band: float = 1.5, min_interval: int = 50, moments: Sequence[str] = MOMENTS) -> None:
        check_min_interval(min_interval)
        super().__init__(moments)
        self.band = check_band(band)
        self.min_interval = min_interval

    def configure(self, unit: LedgerRow) -> None:
        unit.period_source = "drift"

    def out_of_band(self, drift: np.ndarray, ages: np.ndarray) -> np.ndarray:
        """Which parameters' drift readings (nan: none yet) lie outside the band, at ages of ``min_interval`` or
        more."""
        with np.errstate(invalid="ignore"):
            outside = (drift > self.band) | (drift < 1.0 / self.band)
        return outside & (ages >= self.min_interval)

    def should_reset(self, unit: LedgerRow, step: int) -> bool:
        return bool(self.out_of_band(np.array([unit.drift]), np.array([unit.age]))[0])

    def _due_all(self, ledger: Ledger, step: int) -> np.ndarray:
        return self.out_of_band(ledger.arrays["drift"], ledger.ages)


def _defined_by(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO that defines ``name``."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


register_policy("periodic", PeriodicReset, {"every": None, "moments": check_moments},
                required={"every": "a positive int number of optimizer steps"})
register_policy("theory", TheoryReset, {"s0": check_s0, "moments": check_moments})
register_policy("adaptive", AdaptiveReset, {"s0": check_s0, "min_interval": check_min_interval,
                                            "moments": check_moments})
register_policy("drift", DriftReset, {"drift_band": check_band, "min_interval": check_min_interval,
                                      "moments": check_moments}, keywords={"drift_band": "band"})


def make_policy(reset: str | ResetPolicy | None, arguments: Mapping[str, Any]) -> tuple[ResetPolicy | None, set[str]]:
    """Turn the front-ends' ``reset`` into a policy object (``None`` = monitor only) from the policy ``arguments`` the
    user passed (``every``, ``s0``, ...; the policy's defaults for the others); returns it and the arguments used."""
    return make("reset", reset, POLICY_SHORTCUTS, ResetPolicy,
                f"None, one of {tuple(POLICY_SHORTCUTS)} or a ResetPolicy instance", arguments)
