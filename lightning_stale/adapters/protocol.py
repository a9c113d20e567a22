"""The adapter protocol: how the engine sees and resets one optimizer family's stored moments.

An adapter hides one library's state layout. It exposes the stored moments as :class:`Slot` objects (one per
parameter and moment) whose codes can be compared step to step, and it resets chosen moments in place. The slot
layouts the built-in adapters share (plain floats, 8-bit maps, packed 4-bit, fp8 blocks) are in :mod:`.layouts`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from lightning_stale.adapters.sampling import Sample
from lightning_stale.vocab import MOMENTS, Moment, Rounding, check_moments


def take(tensor: Tensor, index: Tensor) -> Tensor:
    """``tensor.reshape(-1)[index]`` through ``index_select``, which stays fast for small samples even when
    advanced indexing would start a parallel region (milliseconds on a busy machine)."""
    return tensor.reshape(-1).index_select(0, index)


@dataclass(eq=False)
class Slot:
    """One stored moment of one parameter.

    The engine reads a slot on its hot path only through :meth:`sampled_codes` (a strided view, no kernel, unless the
    layout is ``gathered``); the ``*_at`` methods gather values and spacings at explicit indices off the hot path
    (drift readouts, grid estimates), and subclasses override them when they can do so without touching the whole
    tensor.

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

    packed: ClassVar[bool] = False  # two codes per byte: sampled by element pairs (measure/sampling.py)
    gathered: ClassVar[bool] = False  # sampled_codes is a copy (no view reads the elements), read at every snapshot

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

    def state_tensors(self) -> list[Tensor]:
        """The optimizer-state tensors this slot reads, to notice when the optimizer replaced one (the slot keeps
        them alive, so a replacement never reuses their address)."""
        return [v for v in vars(self).values() if isinstance(v, Tensor) and v is not self.param]

    def spacing_sums(self, sample: Sample) -> Tensor | None:
        """``(sum of |value| / spacing, count)`` over the sampled elements with a non-zero value and a known positive
        spacing, a float64 2-vector on the slot's device (the grid estimate of rho-hat); None where the spacing is
        unknown. Layouts whose ratio follows from the code alone override it with a table lookup."""
        index = sample.positions(self.param.device)
        spacing = self.spacing_at(index)
        if spacing is None:
            return None
        values, spacing = self.value_at(index).double().abs(), spacing.double()
        keep = torch.isfinite(values) & torch.isfinite(spacing) & (values > 0) & (spacing > 0)
        return torch.stack([torch.where(keep, values / spacing, 0.0).sum(), keep.sum().double()])

    def sampled_codes(self, sample: Sample) -> Tensor:
        """The codes of the sampled elements as a view of the stored tensor (bytes for packed layouts), shaped as
        ``sample.view``; a copy where ``gathered``."""
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

    def step_counter(self, param: Tensor) -> Tensor | int | float | None:
        """``param``'s optimizer step counter as the optimizer keeps it (its ``step``: a number, or a tensor that may
        live on the device: torch's fused and capturable optimizers), None when there is none; nothing is read."""
        return self.optimizer.state.get(param, {}).get("step")

    def steps_taken(self, params: Sequence[Tensor]) -> list[int | None]:
        """Optimizer steps behind each of ``params``' current state (:meth:`step_counter`), None where unknown, with
        one host read per device for counters kept on devices. Used to age a state that existed before monitoring
        began (a checkpoint saved without the monitor)."""
        counters = [self.step_counter(p) for p in params]
        out: list[int | None] = [None] * len(counters)
        on_devices: dict[torch.device, list[int]] = {}
        for i, counter in enumerate(counters):
            if isinstance(counter, Tensor):
                on_devices.setdefault(counter.device, []).append(i)
            elif counter is not None:
                out[i] = int(counter)
        for indices in on_devices.values():
            values = torch.stack([counters[i].reshape(()).double() for i in indices]).cpu().tolist()
            for i, value in zip(indices, values):
                out[i] = int(value)
        return out

    def reset_exact(self, moments: Sequence[Moment] | None = None, params: Iterable[Tensor] | None = None) -> None:
        """The paper's exact per-moment reset where the optimizer keeps one age per moment, even when it is unsafe
        (a v-only reset then gives an unbounded next update); the same as :meth:`reset` for every other optimizer."""
        self.reset(moments, params)

    def roundings(self, params: Iterable[Tensor]) -> list[Rounding]:
        """How the optimizer rounds each parameter's state writes: nearest (what every built-in optimizer does
        unless it offers a choice, which its adapter then reads)."""
        return ["nearest" for _ in params]

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
