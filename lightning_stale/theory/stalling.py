"""The paper's closed-form stall model for floating-point optimizer states.

Everything here is from Topollai & Choromanska, "Understanding Quantization of Optimizer States in LLM
Pre-training" (arXiv 2603.16731 v1, EMNLP 2026); equation numbers refer to v1. The only additions that are ours are
marked "[extension]": the stochastic-rounding build-up curve and the use of the full Eq. 39 (with its lower term) in
the startup window and the reset-period rule when rho-hat < 1, where the paper's closed forms do not apply.

Notation: ``F`` is the CDF of a chi-square with one degree of freedom, ``F(x) = erf(sqrt(x / 2))``; ``beta`` is the
EMA decay of the second moment (Adam's b2); ``rho`` is the effective precision ratio rho-hat (Eq. 7).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import overload

import numpy as np
import torch

from lightning_stale.vocab import check_rounding


# Relative grid parameter eps = 2^-p (p = mantissa bits) of the float formats the model applies to (paper §3.1, A.1).
FORMAT_EPSILON: dict[str, float] = {
    "bf16": 2.0**-7,
    "fp16": 2.0**-10,
    "fp8_e4m3": 2.0**-3,
    "fp8_e5m2": 2.0**-2,
    "fp4_e2m1": 2.0**-1,
    "fp4_e2m2": 2.0**-2,
}

# E[m] for a log-uniform mantissa m on [1, 2) (paper assumption (iii)): the scalar surrogate in rho-hat.
MEAN_MANTISSA = 1.0 / math.log(2.0)


# ---------------------------------------------------------------------------------------------------- validation


def check_beta(beta: float, name: str = "beta") -> float:
    """Return ``beta`` as a float, or raise ValueError unless 0 < beta < 1."""
    beta = float(beta)
    if not 0.0 < beta < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {beta!r}")
    return beta


def check_probability(p: float, name: str) -> float:
    """Return ``p`` as a float, or raise ValueError unless 0 <= p <= 1."""
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
    return p


def check_rho(rho: float) -> float:
    """Return ``rho`` as a float, or raise ValueError unless it is finite and > 0."""
    rho = float(rho)
    if not (rho > 0.0 and math.isfinite(rho)):
        raise ValueError(f"rho must be a finite number > 0, got {rho!r}")
    return rho


# ---------------------------------------------------------------------------------------------------- chi-square(1)


def chi2_cdf(x: float) -> float:
    """CDF of a chi-square with one degree of freedom: ``erf(sqrt(x / 2))`` (0 for x <= 0)."""
    return math.erf(math.sqrt(x / 2.0)) if x > 0.0 else 0.0


def chi2_ppf(p: float) -> float:
    """Inverse of :func:`chi2_cdf` for p in [0, 1): ``2 * erfinv(p)^2``, by bisection then Newton on erf."""
    p = check_probability(p, "p")
    if p == 0.0:
        return 0.0
    if p == 1.0:
        return math.inf
    lo, hi = 0.0, 1.0
    while math.erf(hi) < p:
        hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if math.erf(mid) < p else (lo, mid)
    y = 0.5 * (lo + hi)
    for _ in range(3):  # polish: d erf(y) / dy = 2 / sqrt(pi) * exp(-y^2)
        slope = 2.0 / math.sqrt(math.pi) * math.exp(-y * y)
        if slope == 0.0:
            break
        y -= (math.erf(y) - p) / slope
    return 2.0 * y * y


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _normal_pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


# ---------------------------------------------------------------------------------------------------- rho-hat


def format_epsilon(fmt: str) -> float:
    """Relative grid parameter ``eps = 2^-p`` of a float format name (paper §3.1, Table 1)."""
    try:
        return FORMAT_EPSILON[fmt]
    except KeyError:
        raise ValueError(f"fmt must be one of {sorted(FORMAT_EPSILON)}, got {fmt!r}") from None


def rho_hat(eps: float, beta: float) -> float:
    """Effective precision ratio ``rho = eps ln2 / (2 (1 - beta))`` (paper Def. 3.2, Eq. 7).

    It is the half-spacing of the grid around v measured in units of the typical EMA increment; sigma cancels, so
    the ratio depends only on the format and beta.
    """
    eps = float(eps)
    if not (eps > 0.0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    return eps / (2.0 * (1.0 - check_beta(beta)) * MEAN_MANTISSA)


def format_rho_hat(fmt: str, beta: float) -> float | None:
    """rho-hat of a float format name (a ``lightning_stale.formats`` ``theory_name``), or None for other grids.

    None means the paper's float model does not apply (e.g. ``int8_dynamic`` or fp32); use
    :func:`lightning_stale.theory.estimate_grid` for those.
    """
    eps = FORMAT_EPSILON.get(fmt) if isinstance(fmt, str) else None
    return None if eps is None else rho_hat(eps, beta)


# ---------------------------------------------------------------------------------------------------- stall probability


def _nearest_stall(center: float, rho: float) -> float:
    """P(|z - c| < rho c) for z ~ chi2(1): the NR stall gate centred at c (Eq. 10 for c = 1, Eq. 39 for c = phi_j)."""
    return chi2_cdf(center * (1.0 + rho)) - chi2_cdf(max(0.0, center * (1.0 - rho)))


def _stochastic_stall(center: float, rho: float) -> float:
    """E[max(0, 1 - |z - c| / (2 rho c))] for z ~ chi2(1), in closed form (Prop. 5.1 / Eq. 34 for c = 1).

    With z = x^2, x ~ N(0, 1), the integrand is linear in x^2 on each side of x = sqrt(c); the Gaussian integrals
    int phi = Phi and int x^2 phi = Phi - x phi give the exact value (no quadrature needed).
    """
    h = 2.0 * rho * center  # half-width of the stall region in z

    def i0(a: float, b: float) -> float:  # int_a^b phi(x) dx
        return _normal_cdf(b) - _normal_cdf(a)

    def i2(a: float, b: float) -> float:  # int_a^b x^2 phi(x) dx
        return (_normal_cdf(b) - b * _normal_pdf(b)) - (_normal_cdf(a) - a * _normal_pdf(a))

    lo = math.sqrt(max(0.0, center - h))
    mid = math.sqrt(center)
    hi = math.sqrt(center + h)
    upper = (1.0 + center / h) * i0(mid, hi) - i2(mid, hi) / h  # z in [c, c + h]: 1 - (z - c)/h
    lower = (1.0 - center / h) * i0(lo, mid) + i2(lo, mid) / h  # z in [c - h, c]: 1 - (c - z)/h
    return 2.0 * (upper + lower)  # x and -x give the same z


def stall_probability(rho: float, rounding: str = "nearest") -> float:
    """Steady-state one-step stall probability of the second moment (paper Prop. 3.3 / Eq. 10 and Prop. 5.1 / Eq. 34).

    nearest: ``F(1 + rho) - F(max(0, 1 - rho))``; stochastic: ``E_z[max(0, 1 - |z - 1| / (2 rho))]``, z ~ chi2(1).
    """
    rho = check_rho(rho)
    if check_rounding(rounding) == "nearest":
        return _nearest_stall(1.0, rho)
    return _stochastic_stall(1.0, rho)


@overload
def stall_probability_after(j: int, rho: float, beta: float, rounding: str = "nearest") -> float: ...


@overload
def stall_probability_after(
    j: Sequence[int] | np.ndarray, rho: float, beta: float, rounding: str = "nearest"
) -> np.ndarray: ...


def stall_probability_after(j, rho, beta, rounding="nearest"):
    """Stall probability of the j-th update after a zero init or reset (paper Eq. 39, NR).

    The ideal EMA after j updates is ``sigma^2 phi_j`` with ``phi_j = 1 - beta^j``; NR stalls iff
    ``|z - phi_j| < rho phi_j``: ``F(phi_j (1 + rho)) - F(max(0, phi_j (1 - rho)))``. For rho >= 1 this is Eq. 15.
    ``rounding="stochastic"`` applies the same derivation to Prop. 5.1 [extension, not in the paper].
    Accepts an int (returns a float) or an array of ints >= 0 (returns an array).
    """
    rho, beta = check_rho(rho), check_beta(beta)
    one = _nearest_stall if check_rounding(rounding) == "nearest" else _stochastic_stall
    js = np.asarray(j)
    if js.size and (js.min() < 0 or not np.all(js == np.floor(js))):
        raise ValueError(f"j must be integers >= 0, got {j!r}")
    if rounding == "nearest":
        stalls = np.atleast_1d(nearest_stall_after(js, np.float64(rho), np.float64(beta)))
    else:  # the stochastic gate has no cheap array form; curves of it are short-lived (simulator, CLI)
        phis = np.atleast_1d(-np.expm1(js.astype(np.float64) * math.log(beta)))
        stalls = np.array([one(p, rho) if p > 0.0 else 0.0 for p in phis.tolist()], dtype=np.float64)
    return float(stalls[0]) if js.ndim == 0 else stalls.reshape(js.shape)


def nearest_stall_after(j: np.ndarray, rho: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """:func:`stall_probability_after` (nearest rounding) elementwise over arrays of update counts, rho-hats and betas
    (broadcast together, not validated): many states of different formats at once, in closed form."""
    phis = torch.from_numpy(np.asarray(-np.expm1(np.asarray(j, dtype=np.float64) * np.log(beta)), dtype=np.float64))
    stalls = _nearest_stall_array(phis, torch.from_numpy(np.asarray(rho, dtype=np.float64)))
    return torch.where(phis > 0, stalls, torch.zeros_like(stalls)).numpy()


def _nearest_stall_array(centers: torch.Tensor, rho: float) -> torch.Tensor:
    """:func:`_nearest_stall` for a float64 tensor of centers (one vectorized erf instead of a Python loop)."""
    upper = torch.special.erf(torch.sqrt(centers * (1.0 + rho) / 2.0))
    lower = torch.special.erf(torch.sqrt((centers * (1.0 - rho)).clamp_min(0.0) / 2.0))
    return upper - lower


# ---------------------------------------------------------------------------------------------------- startup window


def startup_window(p0: float, rho: float, beta: float, p_init: float = 0.0) -> int | None:
    """Startup window j*: the first update count at which the total stall fraction reaches p0 (paper Eqs. 16-19).

    With the floor model ``P_total(j) = P_init + (1 - P_init) P_stall(j)``: 0 if ``p0 <= p_init``, otherwise
    ``ceil(log(1 - phi*) / log beta)`` where ``P_stall`` reaches the effective target at ``phi_j = phi*``. For
    rho >= 1, ``phi* = F^-1(p0_eff) / (1 + rho)`` exactly as in the paper; for rho < 1 phi* solves the full Eq. 39
    (with its lower term) by bisection [extension]. None when the target exceeds the steady state (never reached).

    Paper Table 8 prints BF16 j*(0.95) = 3044 with P_init = 0.17; this function gives 3042. Near phi* -> 1 the log
    term is very sensitive to P_init, and the paper used its unrounded measured P_init (P_init = 0.1698, which also
    prints as 0.17, gives 3044); we keep the exact formula.
    """
    p0 = check_probability(p0, "p0")
    p_init = check_probability(p_init, "p_init")
    rho, beta = check_rho(rho), check_beta(beta)
    if p0 <= p_init:
        return 0
    target = (p0 - p_init) / (1.0 - p_init)
    if target >= _nearest_stall(1.0, rho):
        return None
    if rho >= 1.0:
        phi = chi2_ppf(target) / (1.0 + rho)
    else:  # P_stall(phi) is increasing in phi (artanh(rho) > rho phi), so bisection finds the unique root
        lo, hi = 0.0, 1.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _nearest_stall(mid, rho) < target else (lo, mid)
        phi = hi
    if phi >= 1.0:
        return None
    return max(1, math.ceil(math.log1p(-phi) / math.log(beta)))


# ---------------------------------------------------------------------------------------------------- reset period


def statistical_error(k: int | np.ndarray, beta: float) -> float | np.ndarray:
    """Remaining statistical error of a bias-corrected EMA of age k: ``E(K) = 2 beta^K / (1 + beta^K)`` (Eq. 23)."""
    bk = np.power(check_beta(beta), k)
    return 2.0 * bk / (1.0 + bk)


def reset_period(rho: float, beta: float, s0: float = 0.6, k_max: int | None = None) -> int | None:
    """Recommended reset period K*: the crossing of staleness and statistical error (paper Prop. 5.2, Eqs. 21-24, 53).

    ``K* = min{K >= 1 : (1/K) sum_{j<=K} [(S(j) - s0) / (1 - s0)]_+ >= 2 beta^K / (1 + beta^K)}`` with the
    normalized stalling progress ``S(j) = P_stall(j) / P_stall^ss`` from Eq. 39. For rho >= 1 the lower term of
    Eq. 39 vanishes and this is exactly the paper's closed form Eq. 53. For rho < 1 the paper gives no number; we keep
    the lower term [extension]: S(j) still rises monotonically to 1, so the crossing exists.
    Returns None only if no crossing is found up to ``k_max`` (default ``max(10_000, 50 / (1 - beta))``).
    s0 is the staleness tolerance (0.6 throughout the paper); P_init cancels in S(j) and does not enter.
    S(j) is relative to the steady state, so K* stays finite even when almost nothing stalls (fp32, or bf16 at
    b2 = 0.99): check :func:`stall_probability` first; the paper found resets slightly harmful on fp32 states.
    """
    rho, beta = check_rho(rho), check_beta(beta)
    s0 = float(s0)
    if not 0.0 < s0 < 1.0:
        raise ValueError(f"s0 must be in (0, 1), got {s0!r}")
    if k_max is None:
        k_max = max(10_000, math.ceil(50.0 / (1.0 - beta)))
    steady = _nearest_stall(1.0, rho)
    if steady <= 0.0:
        return None
    log_beta = math.log(beta)
    excess_sum = 0.0
    for k in range(1, k_max + 1):
        phi = -math.expm1(k * log_beta)
        s = _nearest_stall(phi, rho) / steady
        excess_sum += max(0.0, (s - s0) / (1.0 - s0))
        bk = math.exp(k * log_beta)
        if excess_sum / k >= 2.0 * bk / (1.0 + bk):
            return k
    return None


# ---------------------------------------------------------------------------------------------------- mean-field decay


def effective_beta(beta: float, p_stall: float) -> float:
    """Effective EMA decay when a fraction p_stall of updates is blocked: ``1 - (1 - beta)(1 - p_stall)`` (Eq. 12)."""
    return 1.0 - (1.0 - check_beta(beta)) * (1.0 - check_probability(p_stall, "p_stall"))


def effective_horizon(beta: float, p_stall: float) -> float:
    """Effective EMA horizon in steps: ``1 / ((1 - beta)(1 - p_stall))`` (Eq. 13); inf when every update stalls."""
    moving = (1.0 - check_beta(beta)) * (1.0 - check_probability(p_stall, "p_stall"))
    return math.inf if moving == 0.0 else 1.0 / moving


# ---------------------------------------------------------------------------------------------------- init floor


def init_floor(block_size: int, s_min: float, x_max: float, p_zero: float = 0.0) -> float:
    """Stall floor P_init right after a reset in a scaled format, by the paper's crush model (Appendix A.4, Eqs. 35-37).

    A scaling group of ``block_size`` values is mapped so its max lands on ``x_max``; NR crushes a coordinate back to
    zero when ``g^2 / max g^2 < tau = s_min / (2 x_max)`` (``s_min``: smallest positive spacing of the grid).
    ``f_crush = F(tau M_B)`` with ``M_B = F^-1(1 - 1/B)``, and ``P_init = p_zero + (1 - p_zero) f_crush``
    (``p_zero``: fraction of exactly-zero gradients).
    """
    if int(block_size) != block_size or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}")
    if not (0.0 < s_min < x_max and math.isfinite(x_max)):
        raise ValueError(f"s_min and x_max must satisfy 0 < s_min < x_max < inf, got s_min={s_min!r}, x_max={x_max!r}")
    p_zero = check_probability(p_zero, "p_zero")
    tau = s_min / (2.0 * x_max)
    m_b = chi2_ppf(1.0 - 1.0 / block_size)
    return p_zero + (1.0 - p_zero) * chi2_cdf(tau * m_b)
