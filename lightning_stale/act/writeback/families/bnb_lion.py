"""bitsandbytes Lion (kernel ``"lion"``): 8-bit block-wise, paged and 32-bit (see :mod:`.bnb`).

Lion moves every weight by exactly lr (the sign of an interpolation of m and the gradient) plus its decay: a bf16
weight with |w| above about 256 lr never moves under nearest rounding.
"""

from __future__ import annotations

from typing import Any

import bitsandbytes.optim as bnb_optim
import torch
from torch import Tensor

from lightning_stale.act.writeback.families.bnb import BitsAndBytesFamily


class BitsAndBytesLion(BitsAndBytesFamily):
    """m (an EMA at beta2) in ``state1``; the step's direction interpolates it and the gradient at beta1."""

    kernel = "lion"
    states = 1

    def math(self, target: Tensor, grad: Tensor, moments: list[Tensor], config: dict[str, Any], step: int,
             coded: bool, cuda: bool) -> Tensor | None:
        """On CUDA (``kOptimizer32bit1State`` and ``kOptimizerStatic8bit1StateBlockwise`` in bitsandbytes 0.50.1's
        ``csrc/kernels.cu``, lines 881-889, 1233-1235, 1248-1252 and 1287-1288) no gradient element is tested, but
        the direction is ``sgn`` (line 158), 0 for NaN: an element whose interpolation is NaN (a NaN gradient) is
        decayed and not moved, and its m takes the NaN (its code is then bitsandbytes' quantize op's). torch's sign,
        which the CPU kernel uses, gives 0 for NaN too (torch 2.13); the CUDA rule is pinned here whatever it gives."""
        (m,) = moments
        (beta1, beta2), lr, wd = config["betas"][:2], config["lr"], config["weight_decay"]
        if wd > 0.0:
            target.mul_(1.0 - lr * wd)
        if coded:
            direction = torch.sign(m.mul(beta1) + grad.mul(1.0 - beta1))
        else:
            direction = m.mul(beta1).add(grad, alpha=1.0 - beta1).sign()
        if cuda:
            direction.nan_to_num_(0.0)
        target.add_(direction, alpha=-lr)
        m.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return None


FAMILIES = {getattr(bnb_optim, f"{paged}Lion{bits}"): BitsAndBytesLion for paged in ("", "Paged")
            for bits in ("", "8bit", "32bit") if hasattr(bnb_optim, f"{paged}Lion{bits}")}
