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
             coded: bool) -> None:
        (m,) = moments
        (beta1, beta2), lr, wd = config["betas"][:2], config["lr"], config["weight_decay"]
        if wd > 0.0:
            target.mul_(1.0 - lr * wd)
        if coded:
            direction = torch.sign(m.mul(beta1) + grad.mul(1.0 - beta1))
        else:
            direction = m.mul(beta1).add(grad, alpha=1.0 - beta1).sign()
        target.add_(direction, alpha=-lr)
        m.mul_(beta2).add_(grad, alpha=1.0 - beta2)


FAMILIES = {getattr(bnb_optim, f"{paged}Lion{bits}"): BitsAndBytesLion for paged in ("", "Paged")
            for bits in ("", "8bit", "32bit") if hasattr(bnb_optim, f"{paged}Lion{bits}")}
