"""The weight write-back's torch.optim.SGD family: conformance, momentum variants, the stall it removes."""

from __future__ import annotations

import pytest
import torch

import writeback_checks as checks
from lightning_stale.act.writeback import WeightWriteBack

LR = 1e-2

# name -> (optimizer, bounds) as in test_writeback_torch_adam. torch's for-loop and foreach SGD round each op to bf16:
# measured <= 0.6% of the weights differ, by <= 0.049 lr (half a bf16 gap of the smallest weights). torch's CPU fused
# SGD (fused=True) is left out: with momentum and weight decay its bf16 momentum buffer is far from the exact one
# (measured mean |error| 1.0 against for-loop's 0.002, on 100,000 random elements), so it is no reference.
IMPLEMENTATIONS = {
    "momentum_forloop": (lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, weight_decay=0.1, foreach=False),
                         (0.02, 0.075)),
    "momentum_dampening_foreach": (lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, dampening=0.1,
                                                             weight_decay=0.1, foreach=True), (0.02, 0.075)),
    "nesterov": (lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True, foreach=False), (0.02, 0.075)),
    "plain_maximize": (lambda p: torch.optim.SGD(p, lr=LR, weight_decay=0.1, maximize=True), (0.01, 0.04)),
}


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_nearest_rounding_writes_torchs_own_weights(name):
    make, (share, size) = IMPLEMENTATIONS[name]
    worst_share, worst_size, _ = checks.conformance(make, LR)
    assert worst_share <= share and worst_size <= size


@pytest.mark.parametrize("rounding,moves", [("nearest", False), ("compensated", True), ("stochastic", True)])
def test_updates_under_half_a_gap_move_only_with_stochastic_or_compensated_writes(rounding, moves):
    """SGD with momentum at lr 1e-5 and gradient 1: each update (at most 1e-4 with momentum) is under half the bf16
    gap below 1.0 (1/256), so nearest rounding keeps the weights at 1.0 for good; compensated summation follows the
    exact path from the optimizer's own first step (which nearest rounding lost), stochastic rounding on average."""
    weight = torch.nn.Parameter(torch.ones(1 << 15, dtype=torch.bfloat16))
    opt = torch.optim.SGD([weight], lr=1e-5, momentum=0.9)
    weight.grad = torch.ones_like(weight)
    opt.step()  # the optimizer's own first step creates its momentum buffer
    writeback = WeightWriteBack(opt, rounding)
    for _ in range(200):
        weight.grad = torch.ones_like(weight)
        opt.step()
    writeback.close()
    exact, buffer = 1.0, torch.tensor(1.0, dtype=torch.bfloat16)  # the exact path from the same bf16 buffer
    for _ in range(200):
        value = buffer.float() * 0.9 + 1.0  # the write-back's fp32 buffer, then stored to nearest
        exact -= 1e-5 * value.item()
        buffer = value.bfloat16()
    if not moves:
        assert bool((weight == 1.0).all())
        return
    held = weight.float() + opt.state[weight]["lightning_stale.compensation"].float() \
        if rounding == "compensated" else weight.float()
    # to within the bf16 residual's own rounding (measured 0.8% of the distance travelled) or the noise's mean (0.2%)
    assert held.mean().item() == pytest.approx(exact, abs=0.01 * (1.0 - exact))


def test_updates_stay_near_lr():
    """Largest |update| / lr beyond the rounding's share: SGD's update is lr * (momentum sum of gradients), at most
    lr / (1 - momentum) x the largest gradient here; measured well inside 10."""
    assert checks.largest_update(lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9), LR, "compensated") < 10.0


def test_refuses_differentiable():
    with pytest.raises(ValueError, match="differentiable"):
        WeightWriteBack(torch.optim.SGD(checks.model().parameters(), lr=LR, differentiable=True))
