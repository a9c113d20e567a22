"""``lightning-stale inspect``: how stale the optimizer states of a saved checkpoint are, without re-running anything.

The checkpoint is read by :mod:`lightning_stale.adapters.saved_state` with the live adapters' slot classes, and each
stored moment of each parameter is measured as the live monitor sees it: its format, the share stored as exact zero and
as zero while the other moment is not (for v, the underflow precondition), the share at the ends of its grid, rho-hat
(the closed form for float formats, else ``slot_theory.estimate_rho`` on the sample the live monitor reads, from the
same unit key) and K* (``slot_theory.reset_period``). The monitor's own saved state, when the checkpoint has one, adds
each parameter's steps since its last reset, period, resets and remedy. Output: a table (riskiest parameters first),
JSON, and a per-parameter figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_stale.adapters.saved_state import Checkpoint, MonitorPart, SavedOptimizer, SavedParam

HELP = ("Report how stale the optimizer states saved in a checkpoint are, per parameter and moment: a table, JSON or "
        "a figure.")
RISK_ORDER = "v underflow share, then rho-hat, largest first"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a Lightning .ckpt, a torch.save'd dict or optimizer state_dict, a Hugging Face "
                                     "checkpoint folder (optimizer.pt) or a distributed checkpoint folder (.metadata)")
    parser.add_argument("--json", action="store_true",
                        help="print the whole report as JSON (every parameter) instead of the table")
    parser.add_argument("--plot", metavar="FILE", default=None,
                        help="also draw, by parameter, rho-hat, v's zero and underflow shares and the shares stored "
                             "next to zero into FILE (.png, .svg or .pdf)")
    parser.add_argument("--top", type=int, default=20,
                        help="table rows for the N riskiest parameters (default: 20; 0 for all)")
    parser.add_argument("--s0", type=float, default=0.6, help="staleness tolerance of K* (default: 0.6)")
    parser.add_argument("--trusted", action="store_true",
                        help="unpickle without weights_only=True: it runs code from the file, so only for files you "
                             "trust")


def run(args: argparse.Namespace) -> int:
    try:
        if not 0.0 < args.s0 < 1.0:
            raise ValueError(f"--s0 in (0, 1), found {args.s0!r}")
        if args.top < 0:
            raise ValueError(f"--top >= 0, found {args.top!r}")
        report = build_report(args.path, args.s0, args.trusted)
    except OSError as error:
        return _error(f"a readable checkpoint, found {error.strerror or error}: {str(error.filename or args.path)!r}")
    except ValueError as error:
        return _error(str(error))
    if args.plot is not None:
        try:
            plot_report(report, args.plot)
        except (OSError, ValueError) as error:  # an unwritable path, an extension matplotlib does not know
            return _error(f"a --plot FILE matplotlib can write (.png, .svg, .pdf), found {_one_line(error)}")
    print(json.dumps(report.to_json(), indent=1, allow_nan=False) if args.json else "\n".join(render(report, args.top)))
    return 0


def _error(message: str) -> int:
    print(f"lightning-stale inspect: error: {message}", file=sys.stderr)
    return 2


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


# -- the report ------------------------------------------------------------------------------------------------------
@dataclass
class MomentRow:
    """One stored moment of one parameter."""

    moment: str
    key: str  # the optimizer-state key it is read from
    format: str  # as the live adapters name it
    beta: float | None
    elements: int
    zero: float  # share stored as exact zero
    lone_zero: float | None  # share stored as zero while the other moment is not (for v: the underflow precondition)
    bottom: float | None  # share at the smallest non-zero magnitude of the grid
    top: float | None  # share at the largest magnitude of the grid
    rho: float | None
    rho_source: str
    k_star: int | None
    k_star_note: str


@dataclass
class ParamRow:
    """One parameter with saved state."""

    optimizer: int
    index: int  # position in its optimizer's param groups
    unit: str  # the live monitor's unit key, whose sample the grid estimate reads
    name: str
    shape: list[int] | None
    step: int | None  # the state's own step counter
    moments: list[MomentRow]
    monitor: dict[str, Any] | None = None  # the monitor's saved fields for this parameter (age, period, ...; nan: None)

    @property
    def risk(self) -> tuple[float, float]:
        """The sort key of the table: v underflow share, then the driver slot's rho-hat (v, else m)."""
        driver = next((m for m in self.moments if m.moment == "v"), self.moments[0] if self.moments else None)
        if driver is None:
            return 0.0, 0.0
        return driver.lone_zero or 0.0, driver.rho or 0.0


@dataclass
class OptimizerReport:
    """One saved optimizer: its family, its parameters with state and, when saved, its monitor's counters."""

    index: int
    family: str
    parameters: int  # in its param groups, with state or not
    betas: list[float] | None
    params: list[ParamRow]
    monitor: dict[str, Any] | None = None  # source, policy, steps, reset events, remedy resets
    compensated: int = 0  # parameters whose weights the write-back keeps by compensated summation


@dataclass
class Report:
    """What ``inspect`` found in one checkpoint."""

    path: str
    kind: str
    step: int | None
    s0: float
    names: str  # where the parameter names come from, or why positions are shown
    optimizers: list[OptimizerReport]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON values (NaN and infinities as null)."""
        return _finite(asdict(self))


def build_report(path: str, s0: float = 0.6, trusted: bool = False) -> Report:
    """Measure every stored moment of every optimizer in the checkpoint at ``path``; ValueError when it cannot be
    read (the message says what was expected and what was found)."""
    from lightning_stale.adapters.saved_state import load_checkpoint, read_optimizer

    checkpoint = load_checkpoint(path, trusted)
    optimizers = [read_optimizer(state_dict) for state_dict in checkpoint.optimizers]
    if not any(o.params for o in optimizers):
        raise ValueError(f"optimizer state for at least one parameter, found {checkpoint.kind} whose optimizer "
                         "state is empty (saved before the first optimizer step?)")
    names, names_note, shapes = _names(checkpoint, optimizers)
    reports = []
    for i, (state_dict, saved, part) in enumerate(zip(checkpoint.optimizers, optimizers, checkpoint.monitors or
                                                      [None] * len(optimizers))):
        missing = {p.index: shapes[i][p.index] for p in saved.params if p.shape is None and shapes[i][p.index]}
        if missing:  # shapes the state does not show (packed fp4 codes), from the matched model
            saved = read_optimizer(state_dict, missing)
        ledger = part.state.get("ledger", {}) if part is not None else {}
        prefix = f"opt{part.index if part is not None else i}"
        rows = [_param_row(i, p, f"{prefix}.{p.index}", names[i][p.index], s0, ledger.get(f"{prefix}.{p.index}"))
                for p in saved.params]
        betas = saved.groups[0].get("betas") if saved.groups else None
        reports.append(OptimizerReport(i, saved.family, len(saved.idents),
                                       [float(b) for b in betas] if betas is not None else None, rows,
                                       _monitor_summary(part), saved.compensated))
    return Report(str(path), checkpoint.kind, checkpoint.step, s0, names_note, reports, list(checkpoint.notes))


def _param_row(optimizer: int, saved: SavedParam, unit: str, name: str, s0: float,
               monitor: dict[str, Any] | None) -> ParamRow:
    """Measure every slot of one saved parameter; ``monitor`` is its row in the saved monitor's ledger."""
    from lightning_stale.adapters.saved_state import grid_end_masks
    from lightning_stale.decide import slot_theory

    zeros = [slot.zero_mask().reshape(-1).cpu() for slot in saved.slots]
    by_moment = {}
    for slot, zero in zip(saved.slots, zeros):
        by_moment.setdefault(slot.moment, zero)  # the first of each moment (AdEMAMix's fast m)
    rows = []
    for slot, zero in zip(saved.slots, zeros):
        other = by_moment.get("m" if slot.moment == "v" else "v")
        lone = _share(zero & ~other) if other is not None and other.numel() == zero.numel() else None
        ends = grid_end_masks(slot)
        rho, source, needs_estimate = slot_theory.closed_form_rho(slot)
        if needs_estimate:
            rho = slot_theory.estimate_rho(slot, unit)
            source = source if rho is not None else f"{source}: no non-zero value to estimate from"
        k_star, note = slot_theory.reset_period(rho, slot.beta, s0)
        rows.append(MomentRow(slot.moment, slot.key, slot.format, slot.beta, zero.numel(), _share(zero), lone,
                              _share(ends[0]) if ends else None, _share(ends[1]) if ends else None, rho, source,
                              k_star, note))
    fields = None
    if monitor is not None:
        from lightning_stale.decide.remedies import REMEDIES

        fields = {key: _finite(value) for key, value in monitor.items()}
        fields["period"] = None if fields.get("period") is None or fields["period"] < 0 else fields["period"]
        remedy = fields.get("remedy")
        fields["remedy"] = REMEDIES[remedy] if isinstance(remedy, int) and 0 <= remedy < len(REMEDIES) else remedy
    return ParamRow(optimizer, saved.index, unit, name, list(saved.shape) if saved.shape is not None else None,
                    saved.step, rows, fields)


def _share(mask: Any) -> float:
    return float(mask.float().mean()) if mask.numel() else 0.0


def _monitor_summary(part: MonitorPart | None) -> dict[str, Any] | None:
    if part is None:
        return None
    interventions = part.state.get("interventions", {})
    return {"source": part.source, "policy": part.policy, "steps": part.state.get("steps"),
            "reset_events": interventions.get("resets"), "remedy_resets": interventions.get("remedy_resets")}


def _names(checkpoint: Checkpoint,
           optimizers: list[SavedOptimizer]) -> tuple[list[list[str]], str, list[list[tuple[int, ...] | None]]]:
    """Each parameter's name by optimizer and position, where they come from, and the matched model shapes.

    A state dict keyed by names (a distributed checkpoint's) names its parameters itself. Otherwise a model's tensor
    order is trusted only when it lists exactly the optimizers' parameters, in their order, with the shapes their
    states show; else parameters are shown by position."""
    positional = [[f"param {j}" if len(optimizers) == 1 else f"opt{i} param {j}" for j in range(len(o.idents))]
                  for i, o in enumerate(optimizers)]
    no_shapes = [[None] * len(o.idents) for o in optimizers]
    if all(isinstance(ident, str) for o in optimizers for ident in o.idents):
        return [[str(ident) for ident in o.idents] for o in optimizers], "the optimizer state's own keys", no_shapes
    if not checkpoint.orders:
        return positional, "by position (no model weights in the checkpoint to match names with)", no_shapes
    reasons = []
    for source, order in checkpoint.orders:
        reason = _mismatch(order, optimizers)
        if reason is None:
            names, shapes, start = [], [], 0
            for o in optimizers:
                chunk = order[start:start + len(o.idents)]
                names.append([name for name, _ in chunk])
                shapes.append([shape for _, shape in chunk])
                start += len(o.idents)
            return names, f"{source}, matched by order and shape", shapes
        reasons.append(f"{source}: {reason}")
    return positional, f"by position (not matched with confidence: {'; '.join(reasons)})", no_shapes


def _mismatch(order: list[tuple[str, tuple[int, ...]]], optimizers: list[SavedOptimizer]) -> str | None:
    """Why ``order`` cannot name the optimizers' parameters in sequence, or None when it can."""
    total = sum(len(o.idents) for o in optimizers)
    if len(order) != total:
        return f"{len(order)} tensors for {total} optimizer parameters"
    start = 0
    for o in optimizers:
        for p in o.params:
            name, shape = order[start + p.index]
            if p.shape is not None and tuple(p.shape) != tuple(shape):
                return f"{name} has shape {tuple(shape)}, parameter {p.index}'s state {tuple(p.shape)}"
            if p.shape is None and not 0 <= p.slots[0].numel - math.prod(shape) <= 1:  # packed fp4: one padding code
                return f"{name} has {math.prod(shape)} elements, parameter {p.index}'s state {p.slots[0].numel}"
        start += len(o.idents)
    return None


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


# -- the table -------------------------------------------------------------------------------------------------------
COLUMNS = ("parameter", "moment", "format", "elements", "zero", "lone zero", "bottom", "top", "rho-hat", "K*", "step")
MONITOR_COLUMNS = ("live rho", "since reset", "period", "resets", "remedy")


def render(report: Report, top: int = 20) -> list[str]:
    """The printed report: what was read, then one row per moment of the ``top`` riskiest parameters."""
    steps = sorted({p.step for o in report.optimizers for p in o.params if p.step is not None})
    lines = [f"lightning-stale inspect: {report.path}",
             f"  {report.kind}" + (f", global step {report.step:,}" if report.step is not None else "")]
    for o in report.optimizers:
        with_state = len(o.params)
        betas = f", betas {tuple(o.betas)}" if o.betas else ""
        own = sorted({p.step for p in o.params if p.step is not None})
        step = f", state step{'s' if len(own) > 1 else ''} {_range(own)}" if own else ""
        family = "QuantizedAdamW (lightning_stale)" if o.family == "lightning_stale" else o.family
        lines.append(f"  optimizer {o.index}: {family}, {o.parameters} parameters ({with_state} with state){step}"
                     f"{betas}")
        if o.compensated:
            lines.append(f"    weight write-back: compensation buffers for {o.compensated} parameter(s)")
        if o.monitor is not None:
            m = o.monitor
            policy = "no reset policy" if m["policy"] in (None, "None") else f"policy {m['policy']}"
            lines.append(f"    monitor state ({m['source']}): {policy}, {m['steps']} steps, {m['reset_events']} reset "
                         f"events, {m['remedy_resets']} remedy resets")
    lines.append(f"  names: {report.names}")
    lines += [f"  note: {note}" for note in report.notes]
    if steps:
        lines.append(f"  rho-hat and K* (s0 = {report.s0:g}) from the states as saved at step "
                     f"{_range(steps)}: grid estimates move while the states settle")
    params = sorted((p for o in report.optimizers for p in o.params), key=lambda p: p.risk, reverse=True)
    shown = params if top == 0 else params[:top]
    monitor = any(p.monitor is not None for p in params)
    header = COLUMNS + (MONITOR_COLUMNS if monitor else ())
    table = [[_cell(p, m, column, first) for column in header]
             for p in shown for first, m in zip([True] + [False] * len(p.moments), p.moments)]
    widths = [max(len(column), *(len(row[k]) for row in table)) for k, column in enumerate(header)]
    lines += ["", f"parameters by risk ({RISK_ORDER})" + (f", {len(shown)} of {len(params)} (--top 0 for all)"
                                                          if len(shown) < len(params) else ""), ""]
    lines += [_line(header, widths), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    lines += [_line(row, widths) for row in table]
    lines += ["", ("zero: stored as exactly zero; lone zero: zero while the other moment is not (v: the underflow "
                   "precondition, m / eps blows up);"),
              ("bottom / top: at the smallest non-zero / the largest magnitude of the grid (per block where scaled); "
               "step: the state's own step counter"),
              *(["live rho (of v, else m), since reset, period, resets, remedy: the monitor's saved state"]
                if monitor else [])]
    return lines


def _line(cells: Sequence[str], widths: list[int]) -> str:
    """Text columns left-aligned, numbers right-aligned."""
    return "  ".join(c.ljust(w) if k < 3 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths))).rstrip()


def _range(values: list[int]) -> str:
    return f"{values[0]:,}" if len(values) == 1 else f"{values[0]:,} to {values[-1]:,}"


def _cell(p: ParamRow, m: MomentRow, column: str, first: bool) -> str:
    monitor = p.monitor or {}
    values = {
        "parameter": _short(p.name) if first else "",
        "moment": f"{m.moment} {m.key}",
        "format": m.format,
        "elements": f"{m.elements:,}",
        "zero": _percent(m.zero),
        "lone zero": _percent(m.lone_zero),
        "bottom": _percent(m.bottom),
        "top": _percent(m.top),
        "rho-hat": "-" if m.rho is None else f"{m.rho:.3g}",
        "K*": "-" if m.k_star is None else f"{m.k_star:,}",
        "step": "" if not first else "-" if p.step is None else f"{p.step:,}",
        "live rho": ("-" if monitor.get("rho") is None else f"{monitor['rho']:.3g}") if first else "",
        "since reset": _number(monitor.get("age")) if first else "",
        "period": _number(monitor.get("period")) if first else "",
        "resets": _number(monitor.get("resets")) if first else "",
        "remedy": str(monitor.get("remedy", "-")) if first and p.monitor is not None else "",
    }
    return values[column]


def _short(name: str, width: int = 44) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]


def _number(value: Any) -> str:
    return "-" if value is None else f"{int(value):,}"


def _percent(share: float | None) -> str:
    if share is None:
        return "-"
    if share == 0:
        return "0"
    return "<0.01%" if share < 1e-4 else f"{share:.2%}"


# -- the figure ------------------------------------------------------------------------------------------------------
def plot_report(report: Report, path: str) -> None:
    """rho-hat, the zero and underflow shares of v and the shares next to zero of every parameter, in optimizer order
    (layer order), one panel each; the file type follows ``path``'s extension."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = [p for o in report.optimizers for p in o.params]
    formats = sorted({m.format for p in params for m in p.moments})
    colour = {fmt: plt.get_cmap("tab10")(k % 10) for k, fmt in enumerate(formats)}
    marker = {"v": "o", "m": "s"}
    fig, (ax_rho, ax_zero, ax_ends) = plt.subplots(3, 1, figsize=(min(30.0, max(9.0, 0.3 * len(params) + 4)), 9),
                                                   sharex=True)
    for k, p in enumerate(params):
        for m in p.moments:
            if m.rho is not None:
                ax_rho.scatter(k, m.rho, marker=marker.get(m.moment, "^"), edgecolors=[colour[m.format]],
                               facecolors="none" if m.moment == "m" else [colour[m.format]], zorder=3)
    ax_rho.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax_rho.set_yscale("log")
    ax_rho.set_ylabel("rho-hat")
    ax_rho.set_title(f"{report.path}: {report.kind}" + (f", step {report.step:,}" if report.step is not None else "")
                     + "\nrho-hat >= 1: most updates stall (filled: v, open: m)", fontsize=10)
    handles = [plt.Line2D([], [], color=colour[f], marker="o", linestyle="", label=f) for f in formats]
    ax_rho.legend(handles=handles, fontsize=8, loc="best")
    width = 0.4
    x = range(len(params))
    for ax, (left, right) in ((ax_zero, (("v", "zero", "v stored as zero", "tab:blue"),
                                         ("v", "lone_zero", "v zero while m is not (underflow)", "tab:red"))),
                              (ax_ends, (("v", "bottom", "v", "tab:purple"), ("m", "bottom", "m", "tab:olive")))):
        for offset, (moment, attribute, label, colour_of) in ((-width / 2, left), (width / 2, right)):
            rows = [next((m for m in p.moments if m.moment == moment), None) for p in params]
            ax.bar([k + offset for k in x], [100 * (getattr(r, attribute) or 0) if r else 0 for r in rows], width,
                   label=label, color=colour_of)
        ax.set_yscale("symlog", linthresh=0.01)  # shares from 0.01% to 100% on one axis, zero included
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of elements")
        ax.legend(fontsize=8, loc="best")
    ax_ends.set_title("stored at the grid's smallest non-zero magnitude (the next step down is zero)", fontsize=9)
    step = max(1, len(params) // 60)  # at most about 60 labels
    ax_ends.set_xticks(list(x)[::step])
    ax_ends.set_xticklabels([_short(p.name, 32) for p in params][::step], rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
