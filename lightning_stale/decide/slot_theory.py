"""Theory predictions for slots: rho-hat, the stall build-up after a reset and the reset period K*.

Float formats (bf16, fp16, fp8, fp4) take the paper's closed form from the format's precision; other grids (the 8-bit
dynamic map of bitsandbytes/torchao, foreign layouts) take the generalized estimate on a sample of the slot's stored
values and local spacing (:func:`lightning_stale.theory.estimate_grid`, our extension of the paper), re-taken as the
state evolves (closely until it has settled, :func:`settle_age`) so that the live estimate agrees with one of a later
checkpoint. Estimated rho-hats are rounded to a 1% bucket so that slots share their periods. The predicted stall is
evaluated in closed form for the few parameters measured on a step, so nothing grows with the run or the number of
distinct rho-hats.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from torch import Tensor

from lightning_stale import theory
from lightning_stale._compat import local_tensor
from lightning_stale.adapters.protocol import Slot
from lightning_stale.adapters.sampling import choose_sample
from lightning_stale.formats import FORMATS, get_format

ESTIMATE_SAMPLE_SIZE = 4096  # stored values a grid estimate looks at
ESTIMATE_SEED = 0  # rank-independent: every process samples the same positions of its shard
RHO_BUCKET = 0.01  # relative width of the rho-hat buckets of grid estimates
SETTLE_HORIZONS = 0.5  # a state this many EMA horizons old has settled on its grid (500 updates at b2 0.999)


def closed_form_rho(slot: Slot) -> tuple[float | None, str, bool]:
    """(rho-hat, where it came from, whether a grid estimate is needed instead) for a slot, without reading it."""
    if slot.beta is None:
        return None, "not an EMA", False
    if slot.format == "fp32":
        return None, "fp32 (no staleness)", False
    theory_name = get_format(slot.format, signed=slot.moment == "m").theory_name if slot.format in FORMATS else None
    if theory_name is not None:
        return theory.format_rho_hat(theory_name, slot.beta), f"{theory_name} format", False
    return None, f"grid estimate ({slot.format})", True


def estimate_sums(slot: Slot, key: str) -> Tensor | None:
    """The sums behind the generalized grid estimate of a slot, ``(sum of |value| / spacing, number of values)``, over
    a rank-independent sample of its stored non-zero values with a known spacing, as a float64 2-vector on the slot's
    device (no host read: the monitor reads many at once); None where the slot has no EMA beta, no known spacing or
    no elements on this process. A count of 0 means no non-zero value yet (a zero-initialised LoRA factor, a dead
    first batch: try again later). Sums from the shards of one parameter add up to the whole parameter's."""
    if slot.beta is None:
        return None
    sample = choose_sample(key, local_tensor(slot.param).shape, ESTIMATE_SAMPLE_SIZE, ESTIMATE_SEED)
    if sample.count == 0:
        return None
    return slot.spacing_sums(sample)


def rho_from_sums(inverse_sum: float, n: int, beta: float) -> float:
    """The bucketed rho-hat of the harmonic-mean relative spacing ``n / inverse_sum`` (our extension, Eq. 7)."""
    return bucket(theory.rho_from_relative_spacing(n / inverse_sum, beta))


def estimate_rho(slot: Slot, key: str) -> float | None:
    """The grid estimate of one slot's rho-hat from its stored values (bucketed), None while it cannot be made: the
    estimator the live monitor uses, for readers of saved states (``lightning-stale inspect``)."""
    sums = estimate_sums(slot, key)
    if sums is None:
        return None
    inverse_sum, n = sums.tolist()
    return rho_from_sums(inverse_sum, int(n), slot.beta) if n > 0 else None


def settle_age(beta: float) -> int:
    """Updates after which a state has settled on its grid: ``SETTLE_HORIZONS`` EMA horizons. Before, its stored
    values have not filled the grid the way they will, and a grid estimate overstates rho-hat (the period then comes
    out too short)."""
    return math.ceil(SETTLE_HORIZONS / (1.0 - beta))


def bucket(rho: float) -> float:
    """``rho`` rounded to the nearest point of a geometric grid of ratio ``1 + RHO_BUCKET``."""
    step = math.log1p(RHO_BUCKET)
    return float(math.exp(round(math.log(rho) / step) * step))


@lru_cache(maxsize=4096)  # a period per (rho-hat bucket, beta, s0): a few dozen in a run
def reset_period(rho: float | None, beta: float | None, s0: float) -> tuple[int | None, str]:
    """K* for a slot's rho-hat and beta, or None with the reason when no reset is warranted.

    The paper's crossing rule (Eq. 53) is derived for rho-hat >= 1, where most updates stall at steady state; below
    that the state keeps moving and we do not reset (K* is relative to the steady state, so it would stay finite
    even for an almost never stalling state).
    """
    if rho is None or beta is None:
        return None, "no theory"
    if rho < 1.0:
        return None, f"rho-hat {rho:.2f} < 1: state keeps moving, no reset"
    period = theory.reset_period(rho, beta, s0)
    return period, "" if period is not None else f"rho-hat {rho:.2f}: no crossing"


def predicted_stall(updates: np.ndarray, rho: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Predicted stall probability (paper Eq. 39, nearest rounding) of an update applied to states holding
    ``updates`` updates since their zero start or last reset (0 for the first update after a reset), elementwise
    over the states' rho-hats and betas."""
    return theory.nearest_stall_after(updates, rho, beta)
