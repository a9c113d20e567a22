"""``lightning-stale inspect``: how stale the optimizer states of a saved checkpoint are, without re-running anything.

The checkpoint is read by :mod:`lightning_stale.adapters.saved_state` with the live adapters' slot classes, and each
stored moment of each parameter is measured as the live monitor sees it: its format, the share stored as exact zero and
as zero while the other moment is not (for v, the underflow precondition), the share at the ends of its grid, rho-hat
(the closed form for float formats, else ``slot_theory.estimate_rho`` on the sample the live monitor reads, from the
same unit key) and K* (``slot_theory.reset_period``). Where the checkpoint holds the model's bf16/fp16 weights, each
one's stall: the share of its elements whose next update, from the saved moments at the saved lr, is under half its
grid gap (``weight_theory.predicted_stall``). Per parameter, the remedy the checkpoint carries: the weight write-back
(the monitor's saved write-back state, else a compensation buffer holding a residual) and the remedy's choice. The
monitor's own saved state, when the checkpoint has one, adds each parameter's steps since its last reset, period and
resets. The optimizer's class comes from its saved param groups. Output: a table (riskiest parameters first) with a
legend in plain words, JSON, and a per-parameter figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_stale.adapters.saved_state import Checkpoint, MonitorPart, SavedOptimizer, SavedParam

HELP = ("Report how stale the optimizer states saved in a checkpoint are, per parameter and moment: a table, JSON or "
        "a figure.")
RISK_ORDER = "v underflow share, then rho-hat, largest first"
WEIGHT_SAMPLE = 1 << 20  # weight elements read per parameter at most for the weight-stall share


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a Lightning .ckpt, a torch.save'd dict or optimizer state_dict, LitGPT's "
                                     "lit_model.pth (or its folder), a Hugging Face checkpoint folder (optimizer.pt), "
                                     "a distributed checkpoint folder (.metadata) or a folder holding one checkpoint "
                                     "file")
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
class WeightRow:
    """A parameter's stored weights where the checkpoint holds them in bf16/fp16: the share of its elements whose next
    update (from the saved moments, at the saved lr) is under half their grid gap, so nearest rounding keeps them."""

    format: str
    elements: int
    lr: float | None
    stall: float | None  # None where it cannot be predicted (no Adam-like moments)
    counted: int  # elements the share is over (those with a non-zero m)


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
    remedy: str | None = None  # what the checkpoint carries for it (the write-back, the remedy's choice); None: unknown
    weight: WeightRow | None = None

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
    compensated: int = 0  # parameters with a compensation buffer of the weight write-back
    name: str = ""  # the optimizer's class, as far as the checkpoint tells it
    lrs: list[float] = field(default_factory=list)  # each param group's saved lr


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
    matched = not names_note.startswith("by position")
    reports = []
    for i, (state_dict, saved, part) in enumerate(zip(checkpoint.optimizers, optimizers, checkpoint.monitors or
                                                      [None] * len(optimizers))):
        missing = {p.index: shapes[i][p.index] for p in saved.params if p.shape is None and shapes[i][p.index]}
        if missing:  # shapes the state does not show (packed fp4 codes), from the matched model
            saved = read_optimizer(state_dict, missing)
        ledger = part.state.get("ledger", {}) if part is not None else {}
        writeback = part.state.get("weights") if part is not None else None
        prefix = f"opt{part.index if part is not None else i}"
        groups = [group for group in saved.groups for _ in group.get("params", [])]  # each position's group
        name = _named(saved.name, saved.family, checkpoint.optimizer_name)
        # AdamW's decoupled decay unless a group says otherwise or the class is Adam (where the state cannot tell
        # the two apart, as on torch 2.6, the common AdamW)
        decoupled = name.startswith(("AdamW", "Adam or AdamW")) or saved.family == "lightning_stale"
        rows = []
        for p in saved.params:
            unit = f"{prefix}.{p.index}"
            row = _param_row(i, p, unit, names[i][p.index], s0, ledger.get(unit))
            weight = checkpoint.weights.get(names[i][p.index]) if matched else None
            row.weight = _weight_row(p, weight, groups[p.index], unit, decoupled)
            row.remedy = _remedy(p, row.monitor, writeback, weight)
            rows.append(row)
        betas = saved.groups[0].get("betas") if saved.groups else None
        reports.append(OptimizerReport(i, saved.family, len(saved.idents),
                                       [float(b) for b in betas] if betas is not None else None, rows,
                                       _monitor_summary(part), saved.compensated, name,
                                       [float(g["lr"]) for g in saved.groups if "lr" in g]))
    notes = list(checkpoint.notes)
    if not checkpoint.weights:
        notes.append("the checkpoint holds no model weights: no weight-stall figures (w stall)")
    return Report(str(path), checkpoint.kind, checkpoint.step, s0, names_note, reports, notes)


def _named(name: str, family: str, configured: str | None) -> str:
    """The optimizer's class: from its saved state, unless that leaves candidates ("Adam or AdamW") and the run's
    configuration names one of the same family (LitGPT's bare names are torch.optim classes). A configuration of
    another family is not trusted: LitGPT writes it from the command line, which a script calling it does not use."""
    if configured is None or " or " not in name:
        return name
    module, _, short = configured.rpartition(".")
    root = (module or "torch.optim").split(".")[0]
    if {"torch": "torch.optim", "bitsandbytes": "bitsandbytes", "torchao": "torchao",
            "lightning_stale": "lightning_stale"}.get(root) != family or short not in name.replace(",", " ").split():
        return name
    return f"{short} ({family}, as hyperparameters.yaml names it)"


def _weight_row(saved: SavedParam, weight: Any, group: Mapping[str, Any], unit: str,
                decoupled: bool) -> WeightRow | None:
    """The weight-stall share of a parameter whose bf16/fp16 weights the checkpoint holds: its next update from the
    saved moments and group (``weight_theory.predicted_stall``, nearest rounding) on a sample of its elements."""
    import torch

    from lightning_stale.adapters.sampling import choose_sample
    from lightning_stale.decide import weight_theory
    from lightning_stale.measure.units import weight_slot

    if not isinstance(weight, torch.Tensor) or saved.shape is None or tuple(weight.shape) != tuple(saved.shape):
        return None
    slot = weight_slot(weight)
    if slot is None:  # fp32 weights: no update of about lr rounds away
        return None
    lr = float(group["lr"]) if "lr" in group else None
    row = WeightRow(slot.format, weight.numel(), lr, None, 0)
    by_moment: dict[str, Any] = {}
    for state in saved.slots:
        by_moment.setdefault(state.moment, state)
    m, v = by_moment.get("m"), by_moment.get("v")
    if m is None or v is None or v.beta is None or lr is None or "betas" not in group or "eps" not in group:
        return row  # no Adam-like update to predict from
    sample = choose_sample(unit, tuple(weight.shape), None if weight.numel() <= WEIGHT_SAMPLE else WEIGHT_SAMPLE, 0)
    decoupled = bool(group.get("decoupled_weight_decay", decoupled))
    try:
        stalls, counted = weight_theory.predicted_stall(slot, m, v, sample, group, saved.step or 1, decoupled,
                                                        False).tolist()
    except Exception:  # noqa: BLE001 - a layout whose values cannot be read here: no figure
        return row
    row.stall, row.counted = (stalls / counted if counted else None), int(counted)
    return row


def _remedy(saved: SavedParam, monitor: dict[str, Any] | None, writeback: Mapping[str, Any] | None,
            weight: Any) -> str | None:
    """What the checkpoint carries for one parameter, in words: the weight write-back where it took the parameter
    over (the monitor's saved write-back state, else a compensation buffer holding a residual), then the remedy's
    choice (guard, stochastic, reset); "none" where the checkpoint shows nothing was applied; None where it cannot
    tell (no monitor state, no buffer)."""
    import torch

    moments = "nearest"
    if writeback is not None:  # the monitor's own record: the parameters taken over (None: every bf16/fp16 one)
        how, moments = str(writeback.get("rounding", "compensated")), str(writeback.get("moments", "nearest"))
        chosen = writeback.get("params")
        low = saved.compensation is not None or (isinstance(weight, torch.Tensor) and weight.dtype in
                                                 (torch.bfloat16, torch.float16))
        taken = saved.index in chosen if chosen is not None else low
    else:
        how = "compensated"
        taken = saved.compensation is not None and bool(saved.compensation.ne(0).any())
    parts = [f"write-back ({how}{', stochastic moments' if moments == 'stochastic' else ''})"] if taken else []
    chosen_remedy = (monitor or {}).get("remedy")
    if chosen_remedy not in (None, "none") and not (taken and chosen_remedy == "stochastic" and
                                                    moments == "stochastic"):
        parts.append(str(chosen_remedy))
    if parts:
        return " + ".join(parts)
    return "none" if monitor is not None or saved.compensation is not None else None


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
WEIGHT_COLUMNS = ("w stall",)
MONITOR_COLUMNS = ("live rho", "since reset", "period", "resets")
REMEDY_COLUMNS = ("remedy",)


def render(report: Report, top: int = 20) -> list[str]:
    """The printed report: what was read, then one row per moment of the ``top`` riskiest parameters, then what the
    columns mean."""
    steps = sorted({p.step for o in report.optimizers for p in o.params if p.step is not None})
    lines = [f"lightning-stale inspect: {report.path}",
             f"  {report.kind}" + (f", global step {report.step:,}" if report.step is not None else "")]
    for o in report.optimizers:
        with_state = len(o.params)
        betas = f", betas {tuple(o.betas)}" if o.betas else ""
        own = sorted({p.step for p in o.params if p.step is not None})
        step = f", state step{'s' if len(own) > 1 else ''} {_range(own)}" if own else ""
        lrs = sorted(set(o.lrs))
        lr = "" if not lrs else f", lr {lrs[0]:.3g}" if len(lrs) == 1 else f", lr {lrs[0]:.3g} to {lrs[-1]:.3g}"
        lines.append(f"  optimizer {o.index}: {o.name or o.family}, {o.parameters} parameters ({with_state} with "
                     f"state){step}{betas}{lr}")
        if o.compensated:
            taken = sum(1 for p in o.params if p.remedy is not None and p.remedy.startswith("write-back"))
            lines.append(f"    weight write-back: compensation buffers for {o.compensated} parameter(s), {taken} of "
                         "them taken over (remedy column)")
        weights = [p.weight for p in o.params if p.weight is not None]
        if weights:
            kept = sum(1 for p in o.params if p.weight is not None and (p.remedy or "").startswith("write-back"))
            lines.append("    " + _weights_line(weights) + (f"; the write-back writes {kept} of them exactly" if kept
                                                               else ""))
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
    weight = any(p.weight is not None for p in params)
    remedy = any(p.remedy is not None for p in params)
    header = COLUMNS + (WEIGHT_COLUMNS if weight else ()) + (MONITOR_COLUMNS if monitor else ()) + \
        (REMEDY_COLUMNS if remedy else ())
    table = [[_cell(p, m, column, first) for column in header]
             for p in shown for first, m in zip([True] + [False] * len(p.moments), p.moments)]
    widths = [max(len(column), *(len(row[k]) for row in table)) for k, column in enumerate(header)]
    lines += ["", f"parameters by risk ({RISK_ORDER})" + (f", {len(shown)} of {len(params)} (--top 0 for all)"
                                                          if len(shown) < len(params) else ""), ""]
    lines += [_line(header, widths, header), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    lines += [_line(row, widths, header) for row in table]
    return lines + ["", *legend(report.s0, weight, monitor, remedy)]


def _weights_line(weights: list[WeightRow]) -> str:
    """The optimizer's bf16/fp16 weights in one line: how many would not move at the next step."""
    formats = "/".join(sorted({w.format for w in weights}))
    elements = sum(w.elements for w in weights)
    known = [w for w in weights if w.stall is not None and w.counted]
    head = f"{formats} weights: {len(weights)} parameter(s) ({elements:,} elements)"
    if not known:
        return f"{head}; their stall needs Adam-like moments to predict the next update from"
    share = sum(w.stall * w.counted for w in known) / sum(w.counted for w in known)
    lrs = sorted({w.lr for w in known if w.lr is not None})
    at = f"at the saved lr {lrs[0]:.3g}" if len(lrs) == 1 else "at the saved lrs"
    return (f"{head}; {at}, {share:.0%} of their elements would not move at the next step under nearest rounding "
            "(w stall)")


def legend(s0: float, weight: bool, monitor: bool, remedy: bool) -> list[str]:
    """What the columns mean, in plain words."""
    lines = [
        "what the columns mean:",
        "  moment       the optimizer state read: m, the running average of the gradients; v, the running average of "
        "their squares (and its key in the state)",
        "  format       how it is stored (bf16, fp8_e4m3, int8_dynamic: an 8-bit code map with one scale per block, "
        "...)",
        "  zero         share of elements stored as exactly zero",
        "  lone zero    share stored as zero while the other moment is not: for v, m / (sqrt(v) + eps) then turns a "
        "small m into a step of up to lr * m / eps (underflow)",
        "  bottom/top   share at the smallest non-zero / the largest value the grid holds (per block where scaled): "
        "one step from underflow / saturated",
        "  rho-hat      how coarse the storage grid is for this running average: its relative grid gap over what one "
        "step can move it, 2 (1 - beta); at 1 or more, most steps of a settled state change it by less than half a "
        "gap and round back, so it stalls",
        f"  K*           the reset period (steps) the paper's theory gives for that state: after about K* steps the "
        f"stalled share built up since a reset (beyond the tolerance s0 = {s0:g}) outweighs what restarting the "
        "average costs; '-' where rho-hat < 1 (no reset called for) or no theory applies. A prediction, not a "
        "measured gain: `lightning-stale period` says where resets paid in this project's measurements",
        "  step         the state's own step counter",
    ]
    if weight:
        lines.append("  w stall      for weights stored in bf16/fp16: share of elements whose next update, from the "
                     "saved moments at the saved lr, is under half their grid gap (nearest rounding keeps them)")
    if monitor:
        lines.append("  live rho, since reset, period, resets   from the monitor's saved state: rho-hat as the live "
                     "monitor knew it, steps since the parameter's last reset, its reset period, resets so far")
    if remedy:
        lines.append("  remedy       what the checkpoint carries for the parameter: write-back (the weight write-back "
                     "computes its step in fp32 and keeps the weight by compensated summation or stochastic rounding; "
                     "its buffer is in the optimizer state), guard (the underflow guard), stochastic (its moments "
                     "are rounded stochastically), reset (the remedy reset it), none")
    return [wrapped for line in lines for wrapped in textwrap.wrap(line, LEGEND_WIDTH, subsequent_indent=" " * 15)]


LEGEND_WIDTH = 118


TEXT_COLUMNS = ("parameter", "moment", "format", "remedy")


def _line(cells: Sequence[str], widths: list[int], header: Sequence[str]) -> str:
    """Text columns left-aligned, numbers right-aligned."""
    return "  ".join(c.ljust(w) if column in TEXT_COLUMNS else c.rjust(w)
                     for c, w, column in zip(cells, widths, header)).rstrip()


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
        "w stall": ("-" if p.weight is None else _percent(p.weight.stall)) if first else "",
        "remedy": (p.remedy or "-") if first else "",
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
