"""OptimizerPipeline: one watched optimizer's components and its step, in data-flow order: count (engine), align the
bookkeeping (ledger) and the theory (forecast), read the check-step signals, let the policy and the remedy decide,
act (interventions). :class:`~lightning_stale.monitor.StaleStateMonitor` runs one per optimizer from torch's step
hooks and turns their counts into metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lightning_stale.act.interventions import Interventions, ResetListener
from lightning_stale.act.writeback import writeback_for
from lightning_stale.adapters.protocol import OptimizerAdapter
from lightning_stale.decide import weight_theory
from lightning_stale.decide.forecast import StallForecast, to_host
from lightning_stale.decide.ledger import Ledger, LedgerRow, without_periods
from lightning_stale.decide.lr_outlook import LrOutlook, lr_path
from lightning_stale.measure.engine import StallEngine
from lightning_stale.messages import ParamNames, info
from lightning_stale.monitor.announcement import fit_start_report, period_report, weight_report
from lightning_stale.monitor.options import MonitorOptions
from lightning_stale.ranks import Reduce, summed
from lightning_stale.vocab import WEIGHT


class OptimizerPipeline:
    """The components of one optimizer and what runs around its steps.

    Args:
        adapter: reads and resets the optimizer's state.
        index: the optimizer's position among the monitor's (``opt<index>`` names its parameters).
        options: the monitor's options (their policy and remedy objects are shared by every pipeline).
        reduce: sums across ranks (None: a single process).
        names: readable parameter names; ``warn``: one-time warnings; ``listeners``: the monitor's reset listeners.
        coverage_steps: every parameter is measured within this many measured steps; also the check interval.
        steps_taken: optimizer steps taken before the monitor attached.

    The monitor calls :meth:`adopt` once it has loaded any saved state, so that the first look at the optimizer's state
    is the resumed run's.
    """

    def __init__(self, adapter: OptimizerAdapter, index: int, options: MonitorOptions, reduce: Reduce | None,
                 names: ParamNames, warn: Callable[[str, str], None], listeners: list[ResetListener],
                 coverage_steps: int, steps_taken: int) -> None:
        self.adapter, self.options, self.reduce, self._names = adapter, options, reduce, names
        self.policy, self.remedy, self.check_every = options.policy, options.remedy_rule, coverage_steps
        acts = self.remedy is not None or self.policy is not None  # check steps read underflow (they may reset)
        observes = self.policy is not None and self.policy.needs_measurement  # at check steps, step by step
        self.engine = StallEngine(adapter, f"opt{index}", options.track == "exact", options.sample_size,
                                  options.params_per_step, max(1, coverage_steps // options.track_every), options.seed,
                                  acts, observes)
        self.ledger = Ledger()
        self.forecast = StallForecast(reduce, warn, self.name)
        self.interventions = Interventions(adapter, self.engine, self.ledger, underflow_guard=options.underflow_guard,
                                           warmup_steps=options.warmup_steps,
                                           exact_v_reset=options.v_reset == "exact-unbounded", listeners=listeners,
                                           name=self.name)
        # The weight write-back registers its step hooks before the monitor's: its post-step hook gives the gradients
        # back first, and the monitor counts the weights it wrote.
        self.writeback = writeback_for(adapter.optimizer, options.weights, auto=self.remedy is not None)
        self.auto_weights = self.writeback is not None and options.weights is None
        self._warn = warn
        self.steps = steps_taken  # real optimizer steps seen (restored from checkpoints)
        self.window_start = steps_taken  # the step after which the current window began
        self.adopted = -1  # the engine version whose units the ledger holds
        self.announced = False
        self.judge_due = self.weights_due = False  # what the remedy judges at the next step hook
        self.unestimated = False  # parameters adopted since the last step's end may wait for a first estimate
        # (lr scheduler, last step, optimizer steps per scheduler step) that the fit-start weight report follows
        self.schedule: tuple[Any, int, int] | None = None
        self.outlook: LrOutlook | None = None  # its lrs ahead, read at the fit-start report
        self.check_lrs: list[float] | None = None  # each group's lr at the last weight decision
        self.said_rising = False  # the weight decision waited for a rising lr (said once)
        self.estimated: set[int] = set()  # positions given a grid estimate since the last period report
        self.foreseen: set[str] = set()  # keys of the parameters the remedy has judged from their rho-hat

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.adapter.optimizer

    def name(self, unit: LedgerRow) -> str:
        """A parameter's readable name."""
        return self._names(unit.param, unit.key, self.engine.prefix)

    # -- the step ----------------------------------------------------------------------------------------------------
    def before_step(self) -> None:
        self.engine.before_step((self.steps + 1) % self.options.track_every == 0)
        self.adopt()
        self.interventions.before_step()

    def after_step(self) -> None:
        # GradScaler hands a fused/AMP-aware optimizer its verdict as the attribute ``found_inf`` during step()
        found_inf = getattr(self.optimizer, "found_inf", None)
        if found_inf is not None and bool(found_inf):  # a host sync, only under GradScaler with a fused optimizer
            self.engine.discard()
            return
        self.steps += 1
        self.interventions.warm_up()
        measured = self.engine.after_step()
        self.adopt(after_step=True)
        self.interventions.guard()
        if self.unestimated:  # a first estimate of the parameters adopted since, on the state this step wrote (one
            self.unestimated = False  # host read per device): predictions from the first window on
            waiting = [u.position for u in self.ledger.rows if self.forecast.waiting(u)]
            if waiting:
                self.estimate(waiting)
        if measured:
            self.forecast.record(measured, self.ledger)
        self.ledger.advance()
        if self.steps % self.check_every == 0:
            self.check()
        if self.policy is not None:
            self.decide()

    def check(self) -> None:
        """A check step (every ``coverage_steps``): the grid estimates due; where something may reset or guard, the
        drift of every driver group and each parameter's v underflow since the last check, agreed across ranks (one
        host read per device, one collective), into the ledger, and the stall fractions measured since to a policy
        that observes them; reset parameters whose v still underflows stay guarded; then the remedy acts."""
        due = self.forecast.due(self.steps // self.check_every)
        if due:
            self.estimate(due)
        if self.remedy is None and self.policy is None:
            return
        recent, steps = self.engine.take_recent()
        if steps:
            self.observe(steps)
        self.ledger.set_signals(*self.engine.agreed_signals(summed(self.engine.signals(recent), self.reduce)))
        self.interventions.keep_guarding(self.check_every)
        if self.remedy is not None:
            self.interventions.apply_remedy(self.remedy, self.steps, self.check_every)
        if self.auto_weights:
            self.take_over_measured()

    def observe(self, steps: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Give the policy the stall fraction of each parameter's driver slot at each measured step since the last
        check step, in order (``steps``: each step's measured rows and their (stalled, counted, underflow) counts)."""
        entries = list(self.engine.entries.values())  # in row order
        for rows, counts in steps:
            for row, (stalled, counted, _) in zip(rows.tolist(), counts.tolist()):
                entry = entries[row]
                unit = self.ledger.rows[entry.unit.position]
                if unit.driver() is entry.slot:
                    self.policy.observe(unit, stalled / counted if counted > 0 else math.nan)

    def decide(self) -> None:
        """The policy: what is due is reset (its observations come in at check steps: no host read here)."""
        due = self.policy.due(self.ledger, self.steps)
        if self.policy.needs_sync and self.reduce is not None:
            due = summed(due.astype(np.float64), self.reduce) > 0
        if due.any():
            units = [self.ledger.rows[i] for i in np.flatnonzero(due)]
            self.interventions.reset(units, self.policy.moments, self.steps)

    # -- parameters appearing and their theory -----------------------------------------------------------------------
    def adopt(self, after_step: bool = False, stepping: bool = True) -> None:
        """Align the ledger and the forecast with the engine's units; let the policy choose the periods of the
        parameters whose rho-hat is known; announce the optimizer at its first parameters. The remedy judges what
        was aligned inside a step hook (``stepping``), not when the monitor attaches: a front-end tells it the lr
        schedule to follow after attaching, and a resumed state exists from then on.

        A parameter whose state existed before monitoring began (a checkpoint saved without the monitor) is as old as
        its optimizer step counter says (one host read per device where the counters live there); one whose state
        the step that just ran created starts at 0, and the ledger adds this step next."""
        if self.adopted != self.engine.version:
            self.align(after_step)
        if stepping and self.judge_due:
            self.judge_due = False
            if self.weights_due:
                self.weights_due = False
                self.foresee_weights(self.steps + (0 if after_step else 1))
            self.foresee()

    def align(self, after_step: bool) -> None:
        """:meth:`adopt`'s alignment of the ledger and the forecast with the engine's units."""
        self.adopted = self.engine.version
        # inside the post-step hook the new parameters are the ones whose state this step created: age 0, unread
        new = self.ledger.sync(self.engine.tracked, None if after_step else lambda units: [
            steps or 0 for steps in self.adapter.steps_taken([u.param for u in units])])
        self.forecast.align(self.engine.entries)
        self.forecast.adopt(self.ledger)
        self.unestimated = True
        self.configure([u for u in self.ledger.rows if u.period_source == "" and not self.forecast.waiting(u)])
        self.judge_due = True
        if new and not self.announced:
            self.announced = self.weights_due = True
            mixed = self.mixed_precision()  # a collective: every rank adopts at the same step
            info(fit_start_report(self.adapter, self.engine, self.ledger, self.forecast.pending, self.policy,
                                  self.remedy, self.options.track_every, mixed))

    def estimate(self, positions: list[int]) -> None:
        """Grid estimates of the parameters at ``positions``; the periods, once every state has settled."""
        changed = self.forecast.estimate(self.ledger, positions)
        self.configure(changed)
        self.foresee()
        self.estimated.update(u.position for u in changed)
        if changed and not self.forecast.pending:
            line = period_report(self.ledger, self.policy, only=self.estimated,
                                 title="reset periods from the settled grid estimates")
            if line:
                info(line)
            self.estimated = set()

    def foresee(self) -> None:
        """Let the remedy judge each parameter once, from its rho-hat, as soon as that is known."""
        if self.remedy is None:
            return
        units = [u for u in self.ledger.rows if u.key not in self.foreseen and u.rho is not None]
        if units:
            self.foreseen.update(u.key for u in units)
            self.interventions.foresee(self.remedy, units, self.steps, self.writeback)

    def follow(self, scheduler: Any, last_step: int, every: int) -> None:
        """Follow ``scheduler`` (stepped every ``every`` optimizer steps up to ``last_step``) in the weight report."""
        self.schedule = (scheduler, last_step, every)

    def foresee_weights(self, step: int) -> None:
        """At the first parameters (every rank at the same step: a collective): per format of stored weights, the
        share past the threshold at the lr they will train at (:meth:`training_lr`) and the lr below which they stop
        moving, with the step where a followed lr schedule gets there; with the automatic remedy, the write-back takes
        over the parameters whose share past the threshold calls for it."""
        units = [u for u in self.ledger.rows if any(s.moment == WEIGHT for s in u.slots)]
        if not units:
            return
        groups = self.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        self.check_lrs = [float(lr) for lr in lrs]
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        path, every = None, 1
        if self.schedule is not None:
            scheduler, last_step, every = self.schedule
            path = lr_path(scheduler, -(-max(0, last_step - step) // every), lrs)
            self.outlook = None if path is None else LrOutlook(path, step, every)
        basis = [self.training_lr(i, step) for i in range(len(groups))]
        judged = [basis[group_of[id(u.param)]] for u in units]
        slots = [next(s for s in u.slots if s.moment == WEIGHT) for u in units]
        samples = [self.engine.tracked[u.position].sample for u in units]
        readings = to_host([weight_theory.threshold(s, sample, lr if lr is not None else 0.0)
                            for s, sample, (lr, _) in zip(slots, samples, judged)], width=3)
        past = summed(readings[:, :2].reshape(-1), self.reduce).reshape(-1, 2)  # agreed: decisions rest on it
        share = np.where(past[:, 1] > 0, past[:, 0] / np.maximum(past[:, 1], 1.0), np.nan)
        stop = readings[:, 2].tolist()  # this rank's, for the report only
        first = group_of[id(units[0].param)]
        info(weight_report([s.format for s in slots], share.tolist(), stop, *judged[0],
                           None if path is None else path[:, first], step, every))
        if self.auto_weights:
            known = np.array([lr is not None for lr, _ in judged])
            free = self.ledger.arrays["weights"][[u.position for u in units]] == 0
            chosen = self.remedy.weights_foreseen(share) & known & free
            rows = np.array([u.position for u, c in zip(units, chosen) if c], dtype=np.int64)
            why = [f"{share[i]:.0%} of its weights are past the threshold at lr {judged[i][0]:.3g}, {judged[i][1]}"
                   for i in np.flatnonzero(chosen)]
            self.interventions.take_over_weights(self.writeback, rows, why, self.steps)
            if (free & ~chosen).any():
                info(f"[lightning_stale] remedy: the weight write-back leaves {int((free & ~chosen).sum())} bf16/fp16 "
                     "parameter(s) to the optimizer for now; it takes a parameter over at a check step (every "
                     f"{self.check_every} steps) where more than {self.remedy_stall_share()} of its weights are "
                     "measured to stall at a non-zero lr that has stopped rising")

    def training_lr(self, group: int, step: int) -> tuple[float | None, str]:
        """The lr the parameters of ``group`` will train at, judged at optimizer step ``step``, and what it is in
        words: with a followed schedule, the lowest non-zero lr it reaches from its peak on (the lr a warm-up and
        decay settle at: there the weights stall most, and the compensated write is in place before the lr gets
        there; a constant schedule's lr, a warm-up's peak where nothing decays), else the current lr. None where that
        lr is 0 (nothing would be judged but the warm-up's start)."""
        if self.outlook is not None:
            lr, at = self.outlook.settled(group)
            if lr <= 0:
                return None, "the lr schedule ahead stays at 0"
            return lr, ("the current lr, which the lr schedule ahead keeps" if at == step else
                        f"the lr the lr schedule settles at after its peak, from step {at}")
        lr = float(self.optimizer.param_groups[group]["lr"])
        if lr <= 0:
            return None, "the lr is 0 now and no lr schedule is followed"
        return lr, "the current lr"

    def remedy_stall_share(self) -> str:
        """The automatic remedy's weight-stall threshold, for messages."""
        share = getattr(self.remedy, "weight_stall", None)
        return "the remedy's share" if share is None else f"{share:.0%}"

    def take_over_measured(self) -> None:
        """A check step's weight decision: the parameters whose measured weight stall calls for the write-back, where
        it was measured at an lr they will train at: not at lr 0, and not while the lr still rises (a followed
        schedule's lr over the next check interval, else the lr at the previous check, is above the current one),
        since a warm-up's stall passes as its lr grows."""
        ledger, groups = self.ledger, self.optimizer.param_groups
        now = [float(g["lr"]) for g in groups]
        ahead = self.outlook.ahead(self.steps, self.check_every) if self.outlook is not None else None
        before, self.check_lrs = self.check_lrs, now
        rows = np.flatnonzero(self.remedy.weights(ledger) & (ledger.arrays["weights"] == 0))
        if not rows.size:
            return
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        group = [group_of[id(ledger.rows[i].param)] for i in rows]
        rising = [now[g] <= 0 or (ahead[g] > now[g] * (1 + 1e-6) if ahead is not None else
                                  before is not None and now[g] > before[g] * (1 + 1e-6)) for g in group]
        waiting = [(i, g) for i, g, r in zip(rows, group, rising) if r]
        if waiting and not self.said_rising:
            self.said_rising = True
            unit, lr = ledger.rows[waiting[0][0]], now[waiting[0][1]]
            info(f"[lightning_stale] remedy: the weights of {len(waiting)} parameter(s) stalled since the last check "
                 f"(e.g. {self.name(unit)!r}: {unit.weight_stall:.0%}) while the lr is "
                 f"{'0' if lr <= 0 else 'still rising'} (lr {lr:.3g} at step {self.steps}): "
                 "the write-back does not take them over until the lr stops rising, since a warm-up's stall passes "
                 "as the lr grows")
        chosen = np.array([i for i, r in zip(rows, rising) if not r], dtype=np.int64)
        why = [f"{ledger.rows[i].weight_stall:.0%} of its sampled elements with a non-zero gradient did not move "
               f"since the last check, at lr {now[g]:.3g}" for i, g, r in zip(rows, group, rising) if not r]
        self.interventions.take_over_weights(self.writeback, chosen, why, self.steps)

    def weight_predictions(self, counted: np.ndarray) -> np.ndarray:
        """(predicted stalls, elements) of each weight row counted in the window (``counted``: per row), (rows, 2) on
        the host: the weights' stall that the current lr and the optimizer's own moments imply (one host read). A
        prediction that cannot be made (no Adam-like moments or group) is left out, warned once."""
        out = np.zeros((len(self.engine.entries), 2))
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        decoupled = "AdamW" in type(self.optimizer).__name__
        sums, rows = [], []
        for entry in self.engine.entries.values():
            if entry.moment != WEIGHT or not counted[entry.row]:
                continue
            unit, group = entry.unit, groups[id(entry.unit.param)]
            by_moment = {e.moment: e.slot for e in unit.entries}
            if "m" not in by_moment or "v" not in by_moment or "betas" not in group or "eps" not in group:
                continue
            stochastic = self.writeback is not None and self.writeback.takes_over(unit.param)
            counter = self.adapter.step_counter(unit.param)
            try:
                sums.append(weight_theory.predicted_stall(
                    entry.slot, by_moment["m"], by_moment["v"], unit.sample, group, 1 if counter is None else counter,
                    group.get("decoupled_weight_decay", decoupled), stochastic))
                rows.append(entry.row)
            except Exception as error:  # a layout without sampled reads: no prediction for it
                self._warn(f"weights:{unit.key}", f"lightning_stale: no weight-stall prediction for "
                           f"{self.name(self.ledger.rows[unit.position])!r} ({type(error).__name__}: {error})")
        if sums:
            out[rows] = to_host(sums)
        return out

    def reset_window(self) -> None:
        """Start a new window of counts and predicted stalls (what the monitor's ``compute()`` reads)."""
        self.engine.reset_window()
        self.forecast.reset_window(self.engine.entries)
        self.window_start = self.steps

    def describe_nonfinite(self, positions: np.ndarray, shown: int = 5) -> tuple[str, int]:
        """The parameters at ``positions``, whose sampled weights went NaN/Inf in this window, in words (the first
        ``shown`` with those of their stored moments that went too: one host read each), and the optimizer step
        the window started after."""
        names = []
        for position in positions[:shown]:
            unit = self.engine.tracked[position]
            states = []
            for entry in unit.entries:
                if entry.moment == WEIGHT:
                    continue
                try:
                    values = entry.slot.value_at(unit.sample.positions(unit.param.device))
                    if not bool(torch.isfinite(values).all()):
                        states.append(entry.slot.key)
                except Exception:  # a layout that cannot be read here: its state is left unnamed
                    continue
            name = repr(self.name(self.ledger.rows[position]))
            names.append(f"{name} (and its {', '.join(states)})" if states else name)
        more = f" and {len(positions) - shown} more" if len(positions) > shown else ""
        return ", ".join(names) + more, self.window_start

    def close(self) -> None:
        """Remove the write-back's hooks."""
        if self.writeback is not None:
            self.writeback.close()

    def configure(self, units: list[LedgerRow]) -> None:
        if self.policy is not None:
            for unit in units:
                self.policy.configure(unit)

    def mixed_precision(self) -> list[str]:
        """With several processes, the parameters whose low-precision state fell back to fp32 on some ranks only."""
        if self.reduce is None:
            return []
        flags = [[float(any(s.format != "fp32" for s in u.slots)), 1.0] for u in self.ledger.rows]
        counts = summed(np.array(flags, dtype=np.float64).reshape(-1, 2), self.reduce)
        return [self.name(u) for u, (n_low, n) in zip(self.ledger.rows, counts.tolist()) if 0 < n_low < n]

    # -- checkpointing -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"steps": self.steps, "engine": self.engine.state_dict(), "forecast": self.forecast.state_dict(),
                 "ledger": self.ledger.state_dict(), "interventions": self.interventions.state_dict(),
                 "check_lrs": self.check_lrs}
        if self.writeback is not None:
            state["weights"] = self.writeback.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], counts: bool, shadows: bool, periods: bool) -> None:
        """Continue from a :meth:`state_dict`; ``counts`` and ``shadows``: whether the unlogged counts and the drift
        shadows are this process's (see the monitor); ``periods``: whether the saved periods continue."""
        self.steps = self.window_start = int(state["steps"])
        self.engine.load_state_dict(state["engine"], counts=counts, shadows=shadows)
        self.forecast.load_state_dict(state["forecast"] if counts else {})
        self.ledger.load_state_dict(state["ledger"] if periods else without_periods(state["ledger"]))
        self.interventions.load_state_dict(state["interventions"])
        self.check_lrs = state.get("check_lrs")  # whether the lr still rises, at the next check (older states: none)
        if self.writeback is not None and "weights" in state:
            self.writeback.load_state_dict(state["weights"])
        self.adopted = -1
        # A run that had seen its parameters made its fit-start report and foresight then, and the remedy judged each
        # parameter whose rho-hat it knew: a resume does not repeat them (their choices are in the state), so its
        # decisions are the uninterrupted run's.
        self.announced = self.announced or bool(state["ledger"])
        self.foreseen |= {key for key, fields in state["ledger"].items() if not math.isnan(fields.get("rho", math.nan))}
