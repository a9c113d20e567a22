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
             coded: bool, cuda: bool) -> Tensor | None:
        """On CUDA, with 8-bit states (``kOptimizerStatic8bit2StateBlockwise`` in bitsandbytes 0.50.1's
        ``csrc/kernels.cu``, lines 1017-1041 and 1092-1105): an element whose gradient is NaN or +-Inf gets m = v = 0
        (zeros in its block's absmax and codes) and keeps its weight, decay included. Its 32-bit kernel
        (``kOptimizer32bit2State``) tests no element: NaN and Inf run into m, v and the weight, as on CPU."""
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
        if not (cuda and coded):
            return None
        finite = grad.isfinite()  # the kernel's test, on the gradient as stored (its fp32 cast is exact)
        m.masked_fill_(~finite, 0.0)  # each element's weight above read only its own m and v
        v.masked_fill_(~finite, 0.0)
        return finite


FAMILIES = {getattr(bnb_optim, f"{paged}{name}{bits}"): BitsAndBytesAdam for paged in ("", "Paged")
            for name in ("Adam", "AdamW") for bits in ("", "8bit", "32bit")
            if hasattr(bnb_optim, f"{paged}{name}{bits}")}
