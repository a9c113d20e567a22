"""Logged metrics: key names, and the aggregation of the engines' per-slot totals into one row.

Aggregates are element-weighted over slots and summed across ranks: each slot contributes its sums per measured step
(so a slot measured more often in a window does not weigh more) times the elements each sampled element stands for,
and fractions are sum(stalled) / sum(counted) over slots and ranks, never an average of per-rank fractions. The
per-moment vector below is what is reduced across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_stale import theory
from lightning_stale.vocab import QUANTITIES, WEIGHT
from lightning_stale.decide.remedies import GUARD, REMEDIES, RESET, STOCHASTIC
from lightning_stale.measure.counting import COUNTED, MEASURED, STALLED, UNDERFLOW

# Per moment, the reduced vector holds: the engine's stall columns (normalized per measured step), the number of
# slots measured, weighted sums of drift and prediction (value * weight, weight) and, in the weights' row, the sampled
# weights found NaN/Inf.
V_STALLED, V_COUNTED, V_UNDERFLOW, V_MEASURED, V_DRIFT, V_DRIFT_W, V_PRED, V_PRED_W, V_NONFINITE = range(9)
PER_MOMENT = 9


DEFAULT_PREFIX = "stale"  # the default ``log_key_prefix`` of every front-end


def key(prefix: str, *parts: str) -> str:
    """A logged key: ``<prefix>/<part>/...``."""
    return "/".join((prefix, *parts))


# The keys of one row (``stale`` stands for the prefix), documented in the README's metrics table.
FRAC, DRIFT, PREDICTED, UNDERFLOW_KEY, BETA_EFF, HORIZON_EFF = "frac", "drift", "predicted", "underflow", "beta_eff", \
    "horizon_eff"
RESETS, SINCE_RESET = "resets", "since_reset"
REMEDY = "remedy"  # remedy="auto": <prefix>/remedy/guard, /stochastic (parameters now), /reset (resets so far)
WEIGHTS = "weights"  # <prefix>/remedy/weights: parameters whose weight write the write-back takes over now


def moment_vector(totals: Tensor, moments: Sequence[str], drift: Sequence[tuple[str, float, int]],
                  predicted: np.ndarray, nonfinite: int = 0) -> Tensor:
    """The per-moment vector of one engine's window (host, float64).

    ``totals``: (rows, N_STATS) sums since the last window; ``moments``: each row's moment; ``drift``: (moment,
    value, weight) of each shadowed slot; ``predicted``: (rows, 2) sum and count of the theory's predictions;
    ``nonfinite``: sampled weights found NaN/Inf.
    """
    totals_np, predicted_np = totals.numpy(), predicted
    moment_of = np.array([QUANTITIES.index(m) for m in moments], dtype=np.int64)
    measured = totals_np[:, MEASURED]
    per_step = totals_np[:, :MEASURED] / np.maximum(measured, 1.0)[:, None]  # each slot per measured step
    has_prediction = predicted_np[:, 1] > 0
    mean_prediction = np.where(has_prediction, predicted_np[:, 0] / np.maximum(predicted_np[:, 1], 1.0), 0.0)
    vector = np.zeros((len(QUANTITIES), PER_MOMENT))
    for column, values in ((V_STALLED, per_step[:, STALLED]), (V_COUNTED, per_step[:, COUNTED]),
                           (V_UNDERFLOW, per_step[:, UNDERFLOW]), (V_MEASURED, measured > 0),
                           (V_PRED, mean_prediction * per_step[:, COUNTED] * has_prediction),
                           (V_PRED_W, per_step[:, COUNTED] * has_prediction)):
        np.add.at(vector[:, column], moment_of, values)
    for moment, value, weight in drift:
        i = QUANTITIES.index(moment)
        vector[i, V_DRIFT] += value * weight
        vector[i, V_DRIFT_W] += weight
    vector[QUANTITIES.index(WEIGHT), V_NONFINITE] = nonfinite
    return torch.from_numpy(vector.reshape(-1))


def nonfinite(vector: np.ndarray) -> bool:
    """Whether the reduced vector's window saw NaN/Inf weights."""
    return bool(vector.reshape(len(QUANTITIES), PER_MOMENT)[QUANTITIES.index(WEIGHT), V_NONFINITE] > 0)


def row(vector: np.ndarray, prefix: str, resets: int, since_reset: float | None,
        v_beta: float | None) -> dict[str, float]:
    """The metrics of one logged row from the reduced per-moment vector. A window that saw NaN/Inf weights gives NaN
    for every stall metric of the moments it measured: counts and drift of a diverged run mean nothing."""
    if nonfinite(vector):
        return nan_row(vector, prefix, resets, since_reset)
    values = vector.reshape(len(QUANTITIES), PER_MOMENT).tolist()
    metrics: dict[str, float] = {}
    stalled = counted = 0.0
    for moment, v in zip(QUANTITIES, values):
        if v[V_MEASURED] == 0 or v[V_COUNTED] == 0:
            continue
        frac = v[V_STALLED] / v[V_COUNTED]
        if moment != WEIGHT:  # the overall fraction is the optimizer states'; the weights have their own key
            stalled, counted = stalled + v[V_STALLED], counted + v[V_COUNTED]
        metrics[key(prefix, moment, FRAC)] = frac
        if v[V_DRIFT_W] > 0:
            metrics[key(prefix, moment, DRIFT)] = v[V_DRIFT] / v[V_DRIFT_W]
        if v[V_PRED_W] > 0:
            metrics[key(prefix, moment, PREDICTED)] = v[V_PRED] / v[V_PRED_W]
        if moment == "v":
            metrics[key(prefix, "v", UNDERFLOW_KEY)] = v[V_UNDERFLOW] / v[V_COUNTED]
            if v_beta is not None:
                metrics[key(prefix, "v", BETA_EFF)] = theory.effective_beta(v_beta, min(1.0, frac))
                horizon = theory.effective_horizon(v_beta, min(1.0, frac))
                metrics[key(prefix, "v", HORIZON_EFF)] = horizon if math.isfinite(horizon) else float("inf")
    if counted > 0:
        metrics[key(prefix, FRAC)] = stalled / counted
        metrics[key(prefix, RESETS)] = float(resets)
        if since_reset is not None:
            metrics[key(prefix, SINCE_RESET)] = since_reset
    return metrics


def nan_row(vector: np.ndarray, prefix: str, resets: int, since_reset: float | None) -> dict[str, float]:
    """:func:`row` of a window that saw NaN/Inf weights: NaN for the stall metrics of every moment measured in it
    (the keys a healthy row has), the reset counters as they are."""
    values = vector.reshape(len(QUANTITIES), PER_MOMENT).tolist()
    measured = [moment for moment, v in zip(QUANTITIES, values) if v[V_MEASURED] > 0]
    names = {"m": (FRAC, DRIFT), "v": (FRAC, DRIFT, PREDICTED), WEIGHT: (FRAC, PREDICTED)}
    metrics = {key(prefix, moment, name): math.nan for moment in measured for name in names.get(moment, (FRAC,))}
    if "v" in measured:
        metrics.update({key(prefix, "v", name): math.nan for name in (UNDERFLOW_KEY, BETA_EFF, HORIZON_EFF)})
    metrics[key(prefix, FRAC)] = math.nan
    metrics[key(prefix, RESETS)] = float(resets)
    if since_reset is not None:
        metrics[key(prefix, SINCE_RESET)] = since_reset
    return metrics


def remedy_row(prefix: str, guarded: int, stochastic: int, resets: int) -> dict[str, float]:
    """What the automatic remedy did: parameters it keeps under the underflow guard now, parameters it switched to
    stochastic rounding, parameter resets so far."""
    return {key(prefix, REMEDY, REMEDIES[GUARD]): float(guarded),
            key(prefix, REMEDY, REMEDIES[STOCHASTIC]): float(stochastic),
            key(prefix, REMEDY, REMEDIES[RESET]): float(resets)}
