"""Paired differences between configurations over seeds, with a 95% confidence interval (Student's t, n-1 degrees
of freedom): what every recovery table reports, and "significant" means the interval excludes zero."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Two-sided 95% quantiles of Student's t, t_{0.975, df}, for df = 1..30 (standard tables).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Student's t quantile for a two-sided 95% interval with ``df`` degrees of freedom (df > 30: the normal
    quantile with the first two terms of its Cornish-Fisher expansion, within 0.0002 of the exact value)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class PairedDifference:
    """Mean of per-seed differences ``a_s - b_s`` and the half-width of its 95% interval (nan below two seeds)."""

    mean: float
    half_width: float
    n: int

    @classmethod
    def of(cls, differences: Sequence[float]) -> PairedDifference:
        n = len(differences)
        if n == 0:
            return cls(math.nan, math.nan, 0)
        mean = statistics.fmean(differences)
        if n == 1:
            return cls(mean, math.nan, 1)
        return cls(mean, t975(n - 1) * statistics.stdev(differences) / math.sqrt(n), n)

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def significant(self) -> bool:
        """The 95% interval excludes zero (False with fewer than two seeds)."""
        return not math.isnan(self.half_width) and (self.low > 0 or self.high < 0)

    def __str__(self) -> str:
        if math.isnan(self.mean):
            return "-"
        if math.isnan(self.half_width):
            return f"{self.mean:+.4f} (n=1)"
        return f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}]"


__all__ = ["PairedDifference", "t975"]
