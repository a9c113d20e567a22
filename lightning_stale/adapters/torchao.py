"""Adapter for torchao's low-bit Adam/AdamW (``torchao.optim``): 8-bit, 4-bit, FP8 and plain fallbacks.

Layout (``optimizer.state[p]``): ``step`` (0-d float tensor), ``exp_avg`` -> m (beta1), ``exp_avg_sq`` -> v (beta2),
``max_exp_avg_sq`` with amsgrad (not a slot, reset with v). Each buffer is one of

- ``OptimState8bit``: uint8 ``codes`` into torchao's 256-entry dynamic map ``qmap`` (same map as bitsandbytes),
  per-block ``scale`` (block 256) -> format ``"int8_dynamic"``;
- ``OptimState4bit``: two 4-bit codes per byte (high nibble first), block 128. m uses a 16-entry signed dynamic map
  (3 exponent bits, zero at index 7) -> ``"torchao_4bit_dynamic"``; v a *linear* map without zero (1/16 ... 1) ->
  ``"torchao_4bit_linear_nozero"`` (not E2M2);
- ``OptimStateFp8``: ``float8_e4m3fn`` codes times a per-block scale (block max / 448) -> ``"fp8_e4m3"``;
- a plain tensor in the parameter's dtype (parameters with < 4096 elements or not a multiple of the block).

``lr`` and ``step`` are tensors that the compiled step reads; they are edited only in place.
"""

from __future__ import annotations


from torch import Tensor

from lightning_stale._compat import local_tensor, torchao_optimizer_classes, torchao_state_classes
from lightning_stale.adapters.layouts import FLOAT_FORMATS, BlockFp8Slot, BlockQmapSlot, FloatSlot, Packed4bitSlot
from lightning_stale.adapters.protocol import Moment, SharedStepAdapter, Slot
from lightning_stale.adapters.restart import restarted_v
from lightning_stale.formats.base import pack_nibbles, round_up_blockwise
from lightning_stale.formats.floats import round_up_float
from lightning_stale.formats.fp8 import round_up_fp8_blockwise

OptimState8bit, OptimState4bit, OptimStateFp8 = torchao_state_classes()
KEYS: tuple[tuple[str, Moment, int], ...] = (("exp_avg", "m", 0), ("exp_avg_sq", "v", 1))


def buffer_slot(p: Tensor, buf: Tensor, key: str, moment: Moment, beta: float) -> Slot:
    """The slot reading one torchao state buffer, whatever its storage (this process's shard under FSDP2)."""
    buf = local_tensor(buf)
    if isinstance(buf, OptimState8bit):
        return BlockQmapSlot(p, moment, beta, "int8_dynamic", key, stored=buf.codes,
                             scale=buf.scale, qmap=buf.qmap, block_size=buf.block_size)
    if isinstance(buf, OptimState4bit):
        fmt = "torchao_4bit_dynamic" if buf.signed else "torchao_4bit_linear_nozero"
        return Packed4bitSlot(p, moment, beta, fmt, key, stored=buf.codes, scale=buf.scale,
                              qmap=buf.qmap, block_size=buf.block_size)
    if isinstance(buf, OptimStateFp8):
        return BlockFp8Slot(p, moment, beta, "fp8_e4m3", key, stored=buf.codes, scale=buf.scale,
                            block_size=buf.block_size)
    return FloatSlot(p, moment, beta, FLOAT_FORMATS.get(buf.dtype, str(buf.dtype)), key, tensor=buf)


def zero_buffer(buf: Tensor) -> None:
    """Zero a state buffer in place, as ``_new_buffer`` creates it (codes and scale zero)."""
    buf = local_tensor(buf)
    if isinstance(buf, (OptimState8bit, OptimState4bit, OptimStateFp8)):
        buf.codes.zero_()
        buf.scale.zero_()
    else:
        buf.zero_()


def write_rounded_up(buf: Tensor, target: Tensor) -> None:
    """Store non-negative fp32 ``target`` into ``buf`` in place, each value rounded up onto the buffer's grid."""
    buf = local_tensor(buf)
    if isinstance(buf, OptimState8bit):
        codes, absmax = round_up_blockwise(target, buf.qmap, buf.block_size)
        buf.codes.view(-1).copy_(codes)
        buf.scale.copy_(absmax.clip(1e-12))
    elif isinstance(buf, OptimState4bit):
        codes, absmax = round_up_blockwise(target, buf.qmap, buf.block_size)
        buf.codes.view(-1).copy_(pack_nibbles(codes))
        buf.scale.copy_(absmax.clip(1e-12))
    elif isinstance(buf, OptimStateFp8):
        codes, scale = round_up_fp8_blockwise(target.reshape(-1), buf.block_size)
        buf.codes.view(-1).copy_(codes)
        buf.scale.copy_(scale)
    else:
        buf.copy_(round_up_float(target, buf.dtype).reshape(buf.shape))


class TorchAOAdapter(SharedStepAdapter):
    """``torchao.optim`` Adam8bit/AdamW8bit/Adam4bit/AdamW4bit/AdamFp8/AdamWFp8 (and ``_AdamW``).

    One ``step`` tensor serves both moments: a full reset (codes, scales and ``step`` zeroed in place) is exact;
    an m-only reset zeroes m and keeps ``step``; a v-only reset writes the safe restart of :mod:`.restart`.
    """

    family = "torchao"

    def slots(self) -> list[Slot]:
        out: list[Slot] = []
        for group, p, state in self.stepped():
            for key, moment, beta_index in KEYS:
                out.append(buffer_slot(p, state[key], key, moment, group["betas"][beta_index]))
        return out

    def reset_all(self, state: dict) -> None:
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                zero_buffer(state[key])
        state["step"].zero_()

    def reset_m(self, state: dict) -> None:
        zero_buffer(state["exp_avg"])

    def restart_v(self, group: dict, p: Tensor, state: dict) -> None:
        step = int(state["step"])
        if step == 0:
            zero_buffer(state["exp_avg_sq"])
            return
        beta1, beta2 = group["betas"]
        m_hat = buffer_slot(p, state["exp_avg"], "exp_avg", "m", beta1).value() / (1.0 - beta1**step)
        grad = local_tensor(p.grad)
        if grad is not None and group["weight_decay"] != 0 and not self.optimizer.is_adamw:
            grad = grad.float() + group["weight_decay"] * local_tensor(p).detach().float()
        target = restarted_v(m_hat, None if grad is None else grad.reshape(-1), step, beta2)
        for key in ("exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                write_rounded_up(state[key], target)


ADAPTERS = {cls: TorchAOAdapter for cls in torchao_optimizer_classes()}
