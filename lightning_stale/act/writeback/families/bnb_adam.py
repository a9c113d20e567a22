"""bitsandbytes Adam/AdamW (kernel ``"adam"``): 8-bit block-wise, paged and 32-bit (see :mod:`.bnb`)."""

from __future__ import annotations

import math
from typing import Any

import bitsandbytes.optim as bnb_optim
from torch import Tensor

from lightning_stale.act.writeback.families.bnb import BitsAndBytesFamily


class BitsAndBytesAdam(BitsAndBytesFamily):
    """m in ``state1``, v in ``state2``."""

    kernel = "adam"
    states = 2

    def math(self, target: Tensor, grad: Tensor, moments: list[Tensor], config: dict[str, Any], step: int,
             coded: bool) -> None:
        m, v = moments
        (beta1, beta2), lr, eps, wd = config["betas"][:2], config["lr"], config["eps"], config["weight_decay"]
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        correction1, correction2 = 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
        if coded:
            denom = (v.sqrt() / correction2).add_(eps)
            if wd > 0.0:
                target.mul_(1.0 - lr * wd)
            target.addcdiv_(m, denom, value=-lr / correction1)
        else:
            if wd > 0.0:
                target.mul_(1.0 - lr * wd)
            target.add_(m / (v.sqrt() + eps * correction2), alpha=-lr * correction2 / correction1)


FAMILIES = {getattr(bnb_optim, f"{paged}{name}{bits}"): BitsAndBytesAdam for paged in ("", "Paged")
            for name in ("Adam", "AdamW") for bits in ("", "8bit", "32bit")
            if hasattr(bnb_optim, f"{paged}{name}{bits}")}
