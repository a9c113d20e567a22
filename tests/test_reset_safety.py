"""No reset blows up: after every reset, on every optimizer family and state format, nearest and stochastic, full and
v-only, the next updates stay within a small multiple of lr; the paper's exact v-only reset, behind its explicit
option, is shown to be the unbounded one it is documented as."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from helpers import make_optimizer
from lightning_stale import StaleStateMonitor
from lightning_stale.policies import ResetPolicy

LR = 1e-3
WINDOW = 20  # steps watched after each reset
BOUND = 6.0  # |update| / lr: Adam's own steps reach about 1-3 lr on this model


class ResetAt(ResetPolicy):
    """Reset every parameter after the given optimizer steps."""

    needs_sync = False

    def __init__(self, steps: tuple[int, ...], moments) -> None:
        super().__init__(moments)
        self.steps = steps

    def should_reset(self, unit, step: int) -> bool:
        return step in self.steps

    def due(self, ledger, step: int) -> np.ndarray:
        return np.full(len(ledger.rows), step in self.steps)


def largest_update_after_resets(kind: str, moments, at=(8, 60), **options) -> float:
    """The largest |update| / lr over every element in the WINDOW steps after each reset."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    if kind == "torch_bf16":
        model = model.bfloat16()
    opt = make_optimizer(kind, list(model.parameters()), lr=LR, weight_decay=0.0, min_8bit_size=256,
                         min_quantized_size=256, compile=False)
    monitor = StaleStateMonitor(opt, reset=ResetAt(at, moments), **options)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 32, generator=g), torch.randn(512, 8, generator=g)
    watched = {s for a in at for s in range(a + 1, a + WINDOW + 1)}
    largest = 0.0
    for step in range(1, max(at) + WINDOW + 1):
        batch = torch.randint(0, 512, (32,), generator=g)
        before = [p.detach().float().clone() for p in model.parameters()]
        nn.functional.mse_loss(model(x[batch].to(model[0].weight.dtype)).float(), y[batch]).backward()
        opt.step()
        opt.zero_grad()
        if step in watched:
            moved = max(float((p.detach().float() - b).abs().max()) for p, b in zip(model.parameters(), before))
            largest = max(largest, moved / LR if math.isfinite(moved) else math.inf)
    assert monitor.reset_events == len(at)
    monitor.close()
    return largest


KINDS = ["bnb", "torch_bf16"] + [f"qadamw:{fmt}:{r}" for fmt in ("fp8_e4m3", "fp4", "int8_dynamic", "bf16")
                                 for r in ("nearest", "stochastic")]


@pytest.mark.parametrize("moments", [("m", "v"), ("v",)], ids=["full", "v-only"])
@pytest.mark.parametrize("kind", KINDS)
def test_updates_after_a_reset_stay_within_a_small_multiple_of_lr(kind, moments):
    # Per-tensor fp8 states diverge on this model with or without resets (v underflows to zero under the tensor's
    # scale while m does not: benchmarks/reset_safety.py): they need the underflow guard, resets or not.
    options = {"underflow_guard": True} if kind.startswith("qadamw:fp8") else {}
    assert largest_update_after_resets(kind, moments, **options) <= BOUND


@pytest.mark.parametrize("kind", ["qadamw:fp4:nearest", "qadamw:int8_dynamic:stochastic"])
def test_the_exact_v_only_reset_is_unbounded_as_documented(kind):
    exact = largest_update_after_resets(kind, ("v",), v_reset="exact-unbounded")
    bounded = largest_update_after_resets(kind, ("v",))
    assert exact > 10 * bounded
