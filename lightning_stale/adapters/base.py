"""The adapter protocol: how the engine sees and resets one optimizer family's stored moments.

An adapter hides one library's state layout. It exposes the stored moments as :class:`Slot` objects (one per
parameter and moment) whose codes can be compared step to step, and it resets chosen moments in place.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from lightning_stale._compat import local_tensor
from lightning_stale.formats.base import grid_spacing_table, pack_nibbles, unpack_nibbles
from lightning_stale.formats.fp8 import e4m3_spacing
from lightning_stale.sampling import Sample
from lightning_stale.vocab import MOMENTS, SIGNALS, Moment, check_moments


def take(tensor: Tensor, index: Tensor) -> Tensor:
    """``tensor.reshape(-1)[index]`` through ``index_select``, which stays fast for small samples even when
    advanced indexing would start a parallel region (milliseconds on a busy machine)."""
    return tensor.reshape(-1).index_select(0, index)


@dataclass(eq=False)
class Slot:
    """One stored moment of one parameter.

    The engine reads a slot on its hot path only through :meth:`sampled_codes` (a strided view, no kernel); the
    ``*_at`` methods gather values and spacings at explicit indices off the hot path (drift readouts, grid
    estimates), and subclasses override them when they can do so without touching the whole tensor.

    Attributes:
        param: the parameter this moment belongs to.
        moment: canonical moment name, ``"m"`` (signed EMA of g) or ``"v"`` (EMA of g**2).
        beta: EMA decay of this moment, or ``None`` when the buffer is not an EMA (SGD momentum, Adagrad sums).
        format: a name from :mod:`lightning_stale.formats` (``"int8_dynamic"``, ``"bf16"``, ``"fp8_e4m3"``,
            ``"fp4"``, ``"fp32"`` ...) or a free-form description of a foreign grid.
        key: the optimizer-state key (or a description) this slot reads, for messages and logging.
    """

    param: Tensor
    moment: Moment
    beta: float | None
    format: str
    key: str
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    packed: ClassVar[bool] = False  # two codes per byte: sampled by element pairs (see lightning_stale.sampling)

    @property
    def signal(self) -> Literal["g", "g2"]:
        """What the EMA averages, which follows from the moment: ``"g"`` for m, ``"g2"`` for v."""
        return SIGNALS[self.moment]

    @property
    def numel(self) -> int:
        return self.codes().numel()

    def codes(self) -> Tensor:
        """A tensor (one element per stored value) whose unchanged elements mean the stored value did not move."""
        raise NotImplementedError

    def value(self) -> Tensor:
        """Dequantized fp32 values, flat."""
        raise NotImplementedError

    def spacing(self) -> Tensor | None:
        """Absolute local grid spacing at each stored value (ulp convention), flat; ``None`` if unknown."""
        return None

    def storage_id(self) -> int:
        """Identifies the stored buffer, to notice when an optimizer replaced it (e.g. ``load_state_dict``)."""
        return self.codes().data_ptr()

    def sampled_codes(self, sample: Sample) -> Tensor:
        """The codes of the sampled elements as a 1-D view of the stored tensor (bytes for packed layouts)."""
        return sample.view(self.codes())

    def zero_code(self) -> int | None:
        """The per-element code that stores an exact zero whatever the scale (0 for the built-in layouts), or None
        when the grid has no zero. Called when the engine plans its batches, never per step."""
        return 0

    def zero_mask(self) -> Tensor:
        """Flat bool mask of the elements stored as exactly zero (what the underflow guard tests every step)."""
        return self.value() == 0

    def zero_elements(self, mask: Tensor) -> None:
        """Store an exact zero, in place, in the elements selected by the flat bool ``mask`` (the underflow guard's
        write; scales are left alone). Layouts that cannot write a zero raise TypeError."""
        raise TypeError(
            f"underflow_guard cannot write zeros into slot {self.key!r} ({type(self).__name__}): give the slot class "
            "a zero_elements(mask) method, or construct StaleStateCallback(underflow_guard=False)"
        )

    def zero_view(self) -> tuple[Tensor, int | float] | None:
        """The underflow guard's one-pass view of the stored elements: ``(codes, zero)``, one code per element, in
        place, where ``codes == zero`` marks the elements stored as exactly zero (in a non-empty block) and writing
        ``zero`` stores an exact zero. None where the layout has no such view: the guard then uses
        :meth:`zero_mask` and :meth:`zero_elements`."""
        return None

    def codes_at(self, index: Tensor) -> Tensor:
        """Codes at flat indices ``index``."""
        return take(self.codes(), index)

    def value_at(self, index: Tensor) -> Tensor:
        """Dequantized fp32 values at flat indices ``index``."""
        return take(self.value(), index)

    def spacing_at(self, index: Tensor) -> Tensor | None:
        """Absolute grid spacing at flat indices ``index``; ``None`` if unknown."""
        spacing = self.spacing()
        return None if spacing is None else take(spacing, index)

    def grad_at(self, index: Tensor) -> Tensor | None:
        """The gradient elements that fed this slot's last update (fp32), or ``None`` when there is no gradient."""
        grad = local_tensor(self.param.grad)
        if grad is None:
            return None
        return take(grad, index).float()


class OptimizerAdapter(ABC):
    """Reads and resets the stored moments of one optimizer instance.

    Attributes:
        family: short name of the optimizer family shown in logs (``"bitsandbytes"``, ``"torchao"``, ...).
        exact_moment_reset: True when a single moment can be reset with its own bias-correction age (the paper's
            asymmetric reset); False when the optimizer shares one step counter and a safe approximation is used.
    """

    family: str = "unknown"
    exact_moment_reset: bool = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @abstractmethod
    def slots(self) -> list[Slot]:
        """The state slots that exist now (state appears lazily after the first step)."""

    @abstractmethod
    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        """Reset the chosen moments (None = all) of the chosen params (None = all) in place, bias-correction age
        included, to the state a freshly constructed optimizer would have."""

    def steps_taken(self, param: Tensor) -> int | None:
        """Optimizer steps behind ``param``'s current state (its ``step`` counter), None when unknown. Used to age a
        state that existed before monitoring began (a checkpoint saved without the monitor)."""
        step = self.optimizer.state.get(param, {}).get("step")
        return None if step is None else int(step)

    def reset_exact(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        """The paper's exact per-moment reset where the optimizer keeps one age per moment, even when it is unsafe
        (a v-only reset then gives an unbounded next update); the same as :meth:`reset` for every other optimizer."""
        self.reset(moments, params)

    def use_stochastic_rounding(self, params: Iterable[Tensor]) -> bool:
        """Switch the write-back rounding of ``params``' stored moments to stochastic rounding from the next step on
        (an optimizer hyper-parameter, changed in its param groups; the state is not touched). False (nothing done)
        where the optimizer has no stochastic rounding, which is the default."""
        return False

    def describe(self) -> str:
        """One line for the fit-start summary."""
        return f"{type(self.optimizer).__name__} ({self.family})"

    def stepped(self, params: Iterable[Tensor] | None = None) -> Iterable[tuple[dict, Tensor, dict]]:
        """``(param_group, param, state)`` for every param with state (optionally only ``params``), read afresh from
        ``optimizer.state`` each call so nothing stale survives ``load_state_dict``."""
        chosen = None if params is None else {id(p) for p in params}
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if (chosen is None or id(p) in chosen) and p in state and len(state[p]) > 0:
                    yield group, p, state[p]


class SharedStepAdapter(OptimizerAdapter):
    """Optimizers that keep one ``step`` per parameter for both moments (torch.optim Adam, bitsandbytes, torchao).

    A reset of every moment present is exact (buffers and ``step`` zeroed in place); an m-only reset zeroes m and
    keeps ``step``; a v-only reset cannot restart v's age alone and writes the bounded restart of :mod:`.restart`.
    Subclasses say how: :meth:`reset_all`, :meth:`reset_m`, :meth:`restart_v`.
    """

    exact_moment_reset = False

    def present_moments(self) -> frozenset[Moment]:
        """The moments this optimizer stores (one-state optimizers have only one)."""
        return frozenset(MOMENTS)

    def reset(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        present = self.present_moments()
        chosen = resolve_moments(moments) & present
        if not chosen:
            return
        for group, p, state in self.stepped(params):
            if chosen == present:
                self.reset_all(state)
            elif chosen == {"m"}:
                self.reset_m(state)
            else:
                self.restart_v(group, p, state)

    @abstractmethod
    def reset_all(self, state: dict) -> None:
        """Restore the fresh state of every moment and ``step``."""

    @abstractmethod
    def reset_m(self, state: dict) -> None:
        """Zero the first moment, keep ``step``."""

    @abstractmethod
    def restart_v(self, group: dict, p: Tensor, state: dict) -> None:
        """The bounded v-only restart."""


def resolve_moments(moments: Sequence[Moment] | None) -> frozenset[Moment]:
    """Validate a ``moments`` argument (None = both) and return it as a set."""
    return frozenset(check_moments(moments))


# -- concrete slot layouts shared by the built-in adapters ----------------------------------------------------------


def _bit_view(tensor: Tensor) -> Tensor:
    """The raw bits of a float tensor as an integer tensor of the same width (bitwise equality, NaN-safe)."""
    bits = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
    if tensor.dtype in bits:
        return tensor.view(bits[tensor.dtype])
    return tensor


def dtype_ulp(values: Tensor) -> Tensor:
    """Absolute spacing to the next representable value away from zero, in the values' own dtype, as fp32."""
    mag = values.abs()
    return (torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag).float()


FLOAT_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclass(eq=False, kw_only=True)
class FloatSlot(Slot):
    """A moment stored as a plain float tensor (torch.optim, 32-bit fallbacks): codes are its raw bits."""

    tensor: Tensor

    def codes(self) -> Tensor:
        return _bit_view(self.tensor)

    def value(self) -> Tensor:
        return self.tensor.reshape(-1).float()

    def spacing(self) -> Tensor | None:
        return dtype_ulp(self.tensor.reshape(-1)) if self.tensor.is_floating_point() else None

    def codes_at(self, index: Tensor) -> Tensor:
        return take(_bit_view(self.tensor), index)

    def value_at(self, index: Tensor) -> Tensor:
        return take(self.tensor, index).float()

    def spacing_at(self, index: Tensor) -> Tensor | None:
        return dtype_ulp(take(self.tensor, index)) if self.tensor.is_floating_point() else None

    def zero_mask(self) -> Tensor:
        return (self.tensor == 0).reshape(-1)

    def zero_elements(self, mask: Tensor) -> None:
        self.tensor.masked_fill_(mask.view(self.tensor.shape), 0)

    def zero_view(self) -> tuple[Tensor, int | float] | None:
        return (self.tensor.view(-1), 0) if self.tensor.is_contiguous() else None


_MAP_VALUES: dict[tuple[int, str], tuple[weakref.ref, Any]] = {}  # (id(map), what) -> (the map, the value)


def _of_map(qmap: Tensor, what: str, build: Callable[[Tensor], Any]) -> Any:
    """A value derived from a code map, built once per map tensor (the optimizers share one map among all their
    parameters) and dropped with it."""
    key = (id(qmap), what)
    entry = _MAP_VALUES.get(key)
    if entry is None or entry[0]() is not qmap:
        entry = (weakref.ref(qmap), build(qmap))
        _MAP_VALUES[key] = entry
        weakref.finalize(qmap, _MAP_VALUES.pop, key, None)
    return entry[1]


def _spacing_table(qmap: Tensor) -> Tensor:
    """The ulp-convention spacing of every code of a map, on its device."""
    return _of_map(qmap, "spacing", lambda q: grid_spacing_table(q.detach().float().cpu()).to(q.device))


def _zero_entry(qmap: Tensor) -> tuple[int, bool]:
    """(the code of the map entry nearest zero, whether that entry is exactly zero): one host read per map, so the
    underflow guard's per-step test and write compare against a Python int."""

    def build(q: Tensor) -> tuple[int, bool]:
        flat = q.detach().reshape(-1)
        code = int(torch.argmin(flat.abs()))
        return code, float(flat[code]) == 0.0

    return _of_map(qmap, "zero", build)


@dataclass(eq=False, kw_only=True)
class BlockQmapSlot(Slot):
    """A moment stored as 8-bit indices into a value map, scaled per block: ``qmap[code] * scale[i // block]``.

    ``stored`` is the uint8 code tensor (any shape), ``scale`` the flat per-block scales, ``qmap`` the shared map.
    """

    stored: Tensor
    scale: Tensor
    qmap: Tensor
    block_size: int

    def codes(self) -> Tensor:
        return self.stored

    def value(self) -> Tensor:
        codes = self.codes().reshape(-1).long()
        return self.qmap[codes] * self.scale.repeat_interleave(self.block_size)[: codes.numel()]

    def codes_at(self, index: Tensor) -> Tensor:
        return take(self.stored, index)

    def value_at(self, index: Tensor) -> Tensor:
        return take(self.qmap, self.codes_at(index).long()) * take(self.scale, index // self.block_size)

    def spacing(self) -> Tensor | None:
        from lightning_stale.formats.int8_dynamic import spacing_from_codes

        return spacing_from_codes(self.codes().reshape(-1), self.scale.reshape(-1), self.qmap, self.block_size)

    def spacing_at(self, index: Tensor) -> Tensor | None:
        return take(_spacing_table(self.qmap), self.codes_at(index).long()) * take(self.scale,
                                                                                      index // self.block_size)

    def zero_code(self) -> int | None:
        code, exact = _zero_entry(self.qmap)
        return code if exact else None

    def zero_mask(self) -> Tensor:
        # Codes against the zero code, several times cheaper than dequantizing the whole state every step; an element
        # of a block whose scale is 0 is zero whatever its code.
        codes, empty_blocks = self.codes().reshape(-1), self.scale.reshape(-1) == 0
        code, exact = _zero_entry(self.qmap)
        if codes.numel() == empty_blocks.numel() * self.block_size:  # whole blocks: broadcast, no expansion
            empty = empty_blocks.unsqueeze(1)
            blocks = codes.view(-1, self.block_size)
            return ((blocks == code).logical_or_(empty) if exact else empty.expand_as(blocks)).reshape(-1)
        empty = empty_blocks.repeat_interleave(self.block_size)[: codes.numel()]
        return (codes == code).logical_or_(empty) if exact else empty

    def zero_elements(self, mask: Tensor) -> None:
        # The nearest-zero entry is an exact zero in every first-moment map (bitsandbytes, torchao, ours).
        self.stored.masked_fill_(mask.view(self.stored.shape), _zero_entry(self.qmap)[0])

    def zero_view(self) -> tuple[Tensor, int | float] | None:
        code, exact = _zero_entry(self.qmap)
        return (self.stored.view(-1), code) if exact and self.stored.is_contiguous() else None


@dataclass(eq=False, kw_only=True)
class Packed4bitSlot(BlockQmapSlot):
    """Like :class:`BlockQmapSlot` with two 4-bit codes per byte (high nibble first), as torchao's 4-bit states."""

    packed: ClassVar[bool] = True

    @property
    def numel(self) -> int:
        return local_tensor(self.param).numel()  # without unpacking the codes

    def sampled_codes(self, sample: Sample) -> Tensor:
        return sample.byte_view(self.stored)

    def storage_id(self) -> int:
        return self.stored.data_ptr()

    def codes(self) -> Tensor:
        return unpack_nibbles(self.stored, self.numel)

    def codes_at(self, index: Tensor) -> Tensor:
        byte = take(self.stored, index // 2)
        return torch.where(index % 2 == 0, byte >> 4, byte & 0b1111)

    def spacing(self) -> Tensor | None:
        codes = self.codes().long()
        return _spacing_table(self.qmap)[codes] * self.scale.repeat_interleave(self.block_size)[: codes.numel()]

    def zero_view(self) -> tuple[Tensor, int | float] | None:
        return None  # two codes per byte: no per-element view

    def zero_elements(self, mask: Tensor) -> None:
        codes = unpack_nibbles(self.stored)  # every nibble, the padding of an odd count included
        codes[: mask.numel()].masked_fill_(mask, _zero_entry(self.qmap)[0])
        self.stored.view(-1).copy_(pack_nibbles(codes))


@dataclass(eq=False, kw_only=True)
class BlockFp8Slot(Slot):
    """A moment stored as ``float8_e4m3fn`` values times a per-block scale (torchao AdamFp8)."""

    stored: Tensor
    scale: Tensor
    block_size: int

    def codes(self) -> Tensor:
        return _bit_view(self.stored)

    def value(self) -> Tensor:
        return self.stored.reshape(-1).float() * self.scale.repeat_interleave(self.block_size)

    def codes_at(self, index: Tensor) -> Tensor:
        return take(_bit_view(self.stored), index)

    def value_at(self, index: Tensor) -> Tensor:
        return take(self.stored, index).float() * take(self.scale, index // self.block_size)

    def spacing(self) -> Tensor | None:
        return e4m3_spacing(self.stored.reshape(-1)) * self.scale.repeat_interleave(self.block_size)

    def spacing_at(self, index: Tensor) -> Tensor | None:
        return e4m3_spacing(take(self.stored, index)) * take(self.scale, index // self.block_size)

    def zero_elements(self, mask: Tensor) -> None:
        self.stored.view(torch.uint8).masked_fill_(mask.view(self.stored.shape), 0)
