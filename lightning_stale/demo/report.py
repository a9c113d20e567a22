"""The demo's report: a plain-text results table and a figure of the logged curves, read from the runs' results.

It only reads :class:`~lightning_stale.demo.training.RunResult` objects, so it changes apart from how runs train.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from lightning_stale.demo.configs import CONFIGS
from lightning_stale.demo.training import LR_KEY, STALL_KEYS, RunResult

MIN_GAP_FOR_SHARE = 0.005  # below this gap (about the seed noise at CPU scale) a "share recovered" means nothing


def recovered_share(loss: float, baseline_loss: float, reference_loss: float) -> float:
    """Share of the baseline's gap to the reference that ``loss`` closes (1 = fully recovered); NaN without a gap."""
    gap = baseline_loss - reference_loss
    if not gap > MIN_GAP_FOR_SHARE:
        return math.nan
    return (baseline_loss - loss) / gap


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def _auto(r: RunResult) -> str:
    if math.isnan(r.remedy_guard):
        return "-"
    weights = 0.0 if math.isnan(r.remedy_weights) else r.remedy_weights
    return f"{weights:.0f}/{r.remedy_guard:.0f}/{r.remedy_stochastic:.0f}/{r.remedy_reset:.0f}"


def format_table(results: Sequence[RunResult], reference: str = "fp32") -> str:
    """A plain-text results table; gaps are to ``reference``, shares are of each remedy variant's baseline gap.

    The weight, underflow, reset and remedy columns appear only where some run has something in them (the weight
    stall exists for bf16/fp16 weights only)."""
    losses = {r.name: r.val_loss for r in results}
    ref = losses.get(reference, math.nan)

    def share(r: RunResult) -> str:
        baseline = CONFIGS[r.name].baseline if r.name in CONFIGS else None
        value = recovered_share(r.val_loss, losses[baseline], ref) if baseline in losses else math.nan
        return "-" if math.isnan(value) else f"{100 * value:.0f}%"

    columns = [  # (header, cell, shown)
        ("config", lambda r: r.name, True),
        ("val loss", lambda r: format(r.val_loss, ".4f"), True),  # a diverged run shows nan
        (f"gap to {reference}", lambda r: format(r.val_loss - ref, "+.4f"), True),
        ("recovered", share, True),
        ("state B/param", lambda r: _fmt(r.state_bytes_per_param + r.weight_buffer_bytes_per_param, ".2f"), True),
        ("w stall", lambda r: _fmt(r.w_frac, ".3f"), any(not math.isnan(r.w_frac) for r in results)),
        ("w stall pred", lambda r: _fmt(r.w_predicted, ".3f"), any(not math.isnan(r.w_frac) for r in results)),
        ("v stall", lambda r: _fmt(r.v_frac, ".3f"), True),
        ("v stall pred", lambda r: _fmt(r.v_predicted, ".3f"), True),
        ("v drift", lambda r: _fmt(r.v_drift, ".2f"), True),
        ("v underflow", lambda r: _fmt(r.v_underflow, ".4f"), any(r.v_underflow > 0 for r in results)),
        ("resets", lambda r: _fmt(r.resets, ".0f"), any(r.resets > 0 for r in results)),
        ("auto: w/guard/SR/reset", _auto, any(not math.isnan(r.remedy_guard) for r in results)),
        ("time s", lambda r: _fmt(r.seconds, ".0f"), True),
    ]
    columns = [(header, cell) for header, cell, shown in columns if shown]
    rows = [[header for header, _ in columns]] + [[cell(r) for _, cell in columns] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    headers = {header for header, _ in columns}
    notes = [
        f"recovered: (baseline loss - loss) / (baseline gap to {reference}) for a remedy variant, where the baseline "
        f"is the same storage without a remedy and its gap exceeds {MIN_GAP_FOR_SHARE}. state B/param: optimizer "
        "state and the weight write-back's buffers, bytes per parameter.",
    ]
    if "w stall" in headers:
        notes.append("w stall: mean share of bf16 weights left unchanged by a step although their gradient was not "
                     "zero, over logged steps (measured / predicted from the lr and the optimizer's moments).")
    notes.append("v stall: mean stalled share of the second moment over logged steps (measured / the theory's "
                 "prediction for nearest rounding); v drift: median stored v over an fp32 shadow of it at the end "
                 "(1 = no drift)."
                 + (" v underflow: mean share of v stored as exactly zero while its gradient was not."
                    if "v underflow" in headers else ""))
    if "auto: w/guard/SR/reset" in headers:
        notes.append("auto: at the end, parameters whose weights the automatic remedy writes / it guards / whose "
                     "moments it rounds stochastically (the weight write-back's included), and the resets it made.")
    return "\n".join(lines + [""] + notes)


def _points(r: RunResult, key: str) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    points = r.curves.get(key, [])
    return tuple(zip(*points)) if points else None  # type: ignore[return-value]


def plot_results(results: Sequence[RunResult], path: Path, title: str = "") -> None:
    """Validation loss; the weight stall, measured (solid) against predicted (dotted), with the lr (where a run has
    bf16 weights); the v stall, measured against predicted; v drift; v underflow (where some run has any)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    weights = any(r.curves.get(STALL_KEYS["w_frac"]) for r in results)
    underflow = any(v > 0 for r in results for _, v in r.curves.get(STALL_KEYS["v_underflow"], []))
    panels = ["loss"] + (["w"] if weights else []) + ["v", "drift"] + (["underflow"] if underflow else [])
    columns = 2 if len(panels) == 4 else min(len(panels), 3)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4.2 * rows), squeeze=False)
    for extra in axes.flat[len(panels):]:
        extra.set_axis_off()
    ax = dict(zip(panels, axes.flat))
    for index, r in enumerate(results):
        color = f"C{index % 10}"
        style = "--" if CONFIGS.get(r.name) and CONFIGS[r.name].baseline else "-"
        plots = [("loss", "val/loss", dict(linestyle=style, marker="o", markersize=3), r.name),
                 ("v", STALL_KEYS["v_frac"], dict(linestyle=style), r.name),
                 ("v", STALL_KEYS["v_predicted"], dict(linestyle=":", alpha=0.8), None),
                 ("drift", STALL_KEYS["v_drift"], dict(linestyle=style), r.name)]
        if weights:
            plots += [("w", STALL_KEYS["w_frac"], dict(linestyle=style), r.name),
                      ("w", STALL_KEYS["w_predicted"], dict(linestyle=":", alpha=0.8), None)]
        if underflow:
            plots.append(("underflow", STALL_KEYS["v_underflow"], dict(linestyle=style), r.name))
        for panel, key, kwargs, label in plots:
            points = _points(r, key)
            if points:
                ax[panel].plot(*points, color=color, label=label, **kwargs)
    ax["loss"].set(title="validation loss (dashed: with a remedy)", xlabel="step", ylabel="loss")
    ax["loss"].legend(fontsize=8)
    if weights:
        ax["w"].set(title="bf16 weights unchanged by a step:\nmeasured (solid), predicted (dotted)", xlabel="step",
                    ylim=(-0.02, 1.02))
        lr = next((_points(r, LR_KEY) for r in results if _points(r, LR_KEY)), None)
        if lr:
            twin = ax["w"].twinx()
            twin.plot(*lr, color="grey", linewidth=1, alpha=0.6)
            twin.set_ylabel("lr (grey)", color="grey")
            twin.set_ylim(bottom=0)
    ax["v"].set(title="v stalled fraction: measured (solid),\ntheory for nearest rounding (dotted)", xlabel="step",
                ylim=(-0.02, 1.02))
    ax["drift"].set(title="v drift: median stored v / fp32 shadow", xlabel="step")
    ax["drift"].axhline(1.0, color="black", linewidth=0.8)
    if underflow:
        ax["underflow"].set(title="v underflow: stored zero, gradient not", xlabel="step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["MIN_GAP_FOR_SHARE", "format_table", "plot_results", "recovered_share"]
