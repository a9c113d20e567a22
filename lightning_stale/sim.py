"""A controlled simulator of Adam moments stored in a low-precision format, measured against the stalling theory.

N independent coordinates receive Gaussian gradients ``g_i = c(t) sigma_i xi`` (``xi ~ N(0, 1)``); ``c(t)`` is the
gradient scale, optionally changed at one step (the paper author's toy: variance 1, then 0.25 from step 2000). The
per-coordinate variances ``sigma_i^2`` are log-uniform over ``spread_octaves`` octaves, which realizes the paper's
log-uniform-mantissa assumption. Each step reads the stored moments, updates them in fp32 and writes them back with
:mod:`lightning_stale.formats` (paper Alg. 1), optionally resetting both moments and their age every K steps. It
records the fraction of codes left unchanged (stalls, paper Def. 3.1) for m and v, the stored v against an fp32 EMA of
the same gradients (reset with it), and the theory's prediction for the v stall fraction.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lightning_stale.formats import check_format_name, get_format
from lightning_stale.theory import estimate_grid, format_rho_hat, reset_period, stall_probability_after
from lightning_stale.vocab import check_int, check_rounding

COLUMNS = ("step", "age", "stall_v", "stall_m", "predicted_v", "v_ratio", "v_abs_err", "v_down")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. ``reset`` is ``"none"``, ``"theory"`` (K* from :func:`reset_period`) or a period K > 0."""

    fmt: str = "bf16"
    rounding: str = "nearest"
    steps: int = 4000
    n: int = 20_000
    beta1: float = 0.9
    beta2: float = 0.999
    scale: float = 1.0
    scale_after: float | None = 0.5
    change_step: int | None = 2000
    spread_octaves: int = 2
    reset: str | int = "none"
    s0: float = 0.6
    seed: int = 0

    def __post_init__(self) -> None:
        check_format_name(self.fmt, "fmt")
        check_rounding(self.rounding)
        for name in ("steps", "n"):
            check_int(name, getattr(self, name))
        for name in ("beta1", "beta2", "s0"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)!r}")
        if not self.scale > 0 or (self.scale_after is not None and not self.scale_after > 0):
            raise ValueError(f"scale and scale_after must be > 0, got {self.scale!r} and {self.scale_after!r}")
        if self.change_step is not None and self.change_step < 1:
            raise ValueError(f"change_step must be >= 1 or None, got {self.change_step!r}")
        if int(self.spread_octaves) != self.spread_octaves or self.spread_octaves < 0:
            raise ValueError(f"spread_octaves must be an integer >= 0, got {self.spread_octaves!r}")
        if not (self.reset in ("none", "theory") or (isinstance(self.reset, int) and self.reset >= 1)):
            raise ValueError(f"reset must be 'none', 'theory' or an integer period >= 1, got {self.reset!r}")


@dataclass
class SimResult:
    """Per-step records of one run (arrays aligned with ``step``) and the theory used for the prediction.

    stall_v / stall_m: fraction of coordinates whose stored code did not change this step. predicted_v: the floor
    model ``P_init + (1 - P_init) P_stall(j)`` (paper Eqs. 17, 39) with j the updates accumulated since the last
    reset and P_init the stall fraction measured at the cycle's first update. The reference is an fp32 EMA of the same
    gradients, reset together with the stored state (so only the rounding differs): v_ratio is the mean stored v over
    the mean reference v (1 = tracking), v_abs_err the median over coordinates of |stored / reference - 1|.
    v_down: fraction of coordinates whose stored v decreased this step.
    """

    config: SimConfig
    rho_hat: float
    rho_source: str
    period: int | None
    columns: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def label(self) -> str:
        reset = "no reset" if self.period is None else f"reset every {self.period}"
        return f"{self.config.fmt} {self.config.rounding}, {reset}"

    def summary(self) -> dict[str, float | int | str | None]:
        """Run-level numbers: means over the run, and the v ratio at the end and just before the scale change."""
        c = self.columns
        row: dict[str, float | int | str | None] = {
            "run": self.label,
            "rho_hat": round(self.rho_hat, 3),
            "period": self.period,
            "stall_v": float(c["stall_v"].mean()),
            "predicted_v": float(c["predicted_v"].mean()),
            "mean_abs_gap": float(np.abs(c["stall_v"] - c["predicted_v"]).mean()),
            "stall_m": float(c["stall_m"].mean()),
            "v_ratio_end": float(c["v_ratio"][-1]),
            "v_abs_err": float(c["v_abs_err"].mean()),
        }
        change = self.config.change_step
        if change is not None and 1 < change <= self.config.steps:
            row["v_ratio_before_change"] = float(c["v_ratio"][change - 2])
        return row

    def write_csv(self, path: str | Path) -> None:
        """One row per step with :data:`COLUMNS`."""
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            for row in zip(*(self.columns[name] for name in COLUMNS)):
                writer.writerow([f"{x:.6g}" if isinstance(x, float) else int(x) for x in row])


def theory_rho(fmt: str, beta2: float, variances: torch.Tensor) -> tuple[float, str]:
    """rho-hat for the stored second moment: the paper's (Eq. 7) for float formats it models, otherwise the grid
    estimate [extension] from the format storing the expected steady state ``v_i = sigma_i^2``."""
    v_format = get_format(fmt, signed=False)
    rho = format_rho_hat(v_format.theory_name, beta2)
    if rho is not None:
        return rho, "paper Eq. 7"
    q = v_format.quantize(variances)
    return estimate_grid(v_format.dequantize(q), v_format.spacing(q), beta2).rho_hat, "grid estimate (extension)"


def simulate(config: SimConfig) -> SimResult:
    """Run ``config`` and return its per-step records (deterministic for a given seed)."""
    gen = torch.Generator().manual_seed(config.seed)
    n, b1, b2 = config.n, config.beta1, config.beta2
    octaves = config.spread_octaves
    sigma2 = torch.exp2((torch.rand(n, generator=gen) - 0.5) * octaves) if octaves else torch.ones(n)
    rho, source = theory_rho(config.fmt, b2, sigma2 * config.scale**2)
    if config.reset == "none":
        period = None
    elif config.reset == "theory":
        period = reset_period(rho, b2, config.s0)
    else:
        period = int(config.reset)
    curve = stall_probability_after(np.arange(config.steps), rho, b2, config.rounding)

    m_fmt, v_fmt = get_format(config.fmt, signed=True), get_format(config.fmt, signed=False)
    qm, qv = m_fmt.empty((n,)), v_fmt.empty((n,))
    m_codes, v_codes = m_fmt.element_codes(qm).clone(), v_fmt.element_codes(qv).clone()
    v_stored = v_fmt.dequantize(qv)
    v_ref = torch.zeros(n, dtype=torch.float64)
    rows = {name: np.zeros(config.steps) for name in COLUMNS}
    age, p_init = 0, 0.0
    for t in range(1, config.steps + 1):
        late = config.change_step is not None and config.scale_after is not None and t >= config.change_step
        c = config.scale_after if late else config.scale
        g = torch.randn(n, generator=gen) * sigma2.sqrt() * c
        age += 1

        m_new = b1 * m_fmt.dequantize(qm) + (1 - b1) * g
        v_new = b2 * v_stored + (1 - b2) * g * g
        m_fmt.quantize_into(qm, m_new, config.rounding, gen)
        v_fmt.quantize_into(qv, v_new, config.rounding, gen)
        v_ref.mul_(b2).add_((1 - b2) * g.double() ** 2)

        new_m_codes, new_v_codes = m_fmt.element_codes(qm), v_fmt.element_codes(qv)
        new_v_stored = v_fmt.dequantize(qv)
        stall_v = (new_v_codes == v_codes).double().mean().item()
        if age == 1:
            p_init = stall_v
        stored = new_v_stored.double()  # same age as v_ref, so the bias corrections cancel
        i = t - 1
        rows["step"][i], rows["age"][i] = t, age
        rows["stall_v"][i] = stall_v
        rows["stall_m"][i] = (new_m_codes == m_codes).double().mean().item()
        rows["predicted_v"][i] = p_init + (1 - p_init) * curve[age - 1]
        rows["v_ratio"][i] = (stored.sum() / v_ref.sum()).item()
        rows["v_abs_err"][i] = (stored / v_ref - 1).abs().median().item()
        rows["v_down"][i] = (new_v_stored < v_stored).double().mean().item()

        if period is not None and age == period:  # reset both moments and their age after the write-back
            qm, qv, age = m_fmt.empty((n,)), v_fmt.empty((n,)), 0
            v_ref.zero_()
            new_m_codes, new_v_codes = m_fmt.element_codes(qm), v_fmt.element_codes(qv)
            new_v_stored = v_fmt.dequantize(qv)
        m_codes, v_codes, v_stored = new_m_codes.clone(), new_v_codes.clone(), new_v_stored
    return SimResult(config, rho, source, period, rows)


def plot_runs(results: list[SimResult], path: str | Path) -> None:
    """Save a two-panel PNG: measured vs predicted v stall fraction, and the stored v / fp32 EMA ratio, per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_stall, ax_ratio) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for k, res in enumerate(results):
        color = f"C{k}"
        cols = res.columns
        ax_stall.plot(cols["step"], _smooth(cols["stall_v"]), color=color, lw=1.2, label=f"measured, {res.label}")
        ax_stall.plot(cols["step"], cols["predicted_v"], color=color, ls="--", lw=1.0, label="theory (Eq. 39)")
        ax_ratio.plot(cols["step"], cols["v_ratio"], color=color, lw=1.2, label=res.label)
    change = results[0].config.change_step
    for ax in (ax_stall, ax_ratio):
        if change is not None and change <= results[0].config.steps:
            ax.axvline(change, color="grey", lw=0.8, ls=":")
    cfg = results[0].config
    ax_stall.set_ylabel("v stall fraction (codes unchanged)")
    ax_stall.set_title(f"{cfg.fmt}, b2 = {cfg.beta2}, rho-hat = {results[0].rho_hat:.3g} ({results[0].rho_source})")
    ax_stall.set_ylim(-0.02, 1.02)
    ax_stall.legend(fontsize=7, loc="lower right")
    ax_ratio.axhline(1.0, color="black", lw=0.6)
    ax_ratio.set_ylabel("mean stored v / mean fp32 EMA")
    ax_ratio.set_xlabel("step")
    ax_ratio.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _smooth(x: np.ndarray, window: int = 25) -> np.ndarray:
    """Trailing moving average (the per-step fraction is noisy at small N)."""
    kernel = np.ones(window) / window
    return np.convolve(x, kernel, mode="full")[: x.size] * window / np.minimum(np.arange(1, x.size + 1), window)


__all__ = ["COLUMNS", "SimConfig", "SimResult", "plot_runs", "simulate", "theory_rho"]
