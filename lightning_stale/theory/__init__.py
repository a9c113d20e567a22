"""How stale low-precision optimizer states get, and when to reset them.

:mod:`lightning_stale.theory.stalling` holds the paper's closed-form model (Topollai & Choromanska, arXiv 2603.16731,
EMNLP 2026) for float grids; :mod:`lightning_stale.theory.grid` is our extension to any grid measured from stored
values (int8 dynamic map with block scales, scaled FP8/FP4, bitsandbytes/torchao states).
"""

from lightning_stale.theory.grid import GridEstimate, estimate_grid, relative_spacing, rho_from_relative_spacing
from lightning_stale.theory.stalling import (
    FORMAT_EPSILON,
    check_beta,
    chi2_cdf,
    chi2_ppf,
    effective_beta,
    effective_horizon,
    format_epsilon,
    format_rho_hat,
    init_floor,
    nearest_stall_after,
    reset_period,
    rho_hat,
    stall_probability,
    stall_probability_after,
    startup_window,
    statistical_error,
)
from lightning_stale.vocab import ROUNDINGS

__all__ = [
    "FORMAT_EPSILON",
    "ROUNDINGS",
    "GridEstimate",
    "check_beta",
    "chi2_cdf",
    "chi2_ppf",
    "effective_beta",
    "effective_horizon",
    "estimate_grid",
    "format_epsilon",
    "format_rho_hat",
    "init_floor",
    "nearest_stall_after",
    "relative_spacing",
    "reset_period",
    "rho_from_relative_spacing",
    "rho_hat",
    "stall_probability",
    "stall_probability_after",
    "startup_window",
    "statistical_error",
]
