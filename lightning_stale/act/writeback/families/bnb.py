"""What the bitsandbytes families share: their state (8-bit block-wise codes or fp32), their per-parameter config and
step counter, and a step that follows bitsandbytes' own reference implementation op for op.

bitsandbytes keeps, per parameter, ``state1`` (and ``state2``) as uint8 codes with one ``absmax`` per block of 256
elements (fp32 for parameters below ``min_8bit_size`` or with ``optim_bits=32``) and a Python int ``step``. The write
dequantizes the codes with its own op, updates the moments and the weight in fp32 with the ops of its CPU kernel (so
nearest rounding reproduces its weights and codes bit for bit), writes the weight with the chosen rounding and
requantizes the codes with its own op: its whole step, once. bitsandbytes steps parameter by parameter; so does this.
On CUDA its fused kernels order some ops differently; the write-back computes its CPU kernel's update there too.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale.act.writeback.family import Columns, Family, Member, Write, member_columns
from lightning_stale.act.writeback.kernels import noise, noise_keys, weight_target, write_weight
from lightning_stale.adapters.bnb_layout import BLOCK


class BitsAndBytesFamily(Family):
    """A bitsandbytes optimizer kernel (``optimizer_name``) the write-back steps: subclasses give its moment count
    and its fp32 math (:meth:`math`)."""

    kernel: ClassVar[str]
    states: ClassVar[int]  # moments it keeps (state1, state2)

    def refusal(self) -> str | None:
        name = getattr(self.optimizer, "optimizer_name", None)
        if name != self.kernel:
            return f"its bitsandbytes kernel is {name!r}, this family's is {self.kernel!r}"
        if self.optimizer.args.max_unorm > 0:
            return "max_unorm > 0 (update-norm clipping) is not supported"
        if self.optimizer.args.skip_zeros:
            return "skip_zeros=True is not supported"
        return None

    def ready(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        return "state1" in state

    def prepare(self, members: list[Member]) -> Columns:
        columns = member_columns(members)
        columns.compiled = False  # bitsandbytes' own ops, parameter by parameter
        columns.lists["state"] = [self.optimizer.state[m.param] for m in members]
        return columns

    def update(self, members: list[Member], columns: Columns, grads: list[Tensor], write: Write) -> None:
        keys = noise_keys(write.key, columns.tensors["noise"]) \
            if write.weights == "stochastic" else None
        for i, (member, w, c, g, state) in enumerate(zip(members, columns.lists["w"], columns.lists["c"], grads,
                                                          columns.lists["state"])):
            config = self.optimizer.get_config(*member.position, member.group)
            state["step"] += 1
            coded = state["state1"].dtype == torch.uint8
            moments = [self._read(state, n, w.shape) for n in range(1, self.states + 1)]
            target = weight_target(w, c)
            self.math(target, g.float(), moments, config, state["step"], coded)
            write_weight(w, c, target, write.weights, None if keys is None else noise(w, keys[i]))
            if coded:
                for n, values in enumerate(moments, start=1):
                    _compat.bnb_quantize_blockwise_into(values, state[f"qmap{n}"], BLOCK, state[f"state{n}"],
                                                        state[f"absmax{n}"])

    @staticmethod
    def _read(state: dict[str, Any], n: int, shape: torch.Size) -> Tensor:
        """Moment ``n`` in fp32, shaped like the weight as the pass takes it: the fp32 state itself (updated in
        place), or its codes dequantized with bitsandbytes' op."""
        stored = state[f"state{n}"]
        if stored.dtype != torch.uint8:
            return stored.view(shape)
        return _compat.bnb_dequantize_blockwise(stored, state[f"absmax{n}"], state[f"qmap{n}"], BLOCK).view(shape)

    @abstractmethod
    def math(self, target: Tensor, grad: Tensor, moments: list[Tensor], config: dict[str, Any], step: int,
             coded: bool) -> None:
        """The kernel's update of the fp32 weight ``target`` and ``moments`` in place, with the ops of bitsandbytes'
        CPU reference for 8-bit (``coded``) or fp32 states."""
