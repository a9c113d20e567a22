"""StaleStateMetric: the monitor's window as a torchmetrics Metric, summed across processes in one collective.

The engines count on measured steps into sums kept on each slot's device (no host read in a step hook). The metric's
one state, ``window``, is the window's per-moment vector (:func:`~lightning_stale.monitor.metrics.moment_vector` of
every optimizer, added up): it is taken from the engines when the metric syncs, which ``compute()`` does first (one
host read per device), and summed across processes by its ``dist_sync_fn``, one all-reduce instead of torchmetrics'
all-gathers. Every slot counts per measured step of its own, so the vector is made once the window ends, not added
up step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_stale.decide.remedies import GUARD, STOCHASTIC
from lightning_stale.messages import ParamNames, info
from lightning_stale.monitor import metrics
from lightning_stale.monitor.options import MonitorOptions
from lightning_stale.monitor.pipeline import OptimizerPipeline
from lightning_stale.ranks import Reduce, summed
from lightning_stale.vocab import QUANTITIES


class StaleStateMetric(Metric):
    """The stall metrics of every measured step since the last :meth:`reset`, as a torchmetrics Metric.

    ``compute()`` gives the row the monitor logs (a dict of floats: the aggregates summed across processes, then this
    rank's per-parameter fractions where ``log_per_param`` asks for them); under several processes it is a
    collective, so every rank computes at the same steps. ``reset()`` starts the next window. It works where
    torchmetrics metrics do: in a ``MetricCollection``, synced by hand (``sync()`` / ``unsync()``), or logged from a
    LightningModule with ``self.log_dict(metric.compute())``. The monitor feeds it from the optimizer's step hooks, so
    ``update()`` takes nothing.

    Args:
        pipelines: the monitor's pipelines, one per optimizer (the list is shared, not copied).
        options: the monitor's options (the key prefix, ``log_per_param``, the remedy).
        names: readable parameter names for the per-parameter keys.
        reduce: sums a float64 tensor across processes (None: a single process, nothing to sum).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    def __init__(self, pipelines: Sequence[OptimizerPipeline], options: MonitorOptions, names: ParamNames,
                 reduce: Reduce | None) -> None:
        super().__init__(dist_sync_fn=self._all_reduce, distributed_available_fn=self._several_processes,
                         compute_with_cache=False)
        self.add_state("window", torch.zeros(len(QUANTITIES) * metrics.PER_MOMENT, dtype=torch.float64),
                       dist_reduce_fx="sum")
        self.prefix = options.log_key_prefix  # the keys' prefix (the Fabric front-end's later optimizers: opt<i>)
        self._pipelines, self._options, self._names, self._reduce = pipelines, options, names, reduce
        self._per_param: dict[str, float] = {}  # this rank's per-parameter fractions, taken in with the window
        self._nonfinite: list[tuple[OptimizerPipeline, np.ndarray]] = []  # this rank's NaN/Inf weights in the window
        self._said_nonfinite = False

    @property
    def update_called(self) -> bool:
        """Always: the monitor feeds the window from the optimizer's step hooks (an empty window computes to an
        empty row)."""
        return True

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to add: the engines count on measured steps, and :meth:`sync` takes their window in. (A
        ``MetricCollection`` passes its inputs here.)"""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`update`; a window has no per-batch value (torchmetrics' forward would reset the state to compute
        one, which here would end the window)."""
        self.update(*args, **kwargs)

    def sync(self, dist_sync_fn: Callable | None = None, process_group: Any = None, should_sync: bool = True,
             distributed_available: Callable | None = None) -> None:
        """Take this rank's window from the engines into ``window`` (one host read per device), then sum it across
        processes as torchmetrics does, by default with this metric's one all-reduce (where several processes take
        part)."""
        self.window, self._per_param = self._local_window()
        super().sync(dist_sync_fn or self.dist_sync_fn, process_group, should_sync, distributed_available)

    def compute(self) -> dict[str, float]:
        """The row: the metrics of the window summed across processes, and this rank's per-parameter fractions."""
        return {**self._row(), **self._per_param}

    def compute_parts(self) -> tuple[dict[str, float], dict[str, float]]:
        """:meth:`compute` as (the row summed across processes, this rank's per-parameter fractions), for front-ends
        that log them through different paths; the same one collective."""
        with self.sync_context(dist_sync_fn=self.dist_sync_fn):
            return self._row(), dict(self._per_param)

    def reset(self) -> None:
        """Start a new window: the next row covers only the steps after this call (the optimizer states and the reset
        bookkeeping are untouched)."""
        super().reset()
        self._per_param = {}
        for pipeline in self._pipelines:
            pipeline.reset_window()

    def _local_window(self) -> tuple[Tensor, dict[str, float]]:
        """This rank's per-moment vector of the window and its per-parameter fractions."""
        prefix = self.prefix
        vector = torch.zeros(len(QUANTITIES) * metrics.PER_MOMENT, dtype=torch.float64)
        per_param: dict[str, float] = {}
        self._nonfinite = []
        for pipeline in self._pipelines:
            engine = pipeline.engine
            totals, predicted = engine.window(), pipeline.forecast.window(engine.entries)
            predicted += pipeline.weight_predictions(totals[:, metrics.COUNTED].numpy() > 0)
            drift = [(engine.entries[k].moment, value, engine.drift_weight(k)) for k, value in engine.drift().items()]
            bad = engine.nonfinite()
            if bad.any():
                self._nonfinite.append((pipeline, np.flatnonzero(bad)))
            vector += metrics.moment_vector(totals, [e.moment for e in engine.entries.values()], drift, predicted,
                                            int(bad.sum()))
            if self._options.log_per_param:
                for entry, row in zip(engine.entries.values(), totals.tolist()):
                    if row[metrics.COUNTED] > 0:
                        name = self._names(entry.unit.param, entry.unit.key, engine.prefix)
                        per_param[metrics.key(prefix, name, entry.slot.key, metrics.FRAC)] = \
                            row[metrics.STALLED] / row[metrics.COUNTED]
        return vector.to(self.device), per_param

    def _row(self) -> dict[str, float]:
        """The aggregates from ``window`` (summed across processes inside a sync), the reset counts and what the
        remedy and the weight write-back do now."""
        pipelines, prefix = self._pipelines, self.prefix
        ages = np.concatenate([pipeline.ledger.ages for pipeline in pipelines])
        betas = [entry.slot.beta for pipeline in pipelines for entry in pipeline.engine.entries.values()
                 if entry.moment == "v" and entry.slot.beta is not None]
        resets = sum(pipeline.interventions.resets for pipeline in pipelines)
        vector = self.window.cpu().numpy()
        row = metrics.row(vector, prefix, resets, float(ages.mean()) if ages.size else None,
                          sum(betas) / len(betas) if betas else None)
        if metrics.nonfinite(vector):  # every rank sees it in the reduced vector: the rows agree
            self._per_param = dict.fromkeys(self._per_param, float("nan"))
            if not self._said_nonfinite:
                self._said_nonfinite = True
                info(self._nonfinite_line())
        if self._options.remedy_rule is not None and row:  # decisions are agreed across ranks: local counts are global
            chosen = np.concatenate([pipeline.ledger.arrays["remedy"] for pipeline in pipelines])
            row.update(metrics.remedy_row(prefix, int((chosen == GUARD).sum()), int((chosen == STOCHASTIC).sum()),
                                          sum(pipeline.interventions.remedy_resets for pipeline in pipelines)))
        writebacks = [pipeline.writeback for pipeline in pipelines if pipeline.writeback is not None]
        if writebacks and row:
            row[metrics.key(prefix, metrics.REMEDY, metrics.WEIGHTS)] = float(sum(w.handled for w in writebacks))
        return row

    def _nonfinite_line(self) -> str:
        """What the first window with NaN/Inf weights says: where (this rank's parameters, with which of their
        states), when, and that the stall metrics stop meaning anything."""
        if not self._nonfinite:
            return ("[lightning_stale] non-finite weights: another process found NaN/Inf in its sampled weights; the "
                    "run has diverged, and from here on the stall metrics mean nothing: they are logged as NaN")
        parts = [pipeline.describe_nonfinite(positions) for pipeline, positions in self._nonfinite]
        count = sum(len(positions) for _, positions in self._nonfinite)
        where = "; ".join(text for text, _ in parts)
        since = min(start for _, start in parts)
        steps = max(pipeline.steps for pipeline, _ in self._nonfinite)
        when = f"at optimizer step {steps}" if since + 1 >= steps else \
            f"between optimizer steps {since + 1} and {steps}"
        return (f"[lightning_stale] non-finite weights: the sampled weights of {count} parameter(s) went NaN/Inf "
                f"{when} ({where}): the run has diverged, and from here on the stall metrics mean nothing: they are "
                "logged as NaN")

    def _several_processes(self) -> bool:
        """torchmetrics' ``distributed_available_fn``: whether there is anything to sum across."""
        return self._reduce is not None

    def _all_reduce(self, tensor: Tensor, group: Any = None) -> list[Tensor]:
        """torchmetrics' ``dist_sync_fn``: ``tensor`` summed across processes in one all-reduce (through the monitor's
        ``reduce``, whose process group it is: ``group`` is not used), as the one-element list torchmetrics adds up."""
        return [torch.from_numpy(summed(tensor, self._reduce)).to(tensor)]
