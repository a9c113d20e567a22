"""Our extension of the stall model to any storage grid (not in the paper).

The paper's model needs only the relative local spacing ``r = ulp(v) / v`` of the stored second moment: its exact
per-coordinate gate (Eq. 28) is ``|z - 1| >= r / (2 (1 - beta))``, and for float grids it replaces ``r = eps / m`` by
the scalar surrogate ``eps / E[m]`` (Eq. 7). Written in terms of r, that surrogate is the harmonic mean of r:
``eps / E[m] = 1 / E[1 / r]``. We use the same summary for any grid (the 8-bit dynamic map with block scales,
per-tensor scaled FP8, ...), measured from a sample of stored values: for a float grid with a log-uniform mantissa it
gives back the paper's rho-hat exactly, so the extension reduces to the paper on the paper's formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lightning_stale.theory.stalling import check_beta, reset_period, stall_probability

QUANTILES = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class GridEstimate:
    """Stall prediction for a sampled grid [extension]; see :func:`estimate_grid`.

    ``r_quantiles`` maps 0.1 / 0.5 / 0.9 to those quantiles of the relative spacing r = spacing / |value|;
    ``r_effective`` is the harmonic mean of r that defines ``rho_hat``.
    """

    rho_hat: float
    p_stall_nearest: float
    p_stall_stochastic: float
    reset_period: int | None
    n: int
    r_effective: float
    r_quantiles: dict[float, float]


def rho_from_relative_spacing(r: float, beta: float) -> float:
    """Eq. 7 written for a relative spacing r instead of ``eps / E[m]``: ``rho = r / (2 (1 - beta))`` [extension]."""
    r = float(r)
    if not (r > 0.0 and math.isfinite(r)):
        raise ValueError(f"r must be a finite number > 0, got {r!r}")
    return r / (2.0 * (1.0 - check_beta(beta)))


def relative_spacing(values: torch.Tensor, spacing: torch.Tensor) -> np.ndarray:
    """``spacing / |values|`` as float64 for the finite, non-zero values with finite positive spacing."""
    if values.shape != spacing.shape:
        raise ValueError(f"values and spacing must have the same shape, got {tuple(values.shape)} and "
                         f"{tuple(spacing.shape)}")
    v = values.detach().to(torch.float64).abs().flatten().cpu().numpy()
    u = spacing.detach().to(torch.float64).flatten().cpu().numpy()
    keep = np.isfinite(v) & np.isfinite(u) & (v > 0) & (u > 0)
    return u[keep] / v[keep]


def estimate_grid(values: torch.Tensor, spacing: torch.Tensor, beta: float, s0: float = 0.6) -> GridEstimate:
    """Effective rho-hat, steady stall probabilities and reset period of any grid [extension, not the paper's].

    ``values`` are stored second-moment values and ``spacing`` their absolute local spacing (distance to the next
    larger representable magnitude, the paper's ulp convention); zeros and non-finite entries are excluded.
    The effective relative spacing is the harmonic mean ``r_eff = 1 / mean(|value| / spacing)``, the exact analogue of
    the paper's ``eps / E[m]`` surrogate, and ``rho_hat = r_eff / (2 (1 - beta))``. The probabilities and the period
    then follow from the paper's formulas (Eqs. 10, 34, 53) with that rho-hat.
    """
    beta = check_beta(beta)
    r = relative_spacing(values, spacing)
    if r.size == 0:
        raise ValueError("values must contain at least one finite non-zero entry with a finite positive spacing")
    r_eff = 1.0 / float(np.mean(1.0 / r))
    rho = rho_from_relative_spacing(r_eff, beta)
    return GridEstimate(
        rho_hat=rho,
        p_stall_nearest=stall_probability(rho, "nearest"),
        p_stall_stochastic=stall_probability(rho, "stochastic"),
        reset_period=reset_period(rho, beta, s0),
        n=int(r.size),
        r_effective=r_eff,
        r_quantiles={q: float(np.quantile(r, q)) for q in QUANTILES},
    )
