"""The demo's report: a plain-text results table and a four-panel figure, read from the runs' results.

It only reads :class:`~lightning_stale.demo.training.RunResult` objects, so it changes apart from how runs train.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from lightning_stale.demo.configs import CONFIGS
from lightning_stale.demo.training import STALL_KEYS, RunResult

MIN_GAP_FOR_SHARE = 0.005  # below this gap (about the seed noise at CPU scale) a "share recovered" means nothing


def recovered_share(loss: float, baseline_loss: float, reference_loss: float) -> float:
    """Share of the baseline's gap to the reference that ``loss`` closes (1 = fully recovered); NaN without a gap."""
    gap = baseline_loss - reference_loss
    if not gap > MIN_GAP_FOR_SHARE:
        return math.nan
    return (baseline_loss - loss) / gap


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def format_table(results: Sequence[RunResult], reference: str = "fp32") -> str:
    """A plain-text results table; gaps are to ``reference``, shares are of each reset variant's baseline gap."""
    losses = {r.name: r.val_loss for r in results}
    ref = losses.get(reference, math.nan)
    header = ["config", "val loss", f"gap to {reference}", "recovered", "state B/param", "v stall", "v stall pred",
              "v drift", "v underflow", "resets", "auto: guard/SR/reset", "time s"]
    rows = [header]
    for r in results:
        baseline = CONFIGS[r.name].baseline if r.name in CONFIGS else None
        share = math.nan
        if baseline in losses:
            share = recovered_share(r.val_loss, losses[baseline], ref)
        rows.append([
            r.name, _fmt(r.val_loss, ".4f"), _fmt(r.val_loss - ref, "+.4f"), _fmt(100 * share, ".0f") + ("%" if
            not math.isnan(share) else ""), _fmt(r.state_bytes_per_param, ".2f"), _fmt(r.v_frac, ".3f"),
            _fmt(r.v_predicted, ".3f"), _fmt(r.v_drift, ".2f"), _fmt(r.v_underflow, ".4f"), _fmt(r.resets, ".0f"),
            "-" if math.isnan(r.remedy_guard) else
            f"{r.remedy_guard:.0f}/{r.remedy_stochastic:.0f}/{r.remedy_reset:.0f}",
            _fmt(r.seconds, ".0f"),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    notes = [
        f"recovered: (baseline loss - loss) / (baseline gap to {reference}) for a remedy variant, where the baseline "
        f"is the same storage without a remedy and its gap exceeds {MIN_GAP_FOR_SHARE}.",
        "v stall: mean stalled fraction of the second moment over logged steps (measured / theory prediction); "
        "v drift: median stored v over an fp32 shadow of it at the end (1 = no drift); v underflow: mean share of "
        "v elements stored as exactly zero while their gradient was not; auto: parameters the automatic remedy "
        "guards at the end / switched to stochastic rounding / resets it made.",
    ]
    return "\n".join(lines + [""] + notes)


def plot_results(results: Sequence[RunResult], path: Path, title: str = "") -> None:
    """Four panels: validation loss; v stall fraction measured (solid) vs predicted (dashed); v drift; v underflow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    for index, r in enumerate(results):
        color = f"C{index % 10}"
        style = "--" if CONFIGS.get(r.name) and CONFIGS[r.name].baseline else "-"
        for ax, key, kwargs in (
            (axes[0], "val/loss", dict(linestyle=style, marker="o", markersize=3)),
            (axes[1], STALL_KEYS["v_frac"], dict(linestyle="-")),
            (axes[1], STALL_KEYS["v_predicted"], dict(linestyle=":", alpha=0.8)),
            (axes[2], STALL_KEYS["v_drift"], dict(linestyle=style)),
            (axes[3], STALL_KEYS["v_underflow"], dict(linestyle=style)),
        ):
            points = r.curves.get(key, [])
            if points:
                steps, values = zip(*points)
                label = r.name if key != STALL_KEYS["v_predicted"] else None
                ax.plot(steps, values, color=color, label=label, **kwargs)
    axes[0].set(title="validation loss (dashed: with a remedy)", xlabel="step", ylabel="loss")
    axes[1].set(title="v stalled fraction: measured (solid), theory (dotted)", xlabel="step", ylim=(-0.02, 1.02))
    axes[2].set(title="v drift: median stored v / fp32 shadow", xlabel="step")
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    axes[3].set(title="v underflow: stored zero, gradient not", xlabel="step")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["MIN_GAP_FOR_SHARE", "format_table", "plot_results", "recovered_share"]
