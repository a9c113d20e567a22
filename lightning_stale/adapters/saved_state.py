"""Stored second-moment values and their grid spacing, read from a saved optimizer state_dict.

Feeds :func:`lightning_stale.theory.estimate_grid` (``lightning-stale period --state``) from
``torch.save(optimizer.state_dict(), path)`` of lightning_stale's QuantizedAdamW, bitsandbytes 8-bit optimizers,
torchao low-bit optimizers (8-bit, 4-bit, FP8) or a torch Adam/AdamW whose ``exp_avg_sq`` is a float tensor. Each
layout is read by the same slot class the live adapters use, over a stand-in parameter (a saved state has none).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_stale.adapters.layouts import BlockQmapSlot, FloatSlot
from lightning_stale.adapters.protocol import Slot

BNB_NESTED_KEY = "__bnb_optimizer_quant_state__"  # where bitsandbytes' state_dict nests its quantization state


def load_v_sample(path: str, limit: int = 1_000_000, seed: int = 0) -> tuple[Tensor, Tensor, float | None, str]:
    """Load ``path`` (CPU, ``weights_only``) and return :func:`v_sample` of it; ValueError if it cannot be loaded."""
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as first:  # torchao's tensor subclasses load once torchao has registered them as safe globals
        try:
            import torchao.optim  # noqa: F401

            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            raise ValueError(f"state: cannot load {path!r}: {first}") from None
    return v_sample(state_dict, limit, seed)


def v_sample(
    state_dict: Mapping[str, Any], limit: int = 1_000_000, seed: int = 0
) -> tuple[Tensor, Tensor, float | None, str]:
    """(values, spacing, beta2 or None, description) of the stored v of every parameter in an optimizer state_dict.

    fp32 states (small parameters that 8-bit optimizers keep in fp32) are left out when any low-precision state
    exists: their tiny spacing would dominate the harmonic mean of the grid estimate. At most ``limit`` elements are
    kept (a uniform random subset, seeded). Raises ValueError when no second moment with a known layout is found.
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict:
        raise ValueError("state must be an optimizer state_dict (a mapping with 'state' and 'param_groups')")
    groups = state_dict.get("param_groups", [])
    group_of = {pid: g for g in groups for pid in g.get("params", [])}
    found = [_v_slot(entry, group_of.get(pid, {})) for pid, entry in state_dict["state"].items()]
    found = [f for f in found if f is not None]
    if not found:
        raise ValueError("state has no second moment in a known layout (QuantizedAdamW exp_avg_sq, bitsandbytes "
                         "state2, torchao exp_avg_sq, or a float exp_avg_sq)")
    kept = [(slot, kind) for slot, kind in found if not kind.endswith(("fp32", "float32"))] or found
    v = torch.cat([slot.value().reshape(-1).float() for slot, _ in kept])
    u = torch.cat([slot.spacing().reshape(-1).float() for slot, _ in kept])
    described = ", ".join(sorted({kind for _, kind in kept}))
    if len(kept) < len(found):
        described += f"; {len(found) - len(kept)} fp32 state tensor(s) left out"
    if v.numel() > limit:
        keep = torch.randperm(v.numel(), generator=torch.Generator().manual_seed(seed))[:limit]
        v, u = v[keep], u[keep]
    betas = groups[0].get("betas") if groups else None
    beta2 = float(betas[1]) if betas is not None else None
    return v, u, beta2, described


def _stand_in(numel: int) -> Tensor:
    """A parameter-shaped placeholder (no storage): slots take their element count from their parameter."""
    return torch.empty(numel, device="meta")


def _v_slot(entry: Mapping[str, Any], group: Mapping[str, Any]) -> tuple[Slot, str] | None:
    """The slot reading the stored v of one saved parameter entry, with a description; None for other layouts."""
    if BNB_NESTED_KEY in entry:
        entry = {**entry, **entry[BNB_NESTED_KEY]}
    if "state2" in entry and "qmap2" in entry and entry["state2"].dtype == torch.uint8:
        codes, absmax = entry["state2"], entry["absmax2"]
        slot = BlockQmapSlot(_stand_in(codes.numel()), "v", None, "int8_dynamic", "state2", stored=codes,
                             scale=absmax.reshape(-1), qmap=entry["qmap2"],
                             block_size=_block_size(codes.numel(), absmax.numel()))
        return slot, "bitsandbytes 8-bit"
    if "exp_avg_sq_scale" in entry or ("state_format" in group and "exp_avg_sq" in entry):
        return _quantized_adamw(entry, group)
    v = entry.get("exp_avg_sq", entry.get("state2"))
    if v is None:
        return None
    if hasattr(v, "codes") and hasattr(v, "scale"):
        from lightning_stale.adapters.torchao import buffer_slot  # only torchao states get here

        slot = buffer_slot(_stand_in(v.numel()), v, "exp_avg_sq", "v", 0.0)
        return slot, {"int8_dynamic": "torchao 8-bit", "fp8_e4m3": "torchao fp8"}.get(slot.format, "torchao 4-bit")
    if isinstance(v, Tensor) and v.is_floating_point() and v.dtype.itemsize >= 2:
        return FloatSlot(_stand_in(v.numel()), "v", None, str(v.dtype), "exp_avg_sq", tensor=v.detach()), \
            f"torch {str(v.dtype).removeprefix('torch.')}"
    return None


def _block_size(numel: int, blocks: int) -> int:
    """The power-of-two block size that splits ``numel`` elements into ``blocks`` blocks."""
    size = 2 ** math.ceil(math.log2(max(1, math.ceil(numel / blocks))))
    if math.ceil(numel / size) != blocks:
        raise ValueError(f"cannot infer a block size for {numel} elements in {blocks} blocks")
    return size


def _quantized_adamw(entry: Mapping[str, Any], group: Mapping[str, Any]) -> tuple[Slot, str]:
    from lightning_stale.adapters.quantized import format_slot
    from lightning_stale.formats import QuantizedState, get_format

    names = group.get("state_format", {})
    name = names.get("v") if isinstance(names, Mapping) else names
    codes = entry["exp_avg_sq"]
    if name is None or (codes.dtype == torch.float32 and name != "fp32"):
        name = "fp32"  # parameters below min_quantized_size are stored in fp32
    # fp4 packs two codes per byte; the shape is not saved, so an odd tensor contributes one padding element
    numel = codes.numel() * 2 if name == "fp4" else codes.numel()
    q = QuantizedState(codes, entry.get("exp_avg_sq_scale"), torch.Size([numel]))
    return format_slot(_stand_in(numel), "v", 0.0, get_format(name, signed=False), q), f"QuantizedAdamW {name}"
