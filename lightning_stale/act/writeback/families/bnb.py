"""What the bitsandbytes families share: their state (8-bit block-wise codes or fp32), their per-parameter config and
step counter, and a step that follows bitsandbytes' own reference implementation op for op.

bitsandbytes keeps, per parameter, ``state1`` (and ``state2``) as uint8 codes with one ``absmax`` per block of 256
elements (fp32 for parameters below ``min_8bit_size`` or with ``optim_bits=32``) and a Python int ``step``. The write
dequantizes the codes with its own op, updates the moments and the weight in fp32 with the ops of its CPU kernel (so
nearest rounding reproduces its weights and codes bit for bit), writes the weight with the chosen rounding and
requantizes the codes with its own op: its whole step, once. bitsandbytes steps parameter by parameter; so does this,
each parameter in pieces of whole blocks (:func:`pieces`), so that its temporaries (at most 32 bytes per element of a
piece) are a constant, not a multiple of the largest parameter. A block's codes depend on that block alone and a
piece's noise continues at its offset: the pieces write the bits one pass over the whole parameter would. States that
bitsandbytes created strided (the parameter was at its first step; it then makes the parameter contiguous, not them)
are stepped whole, in their shape.

On CUDA its fused kernels order some ops differently; the write-back computes its CPU kernel's update there too, but
treats non-finite gradient elements as its CUDA kernels do (:func:`cuda_kernels`; each family's :meth:`math` says
how), where its CPU kernel lets them run through the arithmetic.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale.act.writeback import kernels
from lightning_stale.act.writeback.family import Columns, Family, Member, Write, member_columns
from lightning_stale.act.writeback.kernels import noise, noise_keys, weight_target, write_weight
from lightning_stale.adapters.bnb_layout import BLOCK
from lightning_stale.formats.noise import as_int32


def cuda_kernels(device: torch.device) -> bool:
    """Whether bitsandbytes steps parameters on ``device`` with its CUDA kernels (ROCm devices, "cuda" to torch, run
    the same source), whose treatment of non-finite gradient elements the write-back then follows."""
    return device.type == "cuda"


def pieces(numel: int, device: torch.device) -> list[slice]:
    """The pieces a flat parameter of ``numel`` elements on ``device`` is stepped in: whole blocks,
    :func:`.kernels.eager_chunk` elements each (rounded down to a block), the last one shorter."""
    size = max(kernels.eager_chunk(device) // BLOCK, 1) * BLOCK
    return [slice(start, start + size) for start in range(0, numel, size)]


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
        cuda = cuda_kernels(members[0].local.device)
        for i, (member, w, c, g, state) in enumerate(zip(members, columns.lists["w"], columns.lists["c"], grads,
                                                          columns.lists["state"])):
            config = self.optimizer.get_config(*member.position, member.group)
            state["step"] += 1
            flat = columns.flat and all(state[f"state{n}"].is_contiguous() for n in range(1, self.states + 1))
            for part in pieces(w.numel(), w.device) if flat else [None]:
                self._piece(part, w, c, g, state, config, write.weights, None if keys is None else keys[i], cuda)

    def _piece(self, part: slice | None, w: Tensor, c: Tensor | None, g: Tensor, state: dict[str, Any],
               config: dict[str, Any], rounding: str, keys: Tensor | None, cuda: bool) -> None:
        """The step of the elements ``part`` of one parameter (a slice of its flat elements starting at a block; None:
        all of them, each tensor viewed in the state's shape): read, compute, write, requantize."""
        shape = state["state1"].shape

        def take(t: Tensor) -> Tensor:
            return t.view(shape) if part is None else t.view(-1)[part]

        blocks = slice(None) if part is None else slice(part.start // BLOCK, -(-part.stop // BLOCK))
        w, c, g = take(w), None if c is None else take(c), take(g)
        coded = state["state1"].dtype == torch.uint8
        moments = [take(state[f"state{n}"]) for n in range(1, self.states + 1)]
        if coded:  # the codes as fp32 values, with bitsandbytes' op (else the fp32 state itself, updated in place)
            moments = [_compat.bnb_dequantize_blockwise(codes, state[f"absmax{n}"][blocks], state[f"qmap{n}"], BLOCK)
                       for n, codes in enumerate(moments, start=1)]
        target = weight_target(w, c)
        written = self.math(target, g.float(), moments, config, state["step"], coded, cuda)
        if keys is not None and part is not None and part.start:  # the noise of the piece's elements
            keys = torch.cat((keys[:1] + as_int32(part.start), keys[1:]))
        bits = None if keys is None else noise(w, keys)
        if written is None:
            write_weight(w, c, target, rounding, bits)
        else:  # the elements outside ``written`` keep their weight and residual as they are
            new_w, new_c = torch.empty_like(w), None if c is None else torch.empty_like(c)
            write_weight(new_w, new_c, target, rounding, bits)
            w.copy_(torch.where(written, new_w, w))
            if c is not None:
                c.copy_(torch.where(written, new_c, c))
        if coded:
            for n, values in enumerate(moments, start=1):
                _compat.bnb_quantize_blockwise_into(values, state[f"qmap{n}"], BLOCK, take(state[f"state{n}"]),
                                                    state[f"absmax{n}"][blocks])

    @abstractmethod
    def math(self, target: Tensor, grad: Tensor, moments: list[Tensor], config: dict[str, Any], step: int,
             coded: bool, cuda: bool) -> Tensor | None:
        """The kernel's update of the fp32 weight ``target`` and ``moments`` in place, with the ops of bitsandbytes'
        CPU reference for 8-bit (``coded``) or fp32 states, and where ``cuda``, the CUDA kernel's treatment of
        non-finite gradient elements; returns the elements whose weight is written (bool), or None for all."""
