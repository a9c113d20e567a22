"""The safe second-moment restart used where an optimizer keeps one step counter for both moments.

Why: bitsandbytes, torchao and torch.optim keep a single ``step`` per parameter. A v-only reset can then neither
restart v's bias-correction age alone (restarting ``step`` inflates the kept m about 10x) nor zero v and keep
``step`` (v is then un-bias-corrected and the next update is about ``1/sqrt(1 - beta2)`` = 31.6x too large, or
``m/eps`` for a zero gradient).

The scheme: keep ``step`` and m, and write v so that the *next* bias-corrected second moment is

    v_hat_next = s**2,   s**2 = max(g**2, n_hat**2)   (per element)

when the next gradient equals ``g``, the gradient of the last step (``param.grad`` at reset time), where ``n_hat`` is
the optimizer's bias-corrected update numerator (``m / (1 - beta1**t)`` for Adam). With the ``g**2`` term this is
the paper's age-1 restart (``v_hat = g**2`` after one step) with the last gradient standing in for the next one; the
``n_hat**2`` floor keeps the kept first moment from outrunning the fresh denominator, so the next update satisfies
``|update| <= lr * |n_hat_next| / s <= lr``, the size of a first Adam step. If the next gradient is much larger than
``s`` the bound loosens smoothly to ``lr * (1 - beta1) / sqrt(1 - beta2)`` (3.2x at the default betas), never to
``m / eps``. Stored values are rounded *up* onto the state's grid (``round_up_float``, ``round_up_blockwise`` and
``round_up_fp8_blockwise`` in :mod:`lightning_stale.formats`) so quantization cannot undo the bound.
"""

from __future__ import annotations

import torch
from torch import Tensor


def restarted_v(numerator: Tensor, grad: Tensor | None, step: int | Tensor, beta2: float) -> Tensor:
    """The fp32 stored v that makes next step's ``v_hat`` equal ``max(grad**2, numerator**2)`` (see module doc).

    ``numerator`` is the bias-corrected update numerator at the current ``step`` (the optimizer's shared counter,
    kept; a number, or a 0-d tensor on any device); ``grad`` the gradient of the last step, or None when it is gone
    (the ``numerator`` floor alone is used).
    """
    num2 = numerator.float().square()
    g2 = grad.float().square().reshape(num2.shape) if grad is not None else torch.zeros_like(num2)
    s2 = torch.maximum(num2, g2)
    c2_next = 1.0 - beta2 ** (step + 1)
    return ((c2_next * s2 - (1.0 - beta2) * g2) / beta2).clamp_min(0.0)
