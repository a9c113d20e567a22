"""lightning_stale's :class:`~lightning_stale.optim.QuantizedAdamW`: moments in any registered state format.

Its own per-parameter step (:meth:`QuantizedAdamW.step_parameters`) updates the moments and requantizes them in their
format, rounded its way; the write-back hands it the fp32 weight to update (the stored one plus its residual) and
writes the parameter with the chosen rounding. With nearest rounding that is its own step, bit for bit.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_stale.act.writeback.family import Columns, Family, Member, Write, member_columns
from lightning_stale.act.writeback.kernels import noise, noise_keys, weight_target, write_weight
from lightning_stale.optim import QuantizedAdamW


class Quantized(Family):
    """QuantizedAdamW (see the module)."""

    def ready(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        return "step_m" in state

    def prepare(self, members: list[Member]) -> Columns:
        columns = member_columns(members)
        columns.compiled = False  # its own step, parameter by parameter (compiled per parameter where it compiles)
        return columns

    def update(self, members: list[Member], columns: Columns, grads: list[Tensor], write: Write) -> None:
        keys = noise_keys(write.key, columns.tensors["noise"]) \
            if write.weights == "stochastic" else None
        targets = [weight_target(w, c) for w, c in zip(columns.lists["w"], columns.lists["c"])]
        self.optimizer.step_parameters([(m.param, m.group) for m in members],
                                       [t.view(m.local.shape) for t, m in zip(targets, members)])
        for i, (w, c, target) in enumerate(zip(columns.lists["w"], columns.lists["c"], targets)):
            write_weight(w, c, target, write.weights, None if keys is None else noise(w, keys[i]))


FAMILIES = {QuantizedAdamW: Quantized}
