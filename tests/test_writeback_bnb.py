"""The weight write-back's bitsandbytes families: Adam/AdamW and Lion, 8-bit block-wise, paged and 32-bit."""

from __future__ import annotations

import warnings

import pytest
import torch

import writeback_checks as checks
from lightning_stale.act.writeback import WeightWriteBack

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes")
warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")

LR = 1e-2
KW = dict(lr=LR, weight_decay=0.1)

# Each computes in fp32 from its stored codes (or fp32 states) and the gradient; the write-back does its whole step
# with its own ops: nearest rounding writes its weights, codes and scales bit for bit.
OPTIMIZERS = {
    "adamw_8bit": lambda p: bnb.optim.AdamW8bit(p, **KW, min_8bit_size=256),
    "adam_8bit": lambda p: bnb.optim.Adam8bit(p, **KW, min_8bit_size=256),
    "paged_adamw_8bit": lambda p: bnb.optim.PagedAdamW8bit(p, **KW, min_8bit_size=256),
    "adamw_32bit": lambda p: bnb.optim.AdamW(p, **KW, optim_bits=32),
    "lion_8bit": lambda p: bnb.optim.Lion8bit(p, lr=1e-3, weight_decay=0.1, min_8bit_size=256),
    "lion_32bit": lambda p: bnb.optim.Lion32bit(p, lr=1e-3, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("closure", [True, False], ids=["closure", "plain-loop"])
def test_nearest_rounding_is_bitsandbytes_own_step_bit_for_bit(name, closure):
    lr = 1e-3 if name.startswith("lion") else LR
    assert checks.conformance(OPTIMIZERS[name], lr, closure=closure) == (0.0, 0.0, True)


@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
def test_lion_weights_move_where_nearest_rounding_stalls_them(rounding):
    """Lion moves every weight by exactly lr: at lr 1e-3 a bf16 weight of magnitude 1 (gap 2^-7) never moves under
    nearest rounding; with the write-back it follows the exact path (to within the residual's own rounding)."""
    runs = {}
    for mode in ("nearest", rounding):
        weight = torch.nn.Parameter(torch.ones(1 << 14, dtype=torch.bfloat16))
        opt = bnb.optim.Lion8bit([weight], lr=1e-3, weight_decay=0.0, min_8bit_size=256)
        weight.grad = torch.ones_like(weight)
        opt.step()
        writeback = WeightWriteBack(opt, mode)
        for _ in range(100):
            weight.grad = torch.ones_like(weight)
            opt.step()
        writeback.close()
        buffer = opt.state[weight].get("lightning_stale.compensation")
        runs[mode] = (weight.float() + (0 if buffer is None else buffer.float())).mean().item()
    assert runs["nearest"] == 1.0
    assert runs[rounding] == pytest.approx(1.0 - 100e-3, abs=1e-3)


@pytest.mark.parametrize("name", ["adamw_8bit", "lion_8bit"])
def test_updates_stay_near_lr(name):
    """Largest |update| / lr beyond the rounding's share, with rows that stop getting gradient (measured 1.0)."""
    lr = 1e-3 if name.startswith("lion") else LR
    assert checks.largest_update(OPTIMIZERS[name], lr, "compensated") < 1.5


@pytest.mark.parametrize("setting,match", [("max_unorm", "max_unorm"), ("skip_zeros", "skip_zeros"),
                                           ("moments", "moments='stochastic'")])
def test_refused_configurations_say_why(setting, match):
    opt = bnb.optim.AdamW8bit(checks.model().parameters())
    if setting == "max_unorm":
        opt.args.max_unorm = 1.0
    elif setting == "skip_zeros":
        opt.args.skip_zeros = True
    with pytest.raises(ValueError, match=match):
        WeightWriteBack(opt, moments="stochastic" if setting == "moments" else "nearest")


def test_other_bitsandbytes_kernels_are_refused_by_name():
    with pytest.raises(ValueError, match="AdEMAMix8bit: not a supported optimizer family"):
        WeightWriteBack(bnb.optim.AdEMAMix8bit(checks.model().parameters()))
