"""What a learning-rate scheduler will set: its lr over the coming steps, read by stepping the user's scheduler and
putting back its state and its optimizer's hyperparameters, so that the weights' theory can say at which step the lr
falls below the one where a format's weights stop moving (a schedule is code: running it is the only general way)."""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

UNKNOWN_LAST_STEP = 10**9  # a run whose length a front-end cannot know: the time budget bounds the look-ahead


def _capture(value: Any) -> tuple[Any, Any]:
    """``value`` and what puts it back: a tensor's values, a list's, tuple's or dict's items (each captured), a copy of
    anything else (an immutable value is its own copy)."""
    if isinstance(value, Tensor):
        return value, value.clone()
    if isinstance(value, (list, tuple)):
        return value, [_capture(item) for item in value]
    if isinstance(value, dict):
        return value, {key: _capture(item) for key, item in value.items()}
    return value, copy.deepcopy(value)


def _put_back(record: tuple[Any, Any]) -> Any:
    """The captured object with its captured value, as the same object wherever it can change in place: a tensor's
    values copied back into it, a list's or dict's items put back into it; a tuple is the same tuple where its items
    are. Objects shared between the optimizer and its schedulers (torch <= 2.8 gives a tensor lr, the group's
    ``initial_lr`` and the schedulers' base lrs one tensor) stay shared, so the schedule goes on as it would have."""
    obj, saved = record
    if isinstance(obj, Tensor):
        obj.copy_(saved)
        return obj
    if isinstance(obj, list):
        obj[:] = [_put_back(item) for item in saved]
        return obj
    if isinstance(obj, dict):
        items = {key: _put_back(item) for key, item in saved.items()}
        obj.clear()
        obj.update(items)
        return obj
    if isinstance(obj, tuple):
        items = [_put_back(item) for item in saved]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return saved


def _capture_groups(groups: list[dict[str, Any]]) -> list[dict[str, tuple[Any, Any]]]:
    """Each group's hyperparameters (every entry but its parameters), captured."""
    return [{key: _capture(value) for key, value in group.items() if key != "params"} for group in groups]


def _restore_groups(groups: list[dict[str, Any]], saved: list[dict[str, tuple[Any, Any]]]) -> None:
    """Put back every hyperparameter the scheduler may have set (lr, momentum or betas, ``initial_lr``) as the same
    objects with their values (fused and capturable steps keep references to a tensor lr), and drop entries it
    added."""
    for group, values in zip(groups, saved):
        for key in [k for k in group if k != "params" and k not in values]:
            del group[key]
        for key, record in values.items():
            group[key] = _put_back(record)


@torch.no_grad()
def lr_path(scheduler: Any, steps: int, lrs: list[Any] | None = None, seconds: float = 0.5) -> np.ndarray | None:
    """Each param group's lr over the next ``steps`` scheduler steps, an array (k + 1, groups) whose row 0 is the
    current lr (``lrs`` where a step in progress holds other values in the groups); shorter where ``seconds`` run
    out. A LambdaLR is read from its lambdas, any other scheduler is stepped and put back with its optimizer's
    hyperparameters. None for a scheduler that needs a metric to step (ReduceLROnPlateau) or that fails."""
    optimizer = getattr(scheduler, "optimizer", None)
    if optimizer is None or not callable(getattr(scheduler, "state_dict", None)) \
            or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return None
    groups = optimizer.param_groups
    if type(scheduler) is torch.optim.lr_scheduler.LambdaLR:  # transformers' schedules: a closed form, not stepped
        return _lambda_path(scheduler, steps, [float(lr) for lr in lrs] if lrs else [float(g["lr"]) for g in groups],
                            seconds)
    try:  # the scheduler's state as its own objects (load_state_dict binds them again), and their values
        state = scheduler.state_dict()
        saved, hyper = _capture(state), _capture_groups(groups)
    except Exception:  # a state that cannot be copied: the schedule is not run ahead
        return None
    deadline = time.perf_counter() + seconds
    try:
        for group, lr in zip(groups, lrs or ()):
            if isinstance(group["lr"], Tensor):
                group["lr"].fill_(lr)  # in place: whatever shares the tensor sees the lr the step really has
            else:
                group["lr"] = lr.clone() if isinstance(lr, Tensor) else lr
        rows = [[float(g["lr"]) for g in groups]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()" and the like
            while len(rows) <= steps and time.perf_counter() < deadline:
                scheduler.step()
                rows.append([float(g["lr"]) for g in groups])
    except Exception:  # a schedule that cannot run ahead is not known: the report leaves the step out
        return None
    finally:
        _put_back(saved)
        scheduler.load_state_dict(state)
        _restore_groups(groups, hyper)
    return np.asarray(rows, dtype=np.float64)


def _lambda_path(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int, current: list[float],
                 seconds: float) -> np.ndarray | None:
    """LambdaLR's lrs ``base_lr * lr_lambda(epoch)`` for the coming epochs, row 0 the ``current`` ones."""
    rows, start, bases = [current], scheduler.last_epoch, [float(base) for base in scheduler.base_lrs]
    deadline = time.perf_counter() + seconds
    try:
        for epoch in range(start + 1, start + steps + 1):
            rows.append([base * fn(epoch) for base, fn in zip(bases, scheduler.lr_lambdas)])
            if epoch % 1024 == 0 and time.perf_counter() > deadline:
                break
    except Exception:  # a lambda that fails ahead of time: the schedule is not known
        return None
    return np.asarray(rows, dtype=np.float64)


def below_from(path: np.ndarray, lr: float) -> int | None:
    """The index of one group's lr ``path`` from which it stays below ``lr`` to its end (0: all along; after a
    warm-up, the decay's crossing), None if its last value is not below."""
    above = np.flatnonzero(path >= lr)
    start = int(above[-1]) + 1 if above.size else 0
    return start if start < len(path) else None


class LrOutlook:
    """A followed schedule's lrs ahead, per param group: ``path`` from :func:`lr_path`, whose row k is the lr of
    optimizer step ``start + k * every``. The automatic remedy's weight decision reads the lr the parameters will
    train at from it, not the lr of the step it happens to decide at (0 at the start of a warm-up)."""

    def __init__(self, path: np.ndarray, start: int, every: int) -> None:
        self.path, self.start, self.every = path, start, every

    def settled(self, group: int) -> tuple[float, int]:
        """The lowest non-zero lr of ``group`` from the path's peak on (what a warm-up and decay settle at; the peak
        where nothing after it is above 0) and the first optimizer step that has it (the last of a constant lr's)."""
        column = self.path[:, group]
        peak = int(np.argmax(column))
        tail = column[peak:]
        if not (tail > 0).any():
            return float(column[peak]), self.start + peak * self.every
        low = np.where(tail > 0, tail, np.inf)
        row = peak + int(np.flatnonzero(low == low.min())[0])
        return float(column[row]), self.start + row * self.every

    def ahead(self, step: int, steps: int) -> np.ndarray | None:
        """Each group's largest lr over optimizer steps ``step + 1`` to ``step + steps``, None where the path does not
        reach them."""
        first, last = (step + 1 - self.start) // self.every, (step + steps - self.start) // self.every
        if first < 0 or last >= len(self.path):
            return None
        return self.path[first:last + 1].max(axis=0)


__all__ = ["UNKNOWN_LAST_STEP", "LrOutlook", "below_from", "lr_path"]
