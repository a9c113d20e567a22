"""Weight write-back: take over the bf16/fp16 weight write of an Adam-family optimizer the user already has.

A step's update ``lr * m_hat / (sqrt(v_hat) + eps)`` smaller than half a bf16 weight's grid gap (about |w| / 256)
rounds away. :class:`WeightWriteBack` suppresses the optimizer's own parameter write (its group lr is 0 for the step,
so it still updates its moments and step counter), then recomputes the update in fp32 from the optimizer's own
updated state, exactly as that optimizer computes it, and writes the weight with nearest, stochastic or compensated
(Kahan) rounding. bitsandbytes' 8-bit optimizers update the weight from this step's fp32 moments before requantizing
them, so for those the write-back computes the same fp32 moments from the stored codes and the gradient and writes the
weight before their step (right after the closure), which then updates the moments with the lr at 0. fp32 parameters are left to the optimizer untouched. Parameters are
written in chunks laid end to end in flat buffers; stochastic rounding runs as one fused pass per chunk
(``torch.compile`` where a compiler works, the same ops eagerly otherwise).

torch.optim keeps a bf16 parameter's moments in bf16, where ``v * 0.999`` rounds back to ``v``: with ``moments=
"stochastic"`` the write-back owns those parameters' whole step. Their gradient is hidden from torch's step (which then
skips them), and the moments are computed in fp32 from the stored ones and the gradient, stored with stochastic
rounding, and the weight is updated from the unrounded fp32 moments.

Supported: ``torch.optim.Adam``/``AdamW`` (for-loop, foreach, fused), bitsandbytes Adam/AdamW 32-bit, 8-bit
block-wise and paged, and :class:`lightning_stale.optim.QuantizedAdamW`.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale._compat import local_tensor, shard_flat_start
from lightning_stale.formats.base import NOISE_BITS
from lightning_stale.formats.floats import FloatFormat, stochastic_round_float

Rounding = Literal["stochastic", "compensated", "nearest"]
ROUNDINGS: tuple[str, ...] = ("stochastic", "compensated", "nearest")
# Who writes torch.optim's moments: the optimizer, or the write-back with that rounding ("nearest": conformance only).
MomentRounding = Literal["optimizer", "stochastic", "nearest"]
MOMENT_ROUNDINGS: tuple[str, ...] = ("optimizer", "stochastic", "nearest")
# The monitor's ``weights`` option: off, or a rounding of the write-back ("nearest" is the conformance mode only);
# "<rounding>+moments" also has the write-back compute torch.optim's bf16/fp16 moments and round them stochastically.
WEIGHT_WRITES: tuple[str, ...] = ("off", "stochastic", "compensated", "stochastic+moments", "compensated+moments")
LOW_PRECISION = (torch.bfloat16, torch.float16)
SUPPORTED = (
    "torch.optim.Adam/AdamW (for-loop, foreach, fused; no amsgrad, capturable or differentiable), "
    "bitsandbytes Adam/AdamW 32-bit, 8-bit block-wise and paged, lightning_stale.optim.QuantizedAdamW"
)
_MASK32 = (1 << 32) - 1
_NOISE_MASK = (1 << NOISE_BITS) - 1  # NOISE_BITS <= 16: one 32-bit hash serves two noises (its low and high halves)
_MOMENT_STREAM = 0x6D6F6D73  # the moments' noise hashes the weights' hash xor this
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_FP16_MAX = float(torch.finfo(torch.float16).max)
COMPILE_MIN_NUMEL = 1 << 16  # smaller chunks run the write-back's math eagerly (a compile costs seconds, once)
_compile_failed = False  # set when torch.compile failed here once; the eager ops are used from then on
_BNB_BLOCK = 256  # bitsandbytes 8-bit optimizer states are quantized in blocks of 256 elements
# Elements written per batched pass: the fp32 copies and the noise of one pass are its only transient memory, so the
# peak stays bounded (about 30 bytes per element of a chunk) whatever the size of the model or of its largest tensor.
# On an accelerator large passes amortize the kernel launches (its caching allocator reuses the buffers); on a CPU a
# small pass stays in cache and malloc reuses its buffers, where large ones are mapped and page-faulted afresh.
CHUNK_ELEMENTS = 1 << 22
CPU_CHUNK_ELEMENTS = 1 << 18

# How the fp32 weight is computed from (w, m, v) and the per-parameter scalars, one per optimizer implementation:
#   "addcdiv":   w * decay, then w + (-step_size) * m / (sqrt(v) / bc2_sqrt + eps)      torch.optim, bnb 8-bit CPU
#   "bnb32":     w * decay, then w + step_size * (m / (sqrt(v) + eps * c2))             bnb 32-bit CPU
#   "bnb_cuda":  w + step_size * (m / (sqrt(v) + eps * c2)), then * decay              bnb CUDA kernels (decay after)
#   "quantized": w * decay, then w + (m * step_size) / (sqrt(v) / bc2_sqrt + eps)       QuantizedAdamW
Formula = Literal["addcdiv", "bnb32", "bnb_cuda", "quantized"]


def _mix32(x: int) -> int:
    """A 32-bit integer hash (murmur3 finalizer) in Python ints: per-parameter keys without device traffic."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _key(seed: int, step: int, index: int) -> int:
    """The noise key of (seed, optimizer step, parameter index)."""
    return _mix32(_mix32(_mix32(seed) ^ step) ^ index)


def _int32(x: int) -> int:
    """``x`` modulo 2^32 as a signed 32-bit value (what an int32 tensor holds)."""
    x &= _MASK32
    return x - (1 << 32) if x >= 1 << 31 else x


def _hash(x: Tensor) -> Tensor:
    """A 32-bit integer hash (lowbias32) of int32 ``x``: two's-complement wrapping products and logical shifts by
    masking, so the bits equal the unsigned 32-bit hash on every device, eager or compiled (int32: half the traffic of
    int64)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x2C1B3C6D
    return x ^ ((x >> 16) & 0xFFFF)


def noise_bits(numel: int, seed: int, step: int, index: int, device: torch.device, start: int = 0) -> Tensor:
    """Uniform int32 noise in [0, 2^NOISE_BITS) for the ``numel`` elements from flat position ``start`` on, a
    counter-based hash of each element's index keyed by (seed, optimizer step, parameter index): no RNG state, no
    rank, so replicated ranks draw the same, and a parameter written in chunks draws what it would draw whole."""
    x = torch.arange(numel, dtype=torch.int32, device=device).add_(_int32(_key(seed, step, index) + start))
    return _hash(x).bitwise_and_(_NOISE_MASK)


def _on_grid(x: Tensor, dtype: torch.dtype, noise: Tensor) -> Tensor:
    """fp32 ``x`` stochastically rounded onto ``dtype``'s grid (see :func:`stochastic_round`), still in fp32: Inductor
    vectorizes the bit cast back to fp32, not one followed by a conversion to bf16."""
    if dtype == torch.bfloat16:  # add 16 random bits below bf16's mantissa and truncate them
        shift = 16 - NOISE_BITS
        bits = x.clamp(-_BF16_MAX, _BF16_MAX).view(torch.int32) + (noise << shift if shift else noise)
        return (bits & -65536).view(torch.float32)
    return stochastic_round_float(x, 10, -14, _FP16_MAX, noise)


def stochastic_round(x: Tensor, dtype: torch.dtype, noise: Tensor) -> Tensor:
    """fp32 ``x`` rounded to ``dtype`` (bf16 or fp16) stochastically: up with probability (x - lower) / ulp, driven by
    ``noise`` (int32 in [0, 2^NOISE_BITS), shaped like ``x``); saturates at the format's largest finite value."""
    return _on_grid(x, dtype, noise).to(dtype)


def _fused_write(w: Tensor, m: Tensor, v: Tensor, g: Tensor | None, counter: Tensor | None, hyper: Tensor,
                 dtype: torch.dtype, round_weights: bool, round_moments: bool) -> tuple[Tensor, Tensor | None,
                                                                                    Tensor | None]:
    """A chunk of parameters laid end to end in fp32: with the gradient ``g`` (torch.optim Adam/AdamW), this step's
    moments from the stored ``m``, ``v`` (else those are this step's already), the weight update from them in any
    supported optimizer's form (see ``Formula``), and stochastic rounding onto ``dtype``'s grid where asked (noise:
    the hash of ``counter``, the moments' a second hash of it).

    Separate products and sums, no fused ops, and a correctly rounded square root (Inductor's fp32 one; eagerly
    through fp64, as torch's eager fp32 CPU sqrt is off by an ulp for a fifth of inputs): eager and compiled results
    are bit-identical. ``hyper``: fp32 (1 - beta1, beta2, 1 - beta2, gradient sign, coupled weight decay, decay before
    the update, decay after it, divisor of sqrt(v), eps, step size, bound of ``|m / denom|``). Returns w and, with
    ``g``, m and v, in fp32: on ``dtype``'s grid where rounded stochastically, else to be rounded to nearest by the
    copy into ``dtype``."""
    one_minus_beta1, beta2, one_minus_beta2, sign, l2, decay, decay_after, bc2_sqrt, eps, step_size, bound = \
        hyper.unbind()
    if g is not None:
        g = g * sign + w * l2
        m = m + (g - m) * one_minus_beta1
        v = v * beta2 + (g * g) * one_minus_beta2
    root = v.sqrt() if torch.compiler.is_compiling() else v.double().sqrt().float()  # both correctly rounded
    ratio = (m / (root / bc2_sqrt + eps)).clamp(-bound, bound)
    w = (w * decay + step_size * ratio) * decay_after
    bits = None if counter is None else _hash(counter)
    if round_weights:
        w = _on_grid(w, dtype, bits & _NOISE_MASK)
    if g is None:
        return w, None, None
    if round_moments:
        bits = _hash(bits ^ _MOMENT_STREAM)
        m, v = _on_grid(m, dtype, bits & _NOISE_MASK), _on_grid(v, dtype, (bits >> 16) & _NOISE_MASK)
    return w, m, v


@cache
def _compiled_fused_write() -> Callable[..., tuple[Tensor, Tensor | None, Tensor | None]]:
    """:func:`_fused_write` compiled with dynamic shapes: one fused loop per chunk (dynamo specializes it per dtype,
    gradient or not, and rounding)."""
    return torch.compile(_fused_write, dynamic=True)


def _run_fused_write(*args: Any) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`_fused_write`, compiled for chunks of at least COMPILE_MIN_NUMEL elements where a compiler works (the
    same bits, faster), else eagerly."""
    global _compile_failed
    w = args[0]
    if w.numel() >= COMPILE_MIN_NUMEL and not _compile_failed and (w.device.type != "cpu"
                                                                   or _compat.compiler_available()):
        try:
            return _compiled_fused_write()(*args)
        except Exception as error:  # noqa: BLE001 - no working compiler here: the eager ops give the same bits
            _compile_failed = True
            _compat.log.info("[lightning_stale] the compiled weight write-back is unavailable (%s); using eager ops",
                             error)
    return _fused_write(*args)


# (start, stop) -> m and v of those flat elements: fp32, or views of torch's stored bf16/fp16 moments
Moments = Callable[[int, int], tuple[Tensor, Tensor]]


class _Entry:
    """One parameter the write-back handles at this step: how to read its moments, and the scalars of its update.

    ``moments(start, stop)`` reads the moments of a flat range only when that range is written, so no more than one
    chunk of them exists in fp32 at a time; ``split`` says whether the parameter may be written in ranges (its moments
    can be read by range). torch.optim parameters carry what computing their moments takes (``adam``: 1 - beta1,
    beta2, 1 - beta2, the gradient's sign, coupled weight decay) and, where the write-back computes them, the gradient
    hidden from torch's step (``grad``; ``moments`` then reads the stored moments from before the step)."""

    __slots__ = ("index", "param", "moments", "split", "formula", "decay", "step_size", "bc2_sqrt", "eps", "step",
                 "bound", "start", "adam", "grad")

    def __init__(self, index: int, param: Tensor, moments: Moments, split: bool, formula: Formula, decay: float,
                 step_size: float, bc2_sqrt: float, eps: float, step: int, bound: float | None = None,
                 start: int = 0, adam: tuple[float, ...] = (0.0, 1.0, 0.0, 1.0, 0.0),
                 grad: Tensor | None = None) -> None:
        self.index, self.param, self.moments, self.split, self.formula = index, param, moments, split, formula
        self.decay, self.step_size, self.bc2_sqrt, self.eps, self.step = decay, step_size, bc2_sqrt, eps, step
        self.bound = bound  # |m / denom| limit for moments stored as codes (see _fp32_update), else None
        self.start = start  # flat position of ``param``'s first element in the whole parameter (a DTensor shard's)
        self.adam, self.grad = adam, grad

    def hyper(self) -> tuple[float, ...]:
        """The scalars of :func:`_fused_write` for this parameter's formula."""
        after = self.formula == "bnb_cuda"
        scaled_eps = self.formula in ("bnb32", "bnb_cuda")  # sqrt(v) + eps * c2
        return (*self.adam, 1.0 if after else self.decay, self.decay if after else 1.0,
                1.0 if scaled_eps else self.bc2_sqrt, self.eps * self.bc2_sqrt if scaled_eps else self.eps,
                self.step_size, math.inf if self.bound is None else self.bound)


def _flat_range(tensor: Tensor, start: int, stop: int) -> Tensor:
    """Flat elements ``[start, stop)`` of ``tensor`` as a view; a non-contiguous tensor is only ever taken whole."""
    if tensor.is_contiguous():
        flat = tensor.view(-1)
        return flat if start == 0 and stop == flat.numel() else flat[start:stop]
    if (start, stop) != (0, tensor.numel()):
        raise ValueError("a non-contiguous tensor is written whole")
    return tensor


def _chunks(entries: list[_Entry], limit: int) -> Iterable[list[tuple[_Entry, int, int]]]:
    """Batches of (entry, start, stop) flat ranges of at most ``limit`` elements in all; a parameter that cannot be
    split forms a batch of its own whatever its size."""
    batch: list[tuple[_Entry, int, int]] = []
    size = 0
    for entry in entries:
        numel = entry.param.numel()
        step = limit if entry.split and entry.param.is_contiguous() else max(numel, 1)
        for start in range(0, numel, step):
            stop = min(numel, start + step)
            if batch and size + stop - start > limit:
                yield batch
                batch, size = [], 0
            batch.append((entry, start, stop))
            size += stop - start
    if batch:
        yield batch


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` (or the optimizer itself)."""
    inner = getattr(optimizer, "_optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _refuse(optimizer: torch.optim.Optimizer, why: str) -> ValueError:
    return ValueError(f"WeightWriteBack cannot take over {type(optimizer).__name__}: {why}. Supported: {SUPPORTED}.")


def _family(optimizer: torch.optim.Optimizer) -> str:
    """``"torch"``, ``"bnb"`` or ``"quantized"``; ValueError naming the class and what is supported otherwise."""
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for group in optimizer.param_groups:
            for flag in ("amsgrad", "capturable", "differentiable"):
                if group.get(flag):
                    raise _refuse(optimizer, f"{flag}=True is not supported")
            if any(isinstance(beta, Tensor) for beta in group["betas"]):
                raise _refuse(optimizer, "tensor betas are not supported")
        return "torch"
    try:
        from lightning_stale.optim import QuantizedAdamW
    except ImportError:  # the package's optimizer moved or is unavailable: only the other families apply
        QuantizedAdamW = None  # noqa: N806
    if QuantizedAdamW is not None and type(optimizer) is QuantizedAdamW:
        return "quantized"
    module = type(optimizer).__module__
    if module.startswith("bitsandbytes."):
        from bitsandbytes.optim.optimizer import Optimizer2State

        if not isinstance(optimizer, Optimizer2State) or getattr(optimizer, "optimizer_name", None) != "adam":
            raise _refuse(optimizer, "only bitsandbytes' Adam/AdamW family (kernel 'adam') is supported")
        if optimizer.args.max_unorm > 0:
            raise _refuse(optimizer, "max_unorm > 0 (update-norm clipping) is not supported")
        return "bnb"
    raise _refuse(optimizer, "not a supported optimizer family")


class WeightWriteBack:
    """Owns the weight write of ``optimizer``'s bf16/fp16 parameters through torch's step pre/post hooks.

    Args:
        optimizer: a supported Adam-family optimizer (or a ``LightningOptimizer`` around one).
        rounding: ``"stochastic"`` (no memory), ``"compensated"`` (a Kahan buffer in the parameter's dtype) or
            ``"nearest"`` (reproduces the optimizer's own write; the conformance mode).
        params: the parameters to take over (default: every bf16/fp16 parameter of the optimizer, at each step).
        seed: the stochastic-rounding key; noise depends on (seed, the optimizer's step, the parameter's index).
        moments: ``"optimizer"`` (the optimizer writes its moments), or, for torch.optim Adam/AdamW only, the
            rounding with which the write-back writes the bf16/fp16 moments of the parameters it takes over
            (``"stochastic"``; ``"nearest"``: the conformance mode), computing them in fp32 itself.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        rounding: Rounding = "stochastic",
        params: Iterable[Tensor] | None = None,
        seed: int = 0,
        moments: MomentRounding = "optimizer",
    ) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if moments not in MOMENT_ROUNDINGS:
            raise ValueError(f"moments must be one of {MOMENT_ROUNDINGS}, got {moments!r}")
        self.optimizer = _unwrap(optimizer)
        self.family = _family(self.optimizer)
        if moments != "optimizer" and self.family != "torch":
            raise _refuse(self.optimizer, f"moments={moments!r} applies to torch.optim Adam/AdamW only (this optimizer "
                                          "rounds its own state)")
        self.rounding: str = rounding
        self.moments: str = moments
        self.seed = int(seed)
        self._chosen = None if params is None else {id(p) for p in params}
        if self._chosen is not None:
            known = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            if not self._chosen <= known:
                raise ValueError("params must be parameters of the optimizer")
        if self.family == "bnb":
            self._check_bnb_overrides()
        if rounding == "compensated" and _sharded(self._params()):
            raise ValueError("rounding='compensated' is not supported on sharded (DTensor, FSDP2) parameters: "
                             "Lightning's distributed checkpoint saves callback state from rank 0 only, so the other "
                             "ranks' compensation buffers would be lost on resume; use 'stochastic' (no state)")
        self.compensation: dict[int, Tensor] = {}  # parameter index -> Kahan buffer (parameter dtype)
        self._saved_lrs: list[Any] | None = None
        self._steps_before: dict[int, int] = {}
        self._hidden: dict[int, tuple[Tensor, Tensor]] = {}  # parameter index -> (param, gradient hidden from torch)
        self._ahead: set[int] = set()  # indices of the parameters written before this step's update (bitsandbytes)
        # the post-step hook runs first: every other one sees the written weights and the given-back gradients
        self._handles = [
            self.optimizer.register_step_pre_hook(self._pre_hook),
            _compat.register_first_step_post_hook(self.optimizer, self._post_hook),
            _compat.StepErrorHook(self.optimizer, self._undo_step),  # a failed step leaves the lr as it was
        ]

    # ----------------------------------------------------------------------------------------------------------------
    # Hooks

    def take_over(self, params: Iterable[Tensor]) -> None:
        """Take over the weight write of ``params`` too, from the next step on (the automatic remedy's switch)."""
        if self._chosen is not None:
            self._chosen |= {id(p) for p in params}

    def real_lr(self, group: dict[str, Any]) -> Any:
        """The group's learning rate, also while a step runs with it zeroed (readers inside the step hooks)."""
        for saved_group, lr in self._saved_lrs or ():
            if saved_group is group:
                return lr
        return group["lr"]

    def takes_over(self, param: Tensor) -> bool:
        """Whether the write-back takes over ``param``'s write (once it is stored below fp32)."""
        return self._chosen is None or id(param) in self._chosen

    def describe(self) -> str:
        """How the write-back writes, in words (for messages)."""
        weights = "compensated summation" if self.rounding == "compensated" else f"{self.rounding} rounding"
        if self.moments == "optimizer":
            return weights
        if self.rounding == self.moments:
            return f"{weights} of the weights and moments"
        return f"{weights} of the weights and {self.moments} rounding of the moments"

    @property
    def handled(self) -> int:
        """How many parameters the write-back takes over now (stored below fp32 and chosen)."""
        return len(self._handled())

    def close(self) -> None:
        """Remove the hooks (and restore the lr and the gradients, should a failed step have left them hidden)."""
        self._undo_step()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _handled(self) -> list[tuple[int, tuple[int, int], dict[str, Any], Tensor]]:
        """(index, (group index, index in group), group, param) of the parameters taken over now: chosen, stored
        below fp32. ``index`` counts every parameter of the optimizer in order: the same on every rank."""
        out = []
        index = 0
        for gindex, group in enumerate(self.optimizer.param_groups):
            for pindex, param in enumerate(group["params"]):
                if param.dtype in LOW_PRECISION and (self._chosen is None or id(param) in self._chosen):
                    out.append((index, (gindex, pindex), group, param))
                index += 1
        return out

    def _group_mates(self, handled: list[tuple[int, tuple[int, int], dict[str, Any], Tensor]]
                     ) -> list[tuple[int, tuple[int, int], dict[str, Any], Tensor]]:
        """The other parameters of the groups whose lr the step zeroes (fp32 ones, or those not taken over yet): the
        write-back writes them too, with the optimizer's own nearest rounding, or they would not move at all."""
        groups, taken = {id(group) for _, _, group, _ in handled}, {index for index, _, _, _ in handled}
        out = []
        index = 0
        for gindex, group in enumerate(self.optimizer.param_groups):
            for pindex, param in enumerate(group["params"]):
                if id(group) in groups and index not in taken:
                    out.append((index, (gindex, pindex), group, param))
                index += 1
        return out

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Zero the lr of the groups holding taken-over parameters and remember each one's step counter; once the
        gradients exist (after the closure, which runs inside the step), hide those of the parameters whose moments
        the write-back computes, and write bitsandbytes' 8-bit parameters ahead of its update."""
        self._undo_step()  # an earlier step failed where the error hook could not see it (its wrapper replaced)
        self._ahead = set()
        handled = self._handled()
        if not handled:
            return None
        every = handled + self._group_mates(handled)
        self._steps_before = dict(zip((index for index, _, _, _ in every),
                                      self._step_counts([param for _, _, _, param in every])))
        groups = {id(group): group for _, _, group, _ in handled}
        self._saved_lrs = [(group, group["lr"]) for group in groups.values()]
        for group in groups.values():
            lr = group["lr"]
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, Tensor) else 0.0
        if self.family == "bnb":
            self._check_bnb_overrides()
        owned = [(index, param) for index, _, _, param in handled if self._owns_moments(param)]
        ahead = self.family == "bnb"
        # Gradients are hidden and bitsandbytes' weights written in the closure (one is given where there is none):
        # after every pre-step hook, right before the optimizer's update. torch passes the step's own args, the
        # optimizer first: the closure is args[1] or kwargs["closure"]. An error restores the lr (StepErrorHook).
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None and not owned and not ahead:
            return None

        def guarded() -> Any:
            loss = None if closure is None else closure()
            self._hide_grads(owned)
            if ahead:
                self._write_ahead()
            return loss

        if "closure" in kwargs or len(args) < 2:
            return args, {**kwargs, "closure": guarded}
        return (args[0], guarded, *args[2:]), kwargs

    def _undo_step(self) -> None:
        """The real lr and the hidden gradients back: after a step that raised (its closure or the optimizer's own
        update), and on close."""
        self._restore_lr()
        self._give_back_grads()

    def _restore_lr(self) -> None:
        if self._saved_lrs is not None:
            for group, lr in self._saved_lrs:
                group["lr"] = lr
            self._saved_lrs = None

    def _owns_moments(self, param: Tensor) -> bool:
        """Whether the write-back computes ``param``'s moments at this step: asked for, the optimizer's moments are
        initialized and stored in the parameter's dtype, and no GradScaler hands the step a scale (its grads are then
        still scaled, and the fused kernel may skip the step)."""
        if self.moments == "optimizer" or getattr(self.optimizer, "grad_scale", None) is not None \
                or getattr(self.optimizer, "found_inf", None) is not None:
            return False
        state = self.optimizer.state.get(param)
        return bool(state) and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == param.dtype

    def _hide_grads(self, owned: list[tuple[int, Tensor]]) -> None:
        """Set aside the dense gradients of ``owned`` parameters (torch's step skips a parameter without one)."""
        for index, param in owned:
            grad = param.grad
            if grad is not None and not grad.is_sparse:
                self._hidden[index] = (param, grad)
                param.grad = None

    def _give_back_grads(self) -> dict[int, Tensor]:
        """Restore the hidden gradients (where no newer one took their place) and return them by parameter index."""
        hidden = {index: grad for index, (_, grad) in self._hidden.items()}
        for param, grad in self._hidden.values():
            if param.grad is None:
                param.grad = grad
        self._hidden = {}
        return hidden

    @torch.no_grad()
    def _post_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Restore the real lr, then write every parameter whose step counter advanced by one."""
        if self._saved_lrs is None:
            return
        lrs = {id(group): lr for group, lr in self._saved_lrs}
        self._restore_lr()
        hidden = self._give_back_grads()
        entries: list[tuple[_Entry, str]] = []
        counters: list[Tensor] = []  # step counters of the parameters whose whole step is the write-back's
        handled = self._handled()
        mated = self._group_mates(handled)
        mates = {index for index, _, _, _ in mated}
        todo = [(index, position, group, param) for index, position, group, param in handled + mated
                if self._steps_before.get(index) is not None and id(group) in lrs and index not in self._ahead]
        # the optimizer's counters after its step, where it kept them (one read for all; hidden ones did not move)
        unhidden = [param for index, _, _, param in todo if index not in hidden]
        after = dict(zip((id(p) for p in unhidden), self._step_counts(unhidden)))
        for index, position, group, param in todo:
            before = self._steps_before[index]
            grad = hidden.get(index)
            step = before + 1 if grad is not None else after[id(param)]
            if step != before + 1:  # skipped (no grad, GradScaler inf/nan): the weight stays as it is
                continue
            entry = self._entry(index, position, group, param, lrs[id(group)], step, grad)
            if grad is not None:
                counters.append(self.optimizer.state[param]["step"])
            entries.append((entry, "nearest" if index in mates else self.rounding))
        if counters:
            torch._foreach_add_(counters, 1)  # torch's own counters, in place (a fused step keeps them on the device)
        self._write_entries(entries)
        self._ahead = set()

    @torch.no_grad()
    def _write_ahead(self) -> None:
        """bitsandbytes' 8-bit parameters with a gradient, written now (right after the closure, before its update):
        from this step's fp32 moments, computed from the stored codes and the gradient as its kernel computes them
        before requantizing. Its update then runs with the lr at 0: it moves the moments and leaves these weights.
        Should that update raise, the weights stay written."""
        lrs = {id(group): lr for group, lr in self._saved_lrs or ()}
        handled = self._handled()
        mates = {index for index, _, _, _ in self._group_mates(handled)}
        entries: list[tuple[_Entry, str]] = []
        for index, position, group, param in handled + self._group_mates(handled):
            before = self._steps_before.get(index)
            if before is None or id(group) not in lrs or param.grad is None or param.grad.is_sparse:
                continue
            entry = self._bnb_ahead_entry(index, position, group, param, lrs[id(group)], before + 1)
            if entry is not None:
                entries.append((entry, "nearest" if index in mates else self.rounding))
                self._ahead.add(index)
        self._write_entries(entries)

    def _write_entries(self, entries: list[tuple[_Entry, str]]) -> None:
        """Write each entry with its rounding: stochastic rounding and moments computed here through
        :func:`_fused_write`, a batch per set of its scalars; nearest and compensated rounding with the optimizer's
        own op sequence. Batched per device, dtype and formula, in chunks."""
        by_key: dict[tuple[Any, ...], list[_Entry]] = defaultdict(list)
        for entry, rounding in entries:
            own = entry.grad is not None
            key = (entry.hyper(), own) if rounding == "stochastic" or own else rounding
            by_key[(entry.param.device, entry.param.dtype, entry.formula, entry.bound is not None, key)].append(entry)
        for (device, _, formula, bounded, key), group in by_key.items():
            for batch in _chunks(group, CPU_CHUNK_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS):
                if isinstance(key, str):
                    self._write(batch, formula, bounded, key)
                else:
                    self._write_fused(batch)

    # ----------------------------------------------------------------------------------------------------------------
    # Reading the optimizer's state

    def _step_counts(self, params: list[Tensor]) -> list[int]:
        """The optimizer's step counter of each of ``params`` (0 before its first step). Host-side for all supported
        non-fused optimizers; torch's fused and capturable forms keep them on the device: one read for all."""
        steps: list[Any] = []
        for param in params:
            state = self.optimizer.state.get(param)
            steps.append(0 if not state else state["step_m"] if self.family == "quantized" else state["step"])
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for i, step in enumerate(steps):
            if isinstance(step, Tensor) and step.device.type != "cpu":
                by_device[step.device].append(i)
        for indices in by_device.values():
            for i, value in zip(indices, torch.stack([steps[i].float() for i in indices]).tolist()):
                steps[i] = value
        return [int(step) for step in steps]

    def _entry(self, index: int, position: tuple[int, int], group: dict[str, Any], param: Tensor, lr: Any,
               step: int, grad: Tensor | None = None) -> _Entry:
        """The fp32 moments and the update scalars of ``param``, computed as its optimizer computes them; with the
        ``grad`` hidden from torch's step, what computing its moments takes."""
        lr = float(lr)
        state = self.optimizer.state[param]
        if self.family == "torch":
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
            decay = 1 - lr * wd if decoupled and wd != 0 else 1.0
            # FSDP2: the write works on this rank's shards (views of their storage); its noise follows each element's
            # position in the whole parameter, so no two shards draw alike and replicated ranks draw the same.
            m, v = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
            grad = None if grad is None else local_tensor(grad)
            split = m.is_contiguous() and v.is_contiguous() and (grad is None or grad.is_contiguous())
            step_size, bc2_sqrt = -(lr / (1 - beta1**step)), (1 - beta2**step) ** 0.5
            sign = -1.0 if group.get("maximize", False) else 1.0
            adam = (1 - beta1, beta2, 1 - beta2, sign, 0.0 if decoupled else wd)
            return _Entry(index, local_tensor(param), lambda a, b: (_flat_range(m, a, b), _flat_range(v, a, b)),
                          split, "addcdiv", decay, step_size, bc2_sqrt, group["eps"], step,
                          start=shard_flat_start(param), adam=adam, grad=grad)
        if self.family == "bnb":
            coded = state["state1"].dtype != torch.float32
            return self._bnb_entry(index, param, self.optimizer.get_config(*position, group), lr, step, coded,
                                   lambda a, b: (_bnb_moment(state, 1, a, b), _bnb_moment(state, 2, a, b)),
                                   bounded=coded)
        formats = [self.optimizer.moment_format(param, name) for name in ("m", "v")]
        states = [self.optimizer.moment_state(param, name) for name in ("m", "v")]

        def moments(start: int, stop: int) -> tuple[Tensor, Tensor]:  # a whole parameter: formats dequantize whole
            m, v = (fmt.dequantize(q).view(-1) for fmt, q in zip(formats, states))
            return m, v

        beta1, beta2 = group["betas"]
        step_v = int(state["step_v"])
        bc2_sqrt = math.sqrt(1 - beta2**step_v)
        bound = None
        if step_v == step and not all(isinstance(fmt, FloatFormat) for fmt in formats):
            bound = adam_ratio_bound(beta1, beta2, step) * bc2_sqrt
        return _Entry(index, param, moments, False, "quantized", 1 - lr * group["weight_decay"],
                      -lr / (1 - beta1**step), bc2_sqrt, group["eps"], step, bound)

    def _bnb_ahead_entry(self, index: int, position: tuple[int, int], group: dict[str, Any], param: Tensor, lr: Any,
                         step: int) -> _Entry | None:
        """``param``'s entry for a write ahead of bitsandbytes' 8-bit update: its moments are this step's in fp32,
        from the codes stored before it (zero before the first step) and the gradient, with bitsandbytes' own ops.
        None where its states are fp32 (read exactly after the step) or ``skip_zeros`` is set."""
        config = self.optimizer.get_config(*position, group)
        state = self.optimizer.state.get(param)
        coded = state["state1"].dtype == torch.uint8 if state else \
            config["optim_bits"] == 8 and param.numel() >= config["min_8bit_size"]
        if not coded or config["skip_zeros"]:
            return None
        beta1, beta2 = config["betas"][0], config["betas"][1]
        grad = param.grad

        def moments(start: int, stop: int) -> tuple[Tensor, Tensor]:
            g = _flat_range(grad, start, stop).float().reshape(-1)
            if state:
                m, v = _bnb_moment(state, 1, start, stop), _bnb_moment(state, 2, start, stop)
            else:
                m, v = torch.zeros_like(g), torch.zeros_like(g)
            return m.mul_(beta1).add_(g, alpha=1.0 - beta1), v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)

        return self._bnb_entry(index, param, config, lr, step, coded, moments, bounded=False,
                               split=grad.is_contiguous())

    @staticmethod
    def _bnb_entry(index: int, param: Tensor, config: dict[str, Any], lr: float, step: int, coded: bool,
                   moments: Moments, bounded: bool, split: bool = True) -> _Entry:
        """A bitsandbytes parameter's update scalars in the form of its kernel (CUDA, or the CPU ops for 8-bit or
        32-bit states); ``bounded``: ``moments`` reads requantized codes, so ``|m / denom|`` is clamped."""
        lr = float(lr)
        beta1, beta2 = config["betas"][0], config["betas"][1]
        wd, eps = config["weight_decay"], config["eps"]
        c1, c2 = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
        formula: Formula = "bnb_cuda" if param.device.type != "cpu" else "addcdiv" if coded else "bnb32"
        step_size = -lr / c1 if formula == "addcdiv" else -lr * c2 / c1
        bound = None
        if bounded:  # the denominator of "addcdiv" is sqrt(v) / c2 + eps, of the others sqrt(v) + eps * c2
            bound = adam_ratio_bound(beta1, beta2, step) * (c2 if formula == "addcdiv" else 1.0)
        return _Entry(index, param, moments, split, formula, 1.0 - lr * wd if wd > 0.0 else 1.0, step_size, c2, eps,
                      step, bound)

    def _check_bnb_overrides(self) -> None:
        """bitsandbytes' per-parameter ``lr`` overrides would escape the zeroed group lr: refuse them."""
        manager = getattr(self.optimizer, "mng", None)
        configs = (*getattr(manager, "pid2config", {}).values(), *getattr(manager, "index2config", {}).values())
        if any("lr" in config for config in configs):
            self._restore_lr()
            raise _refuse(self.optimizer, "a GlobalOptimManager per-parameter 'lr' override is not supported")

    # ----------------------------------------------------------------------------------------------------------------
    # The write

    def _write(self, batch: list[tuple[_Entry, int, int]], formula: Formula, bounded: bool, rounding: str) -> None:
        """One batched pass over flat ranges of parameters sharing a device, dtype and formula, in flat fp32 buffers
        (an op per step of the math, not per tensor): the fp32 target weight with the optimizer's own ops, then its
        nearest or compensated ``rounding``."""
        entries = [e for e, _, _ in batch]
        sizes = [b - a for _, a, b in batch]
        params = [_flat_range(e.param, a, b) for e, a, b in batch]
        weight, buffers = self._target(batch, params, sizes, rounding == "compensated")
        moments = [e.moments(a, b) for e, a, b in batch]
        ms, vs = (_fp32([pair[i] for pair in moments], sizes) for i in (0, 1))
        del moments
        _fp32_update(list(weight.split(sizes)), ms, vs, entries, formula, bounded)
        del ms, vs
        _store(params, weight, sizes, buffers)

    def _write_fused(self, batch: list[tuple[_Entry, int, int]]) -> None:
        """Flat ranges of parameters sharing a device, dtype and scalars through :func:`_fused_write`: weights, moments
        (and the hidden gradients, where the write-back computes the moments) gathered into flat fp32, the results
        written back in place."""
        sizes = [b - a for _, a, b in batch]
        params = [_flat_range(e.param, a, b) for e, a, b in batch]
        moments = [e.moments(a, b) for e, a, b in batch]
        ms, vs = [m for m, _ in moments], [v for _, v in moments]
        own = batch[0][0].grad is not None
        grad = _gather([_flat_range(e.grad, a, b) for e, a, b in batch], sizes) if own else None
        round_weights, round_moments = self.rounding == "stochastic", own and self.moments == "stochastic"
        device = params[0].device
        counter = _counters(batch, self.seed, device) if round_weights or round_moments else None
        hyper = _device_scalars(batch[0][0].hyper(), device)
        weight, buffers = self._target(batch, params, sizes, self.rounding == "compensated")
        weight, m, v = _run_fused_write(weight, _gather(ms, sizes), _gather(vs, sizes), grad, counter, hyper,
                                        params[0].dtype, round_weights, round_moments)
        _store(params, weight, sizes, buffers)
        if own:
            _scatter(ms, m, sizes)
            _scatter(vs, v, sizes)

    def _target(self, batch: list[tuple[_Entry, int, int]], params: list[Tensor], sizes: list[int],
                compensated: bool) -> tuple[Tensor, list[Tensor] | None]:
        """The weights being optimized, flat in fp32: the stored ones, plus their residuals (and those buffers'
        ranges) where ``compensated``."""
        weight = _gather(params, sizes)
        if not compensated:
            return weight, None
        buffers = [_flat_range(self._buffer(e), a, b) for e, a, b in batch]
        weight.add_(_gather(buffers, sizes))
        return weight, buffers

    def _buffer(self, entry: _Entry) -> Tensor:
        buffer = self.compensation.get(entry.index)
        if buffer is None:
            buffer = self.compensation[entry.index] = torch.zeros_like(entry.param)
        return buffer

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the rounding, the seed, the parameters taken over (by index; None: all) and the
        compensation buffers by parameter index."""
        chosen = None if self._chosen is None else [i for i, p in enumerate(self._params()) if id(p) in self._chosen]
        return {"rounding": self.rounding, "seed": self.seed, "params": chosen,
                "compensation": {i: b.clone() for i, b in self.compensation.items()}}

    def _params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: buffers are copied into existing ones in place (or created on the parameter's
        device), so the continuation is bit-identical."""
        if state_dict["rounding"] != self.rounding and (state_dict["rounding"], self.rounding) != \
                ("stochastic", "compensated"):  # a compensated write goes on from a zero residual; the reverse drops it
            raise ValueError(f"state_dict is for rounding {state_dict['rounding']!r}, this is {self.rounding!r}")
        self.seed = int(state_dict["seed"])
        params = self._params()
        chosen = state_dict.get("params")
        if chosen is not None and self._chosen is not None:
            self._chosen |= {id(params[int(i)]) for i in chosen}
        for index, saved in state_dict["compensation"].items():
            index = int(index)
            buffer = self.compensation.get(index)
            if buffer is None:
                buffer = self.compensation[index] = torch.zeros_like(params[index])
            buffer.copy_(saved)

    def resident_bytes(self) -> int:
        """Bytes the write-back keeps between steps (the compensation buffers)."""
        return sum(b.numel() * b.element_size() for b in self.compensation.values())


def _device_scalars(values: tuple[float, ...], device: torch.device) -> Tensor:
    """``values`` as an fp32 tensor on ``device`` without waiting for it: a plain host-to-device copy blocks the
    host until the device's queue has drained, a copy from pinned memory does not (the caching host allocator keeps
    the pinned block until the copy is done)."""
    host = torch.tensor(values, dtype=torch.float32)
    if device.type == "cpu":
        return host
    try:
        return host.pin_memory().to(device, non_blocking=True)
    except RuntimeError:  # no pinned memory for this device's backend: the blocking copy
        return host.to(device)


def _counters(batch: list[tuple[_Entry, int, int]], seed: int, device: torch.device) -> Tensor:
    """What :func:`noise_bits` hashes for each element of ``batch``'s flat ranges laid end to end (int32): its flat
    position in the whole parameter (a shard's count from the shard's start) plus the key of (seed, the parameter's
    step and index)."""
    sizes = [b - a for _, a, b in batch]
    x = torch.arange(sum(sizes), dtype=torch.int32, device=device)
    offsets = itertools.accumulate(sizes[:-1], initial=0)
    bases = [_int32(_key(seed, e.step, e.index) + e.start + a - o) for (e, a, _), o in zip(batch, offsets)]
    torch._foreach_add_(list(x.split(sizes)), bases)
    return x


def _views(flat: Tensor, like: list[Tensor], sizes: list[int]) -> list[Tensor]:
    """The consecutive ranges of ``flat`` (``sizes`` elements each) shaped like ``like`` (flat ranges as they are)."""
    return [part if t.dim() == 1 else part.view(t.shape) for part, t in zip(flat.split(sizes), like)]


def _gather(tensors: list[Tensor], sizes: list[int]) -> Tensor:
    """``tensors`` (``sizes`` elements each) copied end to end into one flat fp32 tensor on their device."""
    out = torch.empty(sum(sizes), dtype=torch.float32, device=tensors[0].device)
    torch._foreach_copy_(_views(out, tensors, sizes), tensors)
    return out


def _scatter(targets: list[Tensor], flat: Tensor, sizes: list[int]) -> None:
    """The consecutive ranges of ``flat`` copied into ``targets`` in place (rounded to nearest in their dtype)."""
    torch._foreach_copy_(targets, _views(flat, targets, sizes))


def _store(params: list[Tensor], weight: Tensor, sizes: list[int], buffers: list[Tensor] | None) -> None:
    """The flat fp32 ``weight`` written into ``params`` (nearest rounding; already on their grid where rounded
    stochastically) and, with ``buffers``, what that rounding left out into them (exact: at most half an ulp)."""
    _scatter(params, weight, sizes)
    if buffers is not None:
        weight.sub_(_gather(params, sizes))
        _scatter(buffers, weight, sizes)


def _fp32(tensors: list[Tensor], sizes: list[int]) -> list[Tensor]:
    """``tensors`` as flat fp32 tensors to read: themselves where they already are, else views of one copy."""
    if all(t.dtype == torch.float32 and t.dim() == 1 for t in tensors):
        return tensors
    return list(_gather(tensors, sizes).split(sizes))


def _bnb_moment(state: dict[str, Any], i: int, start: int, stop: int) -> Tensor:
    """Flat elements ``[start, stop)`` of bitsandbytes' moment ``i`` (1: m, 2: v) in fp32: the fp32 state itself
    (read-only) or the 8-bit codes of the blocks covering the range, dequantized with bitsandbytes' own op (what its
    next step reads)."""
    codes = state[f"state{i}"].view(-1)
    if codes.dtype == torch.float32:
        return codes[start:stop]
    first = start // _BNB_BLOCK
    block_start = first * _BNB_BLOCK
    last = -(-stop // _BNB_BLOCK)
    values = torch.ops.bitsandbytes.dequantize_blockwise(
        codes[block_start:stop], state[f"absmax{i}"][first:last], state[f"qmap{i}"], _BNB_BLOCK, torch.float32)
    return values[start - block_start:]


def _fp32_update(weights: list[Tensor], ms: list[Tensor], vs: list[Tensor], entries: list[_Entry],
                 formula: Formula, bounded: bool) -> None:
    """``weights`` (fp32, in place) updated as the optimizer's ``formula`` does, from fp32 ``ms`` and ``vs`` (read
    only). Per-parameter scalars go in as scalar lists. Unbounded, the ops match the optimizer's op for op, so the
    fp32 result is the optimizer's own where it computes in fp32 from the same state. ``bounded`` (moments stored as
    codes) clamps ``m / denom`` to each entry's ``bound``, which fp32 moments never exceed: a v rounded to the zero
    code beside a non-zero m would otherwise give an ``m / eps`` step."""
    decays = [e.decay for e in entries]
    step_sizes = [e.step_size for e in entries]
    decay_after = formula == "bnb_cuda"
    if not decay_after and any(d != 1.0 for d in decays):
        torch._foreach_mul_(weights, decays)
    denom = torch._foreach_sqrt(vs)
    if formula in ("addcdiv", "quantized"):
        torch._foreach_div_(denom, [e.bc2_sqrt for e in entries])
        torch._foreach_add_(denom, [e.eps for e in entries])
    else:
        torch._foreach_add_(denom, [e.eps * e.bc2_sqrt for e in entries])
    if bounded:
        update = torch._foreach_div(ms, denom)
        torch._foreach_clamp_min_(update, [-e.bound for e in entries])
        torch._foreach_clamp_max_(update, [e.bound for e in entries])
        torch._foreach_mul_(update, step_sizes)
        torch._foreach_add_(weights, update)
    elif formula == "addcdiv":
        torch._foreach_addcdiv_(weights, ms, denom, step_sizes)
    elif formula == "quantized":
        update = torch._foreach_mul(ms, step_sizes)
        torch._foreach_div_(update, denom)
        torch._foreach_add_(weights, update)
    else:
        _add_scaled(weights, torch._foreach_div(ms, denom), step_sizes)
    if decay_after and any(d != 1.0 for d in decays):
        torch._foreach_mul_(weights, decays)


def _sharded(params: Iterable[Tensor]) -> bool:
    """Whether any of ``params`` is a shard (DTensor, FSDP2): compensation buffers there would be saved from rank 0
    only."""
    return any(local_tensor(p) is not p for p in params)


def writeback_for(optimizer: torch.optim.Optimizer, weights: str | None, auto: bool,
                  keeps_tensors: bool = True) -> WeightWriteBack | None:
    """The write-back a monitor attaches for its ``weights`` option: that rounding on every parameter stored below
    fp32 (``"<rounding>+moments"``: with torch.optim's moments computed here and rounded stochastically too); with the
    automatic remedy and no choice (``None``), on no parameter yet (the remedy chooses): compensated summation of the
    weights where the front-end's checkpoints hold tensors (``keeps_tensors``) and the parameters are not sharded,
    stochastic rounding elsewhere, and torch.optim's moments rounded stochastically. None where no parameter is stored
    below fp32, where ``weights="off"``, and where the automatic remedy meets an optimizer the write-back does not
    support (a ``weights`` choice there is a configuration error)."""
    params = [p for group in _unwrap(optimizer).param_groups for p in group["params"]]
    if weights == "off" or not any(p.dtype in LOW_PRECISION for p in params):
        return None
    if weights is not None:
        rounding, _, moments = weights.partition("+")
        try:
            return WeightWriteBack(optimizer, rounding,  # type: ignore[arg-type]
                                   moments="stochastic" if moments else "optimizer")
        except ValueError as error:
            raise ValueError(f"`weights`={weights!r}: {error}") from error
    if not auto:
        return None
    rounding: Rounding = "compensated" if keeps_tensors and not _sharded(params) else "stochastic"
    try:
        own = _family(_unwrap(optimizer)) == "torch"
        return WeightWriteBack(optimizer, rounding, params=(), moments="stochastic" if own else "optimizer")
    except ValueError:
        return None


def adam_ratio_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest ``|m| / sqrt(v)`` fp32 Adam moments reach after ``step`` steps from zero (Cauchy-Schwarz):
    ``(1 - b1) / sqrt(1 - b2) * sqrt(sum_{k<step} (b1^2 / b2)^k)``, whatever the gradients."""
    q = beta1 * beta1 / beta2
    total = step if q == 1.0 else (1.0 - q**step) / (1.0 - q)
    return (1.0 - beta1) / math.sqrt(1.0 - beta2) * math.sqrt(total)


def _add_scaled(weights: list[Tensor], updates: list[Tensor], alphas: list[float]) -> None:
    """``w.add_(u, alpha=a)`` per parameter, batched per distinct alpha (usually one per group)."""
    by_alpha: dict[float, list[int]] = defaultdict(list)
    for i, alpha in enumerate(alphas):
        by_alpha[alpha].append(i)
    for alpha, idx in by_alpha.items():
        torch._foreach_add_([weights[i] for i in idx], [updates[i] for i in idx], alpha=alpha)

