"""The fit-start report: what the monitor found on one optimizer (family, state formats, tracking, policy, periods),
built from values the monitor already has; formatting only, no collective."""

from __future__ import annotations

from collections import Counter

import numpy as np

from lightning_stale.adapters.layouts import BlockFp8Slot
from lightning_stale.adapters.protocol import OptimizerAdapter, Slot
from lightning_stale.decide.ledger import Ledger
from lightning_stale.decide.lr_outlook import below_from
from lightning_stale.decide.policies import ResetPolicy
from lightning_stale.decide.remedies import Remedy
from lightning_stale.measure.engine import StallEngine
from lightning_stale.vocab import WEIGHT


def fit_start_report(adapter: OptimizerAdapter, engine: StallEngine, ledger: Ledger, pending: set[int],
                     policy: ResetPolicy | None, remedy: Remedy | None, track_every: int, mixed: list[str]) -> str:
    """Formats (parameters and elements each), tracking, periods, and ``mixed``: the parameters whose low-precision
    state fell back to fp32 on some ranks only (optimizers apply their size threshold to the local shard)."""
    params: Counter[str] = Counter()
    elements: Counter[str] = Counter()
    for unit in ledger.rows:
        for slot in unit.slots:
            what = (f"weights {slot.format}" if slot.moment == WEIGHT else
                    f"{slot.moment} {slot.format} (beta={slot.beta})")
            params[what] += 1
            elements[what] += slot.numel
    remedy_text = f"; remedy: {remedy!r}" if remedy is not None else ""
    tracking = "exact" if engine.exact else (f"sample ({engine.sample_size} elements, "
                                            f"{len(engine.cohorts[0]) if engine.cohorts else 0} parameters per step)")
    lines = [f"[lightning_stale] {adapter.describe()}; policy: {policy!r}{remedy_text}; tracking: {tracking} every "
             f"{track_every} step(s)",
             "[lightning_stale] state formats (parameters, elements on this rank): "
             + ", ".join(f"{k} x{params[k]} ({elements[k]:,})" for k in params)]
    if mixed:
        lines.append(f"[lightning_stale] {len(mixed)} parameter(s) have low-precision states on some ranks and fp32 on "
                     f"others (the optimizer's size threshold applies to local shards): "
                     + ", ".join(mixed[:5]) + (" ..." if len(mixed) > 5 else ""))
    waiting = {i for i in pending if ledger.rows[i].rho is None}
    periods = period_report(ledger, policy, exclude=waiting)
    if periods:
        lines.append(periods)
    trapped = [u for u in ledger.rows if any(zero_trapping(s) for s in u.slots)]
    if policy is not None and "m" in policy.moments and trapped:
        lines.append(f"[lightning_stale] note: {len(trapped)} parameter(s) keep v in fp8 with one scale per tensor, "
                     "where a reset of both moments restarts v from zero and nearest rounding keeps its small lanes "
                     "there: it cost loss in BENCHMARKS.md (benchmarks/reset_zeros.py, the long plan). "
                     "moments=('v',) restarts v without zeros; remedy='auto' does not reset them")
    if pending:
        lines.append(f"[lightning_stale] {len(pending)} parameter(s) get their rho-hat (and period) from their stored "
                     "values at check steps, final once their state has settled")
    return "\n".join(lines)


def weight_report(formats: list[str], past: list[float], stop_lrs: list[float], lr: float | None, basis: str,
                  path: np.ndarray | None = None, step: int = 0, every: int = 1) -> str:
    """One line per format of stored weights: the share of their sampled elements past the threshold at ``lr``, the
    lr they will train at (``basis``: which lr that is, in words; None: none to judge at), where an update of about lr
    rounds away, and the median learning rate below which a parameter's weights stop moving (the median over
    parameters of each one's median half grid gap); with their group's lr ``path`` from the scheduler (item k: the lr
    of optimizer step ``step + k * every``), the step from which it stays below that."""
    lines = []
    for fmt in dict.fromkeys(formats):
        rows = [i for i, f in enumerate(formats) if f == fmt]
        share = sum(past[i] for i in rows) / len(rows)
        known = sorted(stop_lrs[i] for i in rows if stop_lrs[i] == stop_lrs[i])  # nan: an empty shard here
        stop = known[len(known) // 2] if known else float("nan")
        judged = (f"{basis}: no share past the threshold is judged at lr 0" if lr is None else
                  f"at lr {lr:.3g} ({basis}) {share:.0%} of their elements are past the threshold where an update of "
                  "about lr rounds away (nearest rounding)")
        line = (f"[lightning_stale] {fmt} weights ({len(rows)} parameter(s)): {judged}; a parameter's median weight "
                f"stops moving below lr {stop:.3g} (median over parameters)")
        if path is not None and stop == stop:
            below = below_from(path, stop)
            line += (f"; the lr schedule stays below it from step {step + below * every}" if below is not None else
                     f"; the lr schedule is not below it by step {step + (len(path) - 1) * every}")
        lines.append(line)
    return "\n".join(lines)


def period_report(ledger: Ledger, policy: ResetPolicy | None, exclude: set[int] | None = None,
                  only: set[int] | None = None, title: str = "reset periods") -> str:
    """One line counting the reset periods the policy chose (and why), over the parameters in ``only`` (default:
    all) less those in ``exclude``; empty without a policy."""
    periods: Counter[str] = Counter()
    for unit in ledger.rows:
        chosen = (only is None or unit.position in only) and unit.position not in (exclude or ())
        if policy is not None and chosen and unit.period_source:
            periods[f"{unit.period} ({unit.period_source})"] += 1
    return f"[lightning_stale] {title}: " + ", ".join(f"{k} x{n}" for k, n in periods.items()) if periods else ""


def zero_trapping(slot: Slot) -> bool:
    """Whether a reset of ``slot`` to zero can trap small lanes at zero: a second moment in fp8 with one scale for the
    whole tensor, whose smallest step then sits far above the tensor's small elements' updates."""
    return slot.moment == "v" and isinstance(slot, BlockFp8Slot) and slot.block_size >= slot.numel
