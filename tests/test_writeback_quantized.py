"""The weight write-back's QuantizedAdamW family."""

from __future__ import annotations

import pytest
import torch

import writeback_checks as checks
from lightning_stale.act.writeback import WeightWriteBack
from lightning_stale.optim import QuantizedAdamW

LR = 1e-2
KW = dict(lr=LR, weight_decay=0.1)
OPTIMIZERS = {
    "int8": lambda p: QuantizedAdamW(p, **KW, min_quantized_size=256),
    "bf16_stochastic": lambda p: QuantizedAdamW(p, **KW, state_format="bf16", rounding="stochastic",
                                                min_quantized_size=0),
    "fp8": lambda p: QuantizedAdamW(p, **KW, state_format="fp8_e4m3", min_quantized_size=256),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_nearest_rounding_is_its_own_step_bit_for_bit(name):
    """Its own per-parameter step updates the weight the write-back hands it: with nearest rounding that is its step,
    weights, codes, scales and its stochastic-rounding stream included."""
    assert checks.conformance(OPTIMIZERS[name], LR) == (0.0, 0.0, True)


@pytest.mark.parametrize("rounding,moves", [("nearest", False), ("compensated", True), ("stochastic", True)])
def test_small_updates_move_only_with_stochastic_or_compensated_writes(rounding, moves):
    """fp32 moments, so that Adam's update is lr per step (far below the half gap 1/512 of bf16 just below 1.0)."""
    weight = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = QuantizedAdamW([weight], lr=1e-4, weight_decay=0.0, eps=1e-12, state_format="fp32")
    weight.grad = torch.ones_like(weight)
    opt.step()
    writeback = WeightWriteBack(opt, rounding)
    for _ in range(99):
        weight.grad = torch.ones_like(weight)
        opt.step()
    writeback.close()
    mean = weight.float().mean().item()
    if rounding == "compensated":  # stored within half a gap of 0.99, exact with its residual
        held = weight.float() + opt.state[weight]["lightning_stale.compensation"].float()
        assert abs(mean - 0.99) <= 2.0**-9 and abs(held.mean().item() - (0.99 + 1e-4)) < 1e-4
    elif moves:
        assert abs(mean - 0.99) < 1e-3
    else:
        assert mean == 1.0


def test_updates_stay_near_lr():
    """The write-back's update is the optimizer's own: near lr where its moments are (bf16), and no larger than the
    optimizer's own step where 8-bit v underflows beside a non-zero m on rows without gradient (an m / eps step:
    measured 47 lr with nearest rounding, which is its own step; the underflow guard's job)."""
    bf16 = lambda p: QuantizedAdamW(p, lr=LR, state_format="bf16", min_quantized_size=0)  # noqa: E731
    assert checks.largest_update(bf16, LR, "compensated") < 1.5
    assert checks.largest_update(OPTIMIZERS["int8"], LR, "compensated") <= \
        checks.largest_update(OPTIMIZERS["int8"], LR, "nearest") + 0.5
