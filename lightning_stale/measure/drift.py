"""Drift: how far stored moments have moved from an fp32 *shadow* EMA of the same gradients (same beta, restarted
with the state), kept on a fixed panel of parameters because a shadow must see every gradient.

The panel holds at most ``DRIFT_PARAMS`` parameters in sample mode (all of them in exact mode), chosen by a hash of
their keys with one parameter of every driver format first (drift is read per format), on the first
``DRIFT_SAMPLE`` elements of their sample. Drift is the median ratio stored/shadow for v and the relative L2 error for
m.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_stale.adapters.sampling import Sample
from lightning_stale.measure.rows import KeyedRows
from lightning_stale.measure.units import Entry, TrackedParam, driver_group
from lightning_stale.transfers import to_device

DRIFT_PARAMS = 4  # parameters with a drift shadow in sample mode
DRIFT_SAMPLE = 128  # shadowed elements per slot


@dataclass(eq=False)
class Shadow:
    """fp32 shadow EMAs of panel parameters whose slots share a layout (device, sample shape, moments and betas):
    one row per slot, one gradient concatenation per step for all of them."""

    units: list[TrackedParam]
    samples: list[Sample]  # the shadowed prefix of each unit's sample
    squared: list[bool]  # per row: the EMA averages g**2 (a second moment) rather than g
    weight: Tensor  # (rows, 1): 1 - beta
    values: Tensor  # (rows, elements)
    starts: list[int]  # each unit's first element

    def part(self, row: int, unit: int) -> Tensor:
        start = self.starts[unit]
        return self.values[row, start:start + self.samples[unit].numel]


class DriftPanel:
    """The shadows of one optimizer's panel parameters: updated every step, read on logging and check steps."""

    def __init__(self, exact: bool) -> None:
        self.exact = exact
        self.rows: KeyedRows[Tensor] = KeyedRows()  # the panel's slot keys; the shadows of slots that went away
        self._shadows: list[Shadow] = []
        self._of: dict[str, tuple[Shadow, int, int]] = {}  # slot key -> (shadow, row, unit index)

    def rebuild(self, units: list[TrackedParam], old_entries: dict[str, Entry], fresh_state: bool) -> None:
        """Choose the panel among ``units`` and build its shadows, carrying each kept slot's shadow (then a restored
        one: a slot that went away, or a loaded checkpoint's); a new slot starts from zero if its state was created by
        this step (``fresh_state``), else from its stored value. A slot that leaves the panel but not the optimizer
        is dropped."""
        candidates = [u for u in units if u.sample.count > 0 and any(e.slot.beta is not None for e in u.entries)]
        if not self.exact:  # a hashed choice, one parameter of every driver format first (drift is read per format)
            candidates.sort(key=lambda u: zlib.crc32(u.key.encode()))
            firsts = list({driver_group(u): u for u in reversed(candidates)}.values())
            candidates = (firsts + [u for u in candidates if u not in firsts])[:max(DRIFT_PARAMS, len(firsts))]
            candidates.sort(key=lambda u: u.position)  # the param groups' order
        groups: dict[tuple, list[TrackedParam]] = {}
        for unit in candidates:
            layout = tuple((e.moment, e.slot.beta) for e in unit.entries if e.slot.beta is not None)
            groups.setdefault((unit.param.device, unit.sample.full, layout), []).append(unit)
        old, shadows, of, entries = self._of, [], {}, {}
        for (device, _, layout), members in groups.items():
            samples = [u.sample.prefix(DRIFT_SAMPLE) for u in members]
            lengths = [s.numel for s in samples]
            shadow = Shadow(members, samples, [m == "v" for m, _ in layout],
                            to_device(torch.tensor([[1.0 - b] for _, b in layout], dtype=torch.float32), device),
                            torch.zeros(len(layout), sum(lengths), dtype=torch.float32, device=device),
                            [int(x) for x in np.cumsum([0] + lengths[:-1])])
            shadows.append(shadow)
            for i, unit in enumerate(members):
                for row, entry in enumerate(e for e in unit.entries if e.slot.beta is not None):
                    of[entry.key], entries[entry.key] = (shadow, row, i), entry
        moves = self.rows.rebuild(of, lambda key, _: _part(old[key]).clone(),
                                  live={e.key for u in units for e in u.entries})
        self._shadows, self._of = shadows, of
        for key, place in of.items():
            if key in moves.kept:
                _part(place).copy_(_part(old[key]))
            elif key in moves.returned:
                _part(place).copy_(moves.returned[key])
            elif not (fresh_state and key not in old_entries):
                self.resync(entries[key])

    def update(self, placeholders: dict) -> None:
        """One EMA step of every shadow with this step's gradients (NaN/Inf elements leave the EMA where it is)."""
        for shadow in self._shadows:
            grad = torch.cat([u.grad_view(sample, placeholders) for u, sample in zip(shadow.units, shadow.samples)])
            grad = grad.reshape(-1).float()
            signal = torch.stack([grad * grad if squared else grad for squared in shadow.squared])
            signal = torch.where(grad.abs() < math.inf, signal, shadow.values)
            shadow.values.lerp_(signal, shadow.weight)

    def resync(self, entry: Entry) -> None:
        """Restart a slot's shadow from its stored value (exactly zero right after a full reset)."""
        if entry.key in self._of:
            shadow, row, i = self._of[entry.key]
            shadow.part(row, i).copy_(entry.slot.value_at(self._positions(entry)).float())

    def readings(self, entries: dict[str, Entry]) -> dict[str, float]:
        """Drift of each shadowed slot (median stored/shadow for v, relative L2 error for m), by slot key; slots
        without a finite reading yet are left out. Computed on the slots' devices and read back at once (one host
        read per device)."""
        keys, values = [], []
        for key, (shadow, row, i) in self._of.items():
            entry = entries[key]
            stored, reference = entry.slot.value_at(self._positions(entry)).float(), shadow.part(row, i)
            if entry.moment == "v":  # the median of the ratios where the shadow is positive (nan if one is nan)
                ok = reference > 0
                ratio = torch.where(ok, stored / torch.where(ok, reference, 1.0), math.nan)
                value = ratio.nanmedian() if ratio.numel() else ratio.new_tensor(math.nan)
                value = torch.where(ok.logical_and(ratio.isnan()).any(), math.nan, value)
            else:
                norm = reference.norm()
                value = torch.where(norm > 0, (stored - reference).norm() / norm, math.nan)
            keys.append(key)
            values.append(value)
        out = {}
        for device in dict.fromkeys(v.device for v in values):
            chosen = [j for j, v in enumerate(values) if v.device == device]
            for j, value in zip(chosen, torch.stack([values[j] for j in chosen]).double().cpu().tolist()):
                if math.isfinite(value):
                    out[keys[j]] = value
        return {key: out[key] for key in keys if key in out}

    def weight(self, key: str) -> int:
        """Shadowed elements of a slot (the weight of its drift in aggregates)."""
        shadow, _, i = self._of[key]
        return shadow.samples[i].numel

    def _positions(self, entry: Entry) -> Tensor:
        shadow, _, i = self._of[entry.key]
        return shadow.samples[i].positions(entry.slot.param.device)

    def tensors(self) -> list[Tensor]:
        """The device tensors kept between steps."""
        return [t for s in self._shadows for t in (s.values, s.weight)]

    def state_dict(self) -> dict[str, Tensor]:
        """Every shadow by slot key, on the host (with those of slots that went away or have not appeared yet)."""
        return self.rows.state_dict({key: _part(place).cpu().clone() for key, place in self._of.items()})

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Forget every shadow and keep ``state``'s, each applied when its slot is next on the panel."""
        self.rows.restart(state)
        self._shadows, self._of = [], {}


def _part(place: tuple[Shadow, int, int]) -> Tensor:
    """The shadow of one slot: its part of its shadow's row."""
    shadow, row, unit = place
    return shadow.part(row, unit)
