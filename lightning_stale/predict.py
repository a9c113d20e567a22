"""Theory predictions for one slot: its effective rho-hat, predicted stall after j steps and reset period K*.

Float formats (bf16, fp16, fp8, fp4) use the paper's closed form from the format's precision; other grids (the 8-bit
dynamic map of bitsandbytes/torchao, foreign layouts) use the generalized estimate on the slot's stored values and
local spacing (:func:`lightning_stale.theory.estimate_grid`, our extension of the paper).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from torch import Tensor

from lightning_stale import theory
from lightning_stale.adapters.base import Slot, gather
from lightning_stale.formats import FORMAT_NAMES, get_format


def slot_rho_hat(slot: Slot, index: Tensor) -> tuple[float | None, str]:
    """(rho-hat, where it came from) for a slot; rho-hat is None when the theory does not apply."""
    if slot.beta is None:
        return None, "not an EMA"
    if slot.format == "fp32":
        return None, "fp32 (no staleness)"
    known = slot.format in FORMAT_NAMES
    theory_name = get_format(slot.format, signed=slot.moment == "m").theory_name if known else None
    if theory_name is not None:
        return theory.format_rho_hat(theory_name, slot.beta), f"{theory_name} format"
    spacing = slot.spacing()
    if spacing is None or index.numel() == 0:
        return None, f"unknown grid ({slot.format})"
    estimate = theory.estimate_grid(slot.value_at(index).float(), gather(spacing, index).float(), slot.beta)
    if estimate.n == 0:
        return None, f"grid estimate ({slot.format}): no non-zero values yet"
    return estimate.rho_hat, f"grid estimate ({slot.format})"


def reset_period_for(slot: Slot, index: Tensor, s0: float) -> tuple[int | None, str]:
    """The theory-guided reset period K* of a slot, or None (with the reason) when no reset is warranted.

    The paper's crossing rule (Eq. 53) is derived for rho-hat >= 1, where most updates stall at steady state; below
    that the state keeps moving and we do not reset (K* is defined relative to the steady state, so it would stay
    finite even for an almost never stalling state).
    """
    rho, source = slot_rho_hat(slot, index)
    if rho is None:
        return None, source
    if rho < 1.0:
        return None, f"{source}, rho-hat {rho:.2f} < 1: state keeps moving, no reset"
    period = theory.reset_period(rho, slot.beta, s0)
    return period, source if period is not None else f"{source}, rho-hat {rho:.2f}: no crossing"


@lru_cache(maxsize=64)
def _build_up_curve(rho: float, beta: float) -> np.ndarray:
    """P_stall(j) for j = 0 .. ~20 EMA horizons (after that the curve is flat at its steady state)."""
    horizon = min(int(20 / (1.0 - beta)) + 1, 200_000)
    return theory.stall_probability_after(np.arange(horizon), rho, beta)


def predicted_stall(rho: float | None, beta: float | None, updates: int) -> float | None:
    """Predicted stall probability of an update applied to a state that holds ``updates`` updates since its zero
    start or last reset (paper Eq. 39; 0 for the first update after a reset). Cached: cheap enough per step."""
    if rho is None or beta is None:
        return None
    curve = _build_up_curve(rho, beta)
    return float(curve[min(updates, len(curve) - 1)])
