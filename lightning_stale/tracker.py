"""Stall counting around one optimizer step, for every slot an adapter exposes.

Definitions (per slot, per measured step):

- **stalled**: the stored code did not change although the fp32 update was non-zero. Elements whose gradient was
  exactly zero or non-finite are not counted (their update is zero, or the optimizer zeroes them); when the
  optimizer hides its gradient, every element counts.
- **underflow** (second moments): the stored value is exactly zero while the element's gradient was non-zero, the
  precondition of the ``m / (sqrt(v) + eps)`` blow-up.
- **drift**: on a fixed sample of elements an fp32 *shadow* EMA of the same gradients (same beta, reset together with
  the state) is kept; drift is the median ratio stored/shadow for ``v`` and the relative L2 error for ``m``.

``track="sample"`` compares a fixed random subset of up to ``sample_size`` elements per slot (cost and memory do not
grow with model size); ``track="exact"`` compares every element. Drift always uses the sample.
All counts stay on the device as tensors; nothing here forces a host sync.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_stale.adapters.base import OptimizerAdapter, Slot

# Columns of the per-slot accumulator: stalled, counted, underflowed, underflow-counted (sampled), measured steps.
STALLED, COUNTED, UNDERFLOW, UNDERFLOW_COUNTED, MEASURED = range(5)
N_STATS = 5
_ZERO, _ONE = torch.tensor(0), torch.tensor(1)


@dataclass(eq=False)
class SlotRecord:
    """Tracking state of one slot: its sample, the codes before the step, its shadow EMA and running sums."""

    key: str
    unit: str  # the parameter this slot belongs to: slots of one parameter are reset together
    slot: Slot
    index: Tensor
    exact: bool
    numel: int = 0
    shadow: Tensor | None = None
    prev: Tensor | None = None
    totals: Tensor = field(default_factory=lambda: torch.zeros(N_STATS, dtype=torch.float64))
    last_step: Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))
    predicted_sum: float = 0.0  # sum over measured steps of the theory's stall prediction (filled by the callback)
    predicted_n: int = 0

    def __post_init__(self) -> None:
        # Elements each sampled element stands for, so that aggregates over slots are weighted by slot size; the
        # per-column factors of one step's stats when stalls come from the sample or from a full count.
        w = self.numel / max(1, self.index.numel())
        self.sampled_weights = torch.tensor([w, w, w, w, 1.0], dtype=torch.float64)
        self.counted_weights = torch.tensor([1.0, 1.0, w, w, 1.0], dtype=torch.float64)

    @property
    def moment(self) -> str:
        return self.slot.moment

    def resync_shadow(self) -> None:
        """Restart the shadow EMA from the stored value (exactly zero right after a full reset)."""
        if self.slot.beta is not None:
            self.shadow = self.slot.value_at(self.index).float().clone()


def sample_index(key: str, numel: int, sample_size: int, seed: int) -> Tensor:
    """A fixed, sorted set of up to ``sample_size`` flat indices, identical on every rank and after a resume
    (int32 where it fits: the index is the largest part of the callback's memory)."""
    dtype = torch.int32 if numel < 2**31 else torch.int64
    if numel <= sample_size:
        return torch.arange(numel, dtype=dtype)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.unique(torch.randint(numel, (sample_size,), generator=gen)).to(dtype)


class StallTracker:
    """Counts stalls, underflow and drift for every slot of one optimizer, step by step."""

    def __init__(self, adapter: OptimizerAdapter, prefix: str, track: str, sample_size: int, seed: int) -> None:
        self.adapter = adapter
        self.prefix = prefix
        self.exact = track == "exact"
        self.sample_size = sample_size
        self.seed = seed
        self.records: dict[str, SlotRecord] = {}
        self.version = 0  # bumped whenever records are added or rebuilt
        self.restored: dict[str, dict] = {}  # shadow and totals from a checkpoint, adopted when the slot appears
        self._param_index: dict[int, int] = {}
        self._indices: dict[tuple[str, int], Tensor] = {}
        self._n_state = -1
        self._state: object = None  # the optimizer's state mapping last scanned (load_state_dict replaces it)

    # -- binding -------------------------------------------------------------------------------------------------
    def unit_key(self, slot: Slot) -> str:
        """A stable name for a slot's parameter: optimizer prefix and position in the param groups."""
        return f"{self.prefix}.{self._param_index[id(slot.param)]}"

    def slot_key(self, slot: Slot) -> str:
        """A stable name for a slot: its parameter's name and the state key."""
        return f"{self.unit_key(slot)}.{slot.key}"

    def refresh(self, fresh_state: bool) -> list[SlotRecord]:
        """Pick up slots created since the last call; returns the new records.

        ``fresh_state`` says the new state was created by the step that just ran, so the shadow EMA starts from zero
        (then takes this step's gradient); otherwise it starts from the stored value.
        """
        state = self.adapter.optimizer.state
        if len(state) == self._n_state and state is self._state:
            return []
        self._n_state, self._state = len(state), state
        self._param_index = {
            id(p): i for i, p in enumerate(p for g in self.adapter.optimizer.param_groups for p in g["params"])
        }
        new = []
        for slot in self.adapter.slots():
            key = self.slot_key(slot)
            if key in self.records and self.records[key].slot.storage_id() == slot.storage_id():
                continue
            old = self.records.get(key)
            numel, unit = slot.numel, self.unit_key(slot)
            if (unit, numel) not in self._indices:  # the moments of one parameter share their sample
                self._indices[unit, numel] = sample_index(unit, numel, self.sample_size, self.seed)
            record = SlotRecord(key, unit, slot, self._indices[unit, numel], self.exact, numel)
            saved = self.restored.pop(key, None)
            if old is not None:  # same slot rebuilt (state reloaded): keep its history
                record.totals, record.shadow = old.totals, old.shadow
                record.predicted_sum, record.predicted_n = old.predicted_sum, old.predicted_n
            elif saved is not None:
                record.totals, record.shadow = saved["totals"].clone(), saved["shadow"]
                record.predicted_sum, record.predicted_n = saved.get("predicted", (0.0, 0))
            elif slot.beta is not None and fresh_state:
                record.shadow = torch.zeros(record.index.numel())
            else:
                record.resync_shadow()
            self.records[key] = record
            new.append(record)
        self.version += bool(new)
        return new

    def rebind(self) -> None:
        """Forget slot objects (optimizer state was reloaded or replaced); histories are kept by key."""
        self._n_state = -1
        self.discard()

    # -- the step --------------------------------------------------------------------------------------------------
    def before_step(self, measure: bool) -> None:
        """Snapshot codes that the step may change (only on measured steps)."""
        self.refresh(fresh_state=False)
        for record in self.records.values():
            if not measure:
                record.prev = None
            elif record.exact:
                record.prev = record.slot.codes().reshape(-1).clone()
            else:
                record.prev = record.slot.codes_at(record.index)

    def discard(self) -> None:
        """Drop the snapshot of a step that did not happen (skipped inside a fused optimizer)."""
        for record in self.records.values():
            record.prev = None

    def after_step(self, measure: bool, builtin: dict | None) -> list[SlotRecord]:
        """Update shadows with this step's gradients and, on measured steps, count stalls and underflow.

        Returns the records measured on this step.
        """
        measured = []
        grad_masks: dict[int, tuple[Tensor, Tensor]] = {}  # exact mode: (mask, count) of counted gradient elements
        sampled: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}  # m and v of a parameter share a sample
        fresh = self.refresh(fresh_state=True)
        for record in fresh:
            record.prev = None  # created by this step: nothing to compare against yet
        for record in self.records.values():
            slot = record.slot
            shared = (id(slot.param), id(record.index))
            if shared not in sampled:
                grad = slot.grad_at(record.index)
                if grad is not None:
                    nonzero = torch.isfinite(grad).logical_and_(grad != 0)
                    sampled[shared] = (grad, nonzero, torch.count_nonzero(nonzero))
            if shared not in sampled:  # no gradient: the optimizer skipped this parameter
                record.prev = None
                continue
            grad, nonzero, n_nonzero = sampled[shared]
            if record.shadow is not None:
                signal = grad if slot.signal == "g" else grad * grad
                record.shadow = torch.where(nonzero, torch.lerp(record.shadow, signal, 1.0 - slot.beta), record.shadow)
            if record.prev is None:
                continue
            counts = builtin.get((id(slot.param), slot.moment)) if builtin and not _is_split(slot) else None
            weights = record.counted_weights
            if counts is not None:
                stalled, counted = counts
            elif record.exact:
                full = slot.param.grad.reshape(-1) if slot.param.grad.numel() == slot.numel else None
                if full is not None and id(slot.param) not in grad_masks:  # one pass per parameter, not per moment
                    mask = torch.isfinite(full).logical_and_(full != 0)
                    grad_masks[id(slot.param)] = (mask, torch.count_nonzero(mask))
                unchanged = slot.codes().reshape(-1) == record.prev
                if full is not None:
                    mask, counted = grad_masks[id(slot.param)]
                    unchanged.logical_and_(mask)
                else:
                    counted = torch.tensor(unchanged.numel())
                stalled = torch.count_nonzero(unchanged)
            else:
                stalled = torch.count_nonzero((slot.codes_at(record.index) == record.prev).logical_and_(nonzero))
                counted, weights = n_nonzero, record.sampled_weights
            if slot.moment == "v":
                underflow = torch.count_nonzero(slot.zero_code_mask_at(record.index).logical_and_(nonzero))
                underflow_counted = n_nonzero
            else:
                underflow = underflow_counted = _ZERO
            stats = torch.stack([stalled, counted, underflow, underflow_counted, _ONE]).double().mul_(weights)
            record.totals += stats
            record.last_step = stats[:2]
            record.prev = None
            measured.append(record)
        return measured

    # -- readouts ----------------------------------------------------------------------------------------------------
    def drift(self, record: SlotRecord) -> Tensor | None:
        """Median stored/shadow ratio for v, relative L2 error for m, on the sample (None without a shadow)."""
        if record.shadow is None or record.index.numel() == 0:
            return None
        stored = record.slot.value_at(record.index).float()
        if record.moment == "v":
            ok = record.shadow > 0
            if not bool(ok.any()):
                return None
            return (stored[ok] / record.shadow[ok]).median()
        norm = record.shadow.norm()
        return (stored - record.shadow).norm() / norm if norm > 0 else None


def _is_split(slot: Slot) -> bool:
    """Slots that view part of one state tensor (AdEMAMix's two EMAs) cannot use per-parameter built-in counts."""
    return bool(slot.extra.get("split", False))


class StallTotals(Metric):
    """Element-weighted totals per moment, summed across steps and ranks (never averaging per-rank fractions)."""

    full_state_update = False

    def __init__(self, n: int) -> None:
        super().__init__()
        self.add_state("totals", default=torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: Tensor) -> None:
        self.totals += values.to(self.totals)

    def compute(self) -> Tensor:
        return self.totals
