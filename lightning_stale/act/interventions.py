"""Interventions: everything the monitor changes in one optimizer's state or step, on the decisions of the policy and
the remedy: resets (announced to listeners as a :class:`ResetEvent`), the underflow guard (everywhere, or inside
guard windows), the post-reset warm-up, and the remedy's choices (guard windows, stochastic rounding, resets).

Every change to optimizer state is made in place by the adapter or the guard; the bookkeeping goes through the
ledger's mutators.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_stale.act import guard
from lightning_stale.act.writeback import WeightWriteBack
from lightning_stale.adapters.protocol import OptimizerAdapter, Slot
from lightning_stale.decide.ledger import Ledger, LedgerRow
from lightning_stale.decide.remedies import GUARD, GUARD_CHECKS, NONE, RESET, STOCHASTIC, Remedy
from lightning_stale.measure.engine import StallEngine
from lightning_stale.messages import info

UNDERFLOW_FREE = ("fp32", "fp64")  # v formats the guard skips (see Interventions.guard)
POST_RESET_GUARD_STEPS = 30  # steps after a reset during which the underflow guard protects the reset parameters
REBIND_REFRESHES = 2  # a reset may replace state now or at the next step: compare slots before and after it


@dataclass(frozen=True)
class ResetEvent:
    """What a reset listener receives: ``step``, the monitor's count of real optimizer steps after which the reset
    ran (skipped steps excluded; counted from ``steps_taken`` when the monitor attached, restored from its checkpoint
    on resume); the ``optimizer``; the ``slots`` (parameter x moment) that were reset."""

    step: int
    optimizer: torch.optim.Optimizer
    slots: list[Slot]

    @property
    def params(self) -> list[Tensor]:
        """The parameters whose state was reset, each once, in slot order."""
        return list({id(s.param): s.param for s in self.slots}.values())


ResetListener = Callable[[ResetEvent], None]


class ListenerError(RuntimeError):
    """A reset listener raised: the user's code, not the monitor's, so the error is not swallowed."""


class Interventions:
    """Resets, guard, warm-up and remedy actions for one optimizer.

    Args:
        adapter, engine, ledger: the optimizer's components (the engine's drift shadows restart with a reset).
        underflow_guard: guard every parameter after every step (else only inside guard windows).
        warmup_steps: post-reset warm-up length (0: none).
        exact_v_reset: use the adapter's exact (unbounded) per-moment reset.
        listeners: called with every :class:`ResetEvent` (the monitor's list: later additions are seen).
        name: a parameter's readable name, for messages.
    """

    def __init__(self, adapter: OptimizerAdapter, engine: StallEngine, ledger: Ledger, *,
                 underflow_guard: bool, warmup_steps: int, exact_v_reset: bool, listeners: list[ResetListener],
                 name: Callable[[LedgerRow], str]) -> None:
        self.adapter, self.engine, self.ledger = adapter, engine, ledger
        self.underflow_guard, self.warmup_steps, self.exact_v_reset = underflow_guard, warmup_steps, exact_v_reset
        self.listeners, self._name = listeners, name
        self.resets = 0  # reset events
        self.remedy_resets = 0  # parameter resets the remedy made
        # (engine version and guarded positions, the plan or None where no v can underflow)
        self._guard_plan: tuple[tuple, guard.GuardPlan | None] | None = None
        self._warming: dict[int, Tensor] = {}  # parameters before a warm-up step

    # -- every step --------------------------------------------------------------------------------------------------
    def before_step(self) -> None:
        """Keep the parameters inside a post-reset warm-up as they are before the step."""
        if self.ledger.warming_any:
            self._warming = {u.position: u.param.detach().clone() for u in self.ledger.warming()}

    def warm_up(self) -> None:
        """Scale this step's update of recently reset parameters: p = p_old + (i / warmup_steps) * (p - p_old)."""
        for position, old in self._warming.items():
            factor = self.ledger.use_warmup_step(position, self.warmup_steps)
            with torch.no_grad():
                self.ledger.rows[position].param.lerp_(old, 1.0 - factor)
        self._warming = {}

    def guard(self) -> None:
        """Run the underflow guard on every parameter, or on those inside a guard window, through a plan kept while
        the guarded set and the slots stay. Parameters whose v is stored in fp32 (or fp64) are left out: there v
        reads zero only where ``(1 - b2) * g**2`` is below 1e-45, so the guard would only cost time."""
        if self.underflow_guard:  # every parameter: the plan holds while the slots stay
            units, key = self.ledger.rows, (self.engine.version, None)
        elif self.ledger.guarding:
            units = self.ledger.use_guard_step()
            key = (self.engine.version, tuple(u.position for u in units))
        else:
            return
        if self._guard_plan is None or self._guard_plan[0] != key:
            units = [u for u in units if any(s.moment == "v" and s.format not in UNDERFLOW_FREE for s in u.slots)]
            self._guard_plan = (key, guard.GuardPlan(s for unit in units for s in unit.slots) if units else None)
        if self._guard_plan[1] is not None:
            self._guard_plan[1].run()

    # -- decisions ---------------------------------------------------------------------------------------------------
    def reset(self, units: list[LedgerRow], moments: Sequence[str], step: int) -> None:
        """Reset ``moments`` of ``units`` in place after optimizer step ``step``, and tell the listeners."""
        reset = self.adapter.reset_exact if self.exact_v_reset else self.adapter.reset
        reset(moments=moments, params=[u.param for u in units])
        self.engine.resync([u.position for u in units], tuple(moments))
        self.engine.invalidate(watch=REBIND_REFRESHES)
        slots = [s for u in units for s in u.slots if s.moment in moments]
        self.ledger.record_reset(units, step, self.warmup_steps, POST_RESET_GUARD_STEPS)
        self.resets += 1
        event = ResetEvent(step, self.adapter.optimizer, slots)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception as error:
                name = getattr(listener, "__qualname__", repr(listener))
                raise ListenerError(f"the reset listener {name} raised {type(error).__name__}: {error} (listeners "
                                    "are called with one argument, a ResetEvent)") from error

    def foresee(self, remedy: Remedy, units: list[LedgerRow], step: int,
                writeback: WeightWriteBack | None = None) -> None:
        """Before any measurement: the parameters whose v the remedy's theory expects to drift go to stochastic
        rounding from the next step, where the optimizer has it; where it has not, those whose moments the weight
        ``writeback`` computes (it took them over) already have it, and the others get it from the step it takes them
        over. Every choice is reported with its reason."""
        roundings = self.adapter.roundings(u.param for u in units)
        betas = [None if u.driver() is None else u.driver().beta for u in units]
        reasons = {u.position: why for u, beta, rounding in zip(units, betas, roundings)
                   if (why := remedy.foresee(u.rho, beta, rounding)) is not None}
        if not reasons:
            return
        ledger = self.ledger
        chosen = [ledger.rows[i] for i in reasons]
        by_reason = ", ".join(f"{why} x{n}" for why, n in Counter(reasons.values()).items())
        if self.adapter.use_stochastic_rounding(u.param for u in chosen):
            self._set_stochastic([u.position for u in chosen])
            info(f"[lightning_stale] remedy: stochastic rounding from step {step + 1} for {len(chosen)} parameter(s) "
                 f"(e.g. {self._name(chosen[0])!r}): {by_reason}")
            return
        name = type(self.adapter.optimizer).__name__
        if writeback is None or writeback.moments != "stochastic":
            info(f"[lightning_stale] remedy: {len(chosen)} parameter(s) (e.g. {self._name(chosen[0])!r}): {by_reason};"
                 f" {name} cannot round stochastically: the measured drift decides")
            return
        taken = [u for u in chosen if ledger.arrays["weights"][u.position]]
        waiting = [u for u in chosen if not ledger.arrays["weights"][u.position]]
        self._set_stochastic([u.position for u in taken])
        said = f"[lightning_stale] remedy: {len(chosen)} parameter(s) (e.g. {self._name(chosen[0])!r}): {by_reason}; "
        if taken:
            said += (f"{len(taken)} of them have stochastic rounding of their moments from the weight write-back, "
                     "which took them over")
        if waiting:
            said += ("; " if taken else "") + (
                f"{name} rounds the moments of {len(waiting)} to nearest: the weight write-back rounds them "
                "stochastically from the step it takes them over (where their weights stall), the measured drift "
                "decides until then")
        info(said)

    def _set_stochastic(self, positions: list[int]) -> None:
        """Record stochastic rounding as the remedy of the parameters at ``positions`` (the guard, if on, stays)."""
        choice = self.ledger.arrays["remedy"].copy()
        rows = np.asarray(positions, dtype=np.int64)
        choice[rows[choice[rows] != GUARD]] = STOCHASTIC
        self.ledger.set_remedy(choice)

    def keep_guarding(self, check_every: int) -> None:
        """After a check step's readings: a parameter inside a guard window whose v still underflows keeps the guard
        until the next checks. A reset restarts v from zero, and under one scale per tensor the small elements of a
        young v round to zero and, with nearest rounding, stay there: the guard must outlast them, not a fixed
        window."""
        ledger = self.ledger
        with np.errstate(invalid="ignore"):  # nan: no reading
            rows = np.flatnonzero((ledger.arrays["guard_left"] > 0) & (ledger.arrays["underflow"] > 0))
        ledger.open_guard(rows, GUARD_CHECKS * check_every)

    def apply_remedy(self, remedy: Remedy, step: int, check_every: int) -> None:
        """Apply the remedy's choice after a check step: open (or extend) guard windows; for drifted parameters switch
        to stochastic rounding where the optimizer has it (once), else reset them."""
        ledger = self.ledger
        previous = ledger.arrays["remedy"]
        chosen = remedy.choose(ledger)
        # Both switches are for good: a parameter whose v underflowed once stays guarded (its window is re-armed at
        # every check), and stochastic rounding stays on; only a new cause (drift, underflow) changes the choice.
        chosen[(chosen == NONE) & (previous == GUARD)] = GUARD
        chosen[(previous == STOCHASTIC) & (chosen != GUARD)] = STOCHASTIC
        drifted = np.flatnonzero(chosen == RESET)
        if drifted.size and self.adapter.use_stochastic_rounding([ledger.rows[i].param for i in drifted]):
            chosen[drifted] = STOCHASTIC
            first = ledger.rows[drifted[0]]
            info(f"[lightning_stale] remedy: stochastic rounding from step {step + 1} for {drifted.size} parameter(s) "
                 f"whose stored v {remedy.describe_drift()} (e.g. {self._name(first)!r}: {first.drift:.2f})")
        guard_rows = np.flatnonzero(chosen == GUARD)
        for i in guard_rows[previous[guard_rows] != GUARD]:
            unit = ledger.rows[i]
            info(f"[lightning_stale] remedy: underflow guard on for {self._name(unit)!r} (v stored as zero for "
                 f"{100 * unit.underflow:.2g}% of its sampled elements with a non-zero gradient)")
        ledger.open_guard(guard_rows, GUARD_CHECKS * check_every)
        ledger.set_remedy(chosen)
        reset_rows = np.flatnonzero(chosen == RESET)
        if reset_rows.size:
            units = [ledger.rows[i] for i in reset_rows]
            info(f"[lightning_stale] remedy: reset {len(units)} parameter(s) whose stored v {remedy.describe_drift()} "
                 f"(e.g. {self._name(units[0])!r}: {units[0].drift:.2f}) at step {step}")
            self.remedy_resets += len(units)
            self.reset(units, remedy.moments, step)

    def take_over_weights(self, writeback: WeightWriteBack, rows: np.ndarray, why: list[str], step: int) -> None:
        """The automatic remedy's weight switch: the write-back takes over the weight write of the parameters at
        ``rows`` (``why``: each one's reason) from the next step on, for good."""
        if not rows.size:
            return
        units = [self.ledger.rows[i] for i in rows]
        writeback.take_over(u.param for u in units)
        self.ledger.set_weights(rows)
        if writeback.moments == "stochastic":  # the write-back computes their moments too, rounded stochastically
            self._set_stochastic(list(rows))
        how = writeback.describe()
        info(f"[lightning_stale] remedy: weight write-back with {how} from step {step + 1} for "
             f"{len(units)} parameter(s) whose stored weights stall (e.g. {self._name(units[0])!r}: {why[0]})")

    def resident_bytes(self) -> int:
        """Bytes kept between steps: the guard plan's buffers."""
        plan = self._guard_plan[1] if self._guard_plan is not None else None
        return sum(t.numel() * t.element_size() for t in plan.tensors()) if plan is not None else 0

    def add_counts(self, resets: int, remedy_resets: int) -> None:
        """Count an earlier run's resets as this one's (the counters of a later fit go on)."""
        self.resets += resets
        self.remedy_resets += remedy_resets

    # -- checkpointing -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"resets": self.resets, "remedy_resets": self.remedy_resets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resets, self.remedy_resets = int(state.get("resets", 0)), int(state.get("remedy_resets", 0))
