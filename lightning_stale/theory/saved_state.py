"""Stored second-moment values and their grid spacing, read from a saved optimizer state_dict [extension].

Feeds :func:`lightning_stale.theory.estimate_grid` from ``torch.save(optimizer.state_dict(), path)`` of
lightning_stale's QuantizedAdamW, bitsandbytes 8-bit optimizers, torchao low-bit optimizers (8-bit, 4-bit, FP8) or a
torch Adam/AdamW whose ``exp_avg_sq`` is a bf16/fp16/fp32 tensor. Spacing follows the ulp convention of the formats
module (distance to the next larger representable magnitude).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_stale.formats import QuantizedState, get_format
from lightning_stale.formats.base import as_blocks, unpack_nibbles
from lightning_stale.formats.floats import float_ulp
from lightning_stale.formats.fp8 import e4m3_spacing
from lightning_stale.formats.int8_dynamic import spacing_from_codes

BNB_NESTED_KEY = "__bnb_optimizer_quant_state__"


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
    found = [_v_of_entry(entry, group_of.get(pid, {})) for pid, entry in state_dict["state"].items()]
    found = [f for f in found if f is not None]
    if not found:
        raise ValueError("state has no second moment in a known layout (QuantizedAdamW exp_avg_sq, bitsandbytes "
                         "state2, torchao exp_avg_sq, or a float exp_avg_sq)")
    kept = [f for f in found if not _is_fp32(f[2])] or found
    v = torch.cat([f[0].reshape(-1).float() for f in kept])
    u = torch.cat([f[1].reshape(-1).float() for f in kept])
    described = ", ".join(sorted({f[2] for f in kept}))
    if len(kept) < len(found):
        described += f"; {len(found) - len(kept)} fp32 state tensor(s) left out"
    if v.numel() > limit:
        keep = torch.randperm(v.numel(), generator=torch.Generator().manual_seed(seed))[:limit]
        v, u = v[keep], u[keep]
    betas = groups[0].get("betas") if groups else None
    beta2 = float(betas[1]) if betas is not None else None
    return v, u, beta2, described


def _is_fp32(kind: str) -> bool:
    return kind.endswith(("fp32", "float32"))


def _v_of_entry(entry: Mapping[str, Any], group: Mapping[str, Any]) -> tuple[Tensor, Tensor, str] | None:
    if BNB_NESTED_KEY in entry:
        entry = {**entry, **entry[BNB_NESTED_KEY]}
    if "state2" in entry and "qmap2" in entry and entry["state2"].dtype == torch.uint8:
        return _block_map(entry["state2"], entry["absmax2"], entry["qmap2"]) + ("bitsandbytes 8-bit",)
    if "exp_avg_sq_scale" in entry or ("state_format" in group and "exp_avg_sq" in entry):
        return _quantized_adamw(entry, group)
    v = entry.get("exp_avg_sq", entry.get("state2"))
    if v is None:
        return None
    if hasattr(v, "codes") and hasattr(v, "scale"):
        return _torchao(v)
    if isinstance(v, Tensor) and v.is_floating_point() and v.dtype.itemsize >= 2:
        return _plain_float(v)
    return None


def _block_size(numel: int, blocks: int) -> int:
    """The power-of-two block size that splits ``numel`` elements into ``blocks`` blocks."""
    size = 2 ** math.ceil(math.log2(max(1, math.ceil(numel / blocks))))
    if math.ceil(numel / size) != blocks:
        raise ValueError(f"cannot infer a block size for {numel} elements in {blocks} blocks")
    return size


def _block_map(codes: Tensor, absmax: Tensor, qmap: Tensor, block_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Values and spacing of codes into a per-block-scaled map (bitsandbytes / torchao 8-bit and 4-bit)."""
    codes = codes.reshape(-1)
    block_size = block_size or _block_size(codes.numel(), absmax.numel())
    values = as_blocks(qmap.float().index_select(0, codes.long()), block_size) * absmax.reshape(-1, 1).float()
    spacing = spacing_from_codes(codes, absmax, qmap, block_size)
    return values.reshape(-1)[: codes.numel()], spacing


def _quantized_adamw(entry: Mapping[str, Any], group: Mapping[str, Any]) -> tuple[Tensor, Tensor, str]:
    names = group.get("state_format", {})
    name = names.get("v") if isinstance(names, Mapping) else names
    codes = entry["exp_avg_sq"]
    if name is None or (codes.dtype == torch.float32 and name != "fp32"):
        name = "fp32"  # parameters below min_quantized_size are stored in fp32
    fmt = get_format(name, signed=False)
    # fp4 packs two codes per byte; the shape is not saved, so an odd tensor contributes one padding element
    numel = codes.numel() * 2 if name == "fp4" else codes.numel()
    q = QuantizedState(codes, entry.get("exp_avg_sq_scale"), torch.Size([numel]))
    return fmt.dequantize(q), fmt.spacing(q), f"QuantizedAdamW {name}"


def _torchao(v: Any) -> tuple[Tensor, Tensor, str]:
    codes, scale = v.codes, v.scale
    block = int(v.block_size)
    qmap = getattr(v, "qmap", None)
    if qmap is None:  # OptimStateFp8: float8_e4m3fn codes, value = code * scale per block
        stored = codes.float().reshape(-1)
        blocks = scale.reshape(-1, 1).float()
        values = (as_blocks(stored, block) * blocks).reshape(-1)[: stored.numel()]
        ulp = (as_blocks(e4m3_spacing(codes.reshape(-1)), block) * blocks).reshape(-1)[: stored.numel()]
        return values, ulp, "torchao fp8"
    if qmap.numel() == 16:  # OptimState4bit: two nibbles per byte, first element in the high nibble
        codes = unpack_nibbles(codes)
        return _block_map(codes, scale, qmap, block) + ("torchao 4-bit",)
    return _block_map(codes, scale, qmap, block) + ("torchao 8-bit",)


def _plain_float(v: Tensor) -> tuple[Tensor, Tensor, str]:
    info = torch.finfo(v.dtype)
    mantissa_bits = round(-math.log2(info.eps))
    min_exponent = round(math.log2(info.tiny))
    values = v.detach().float()
    return values, float_ulp(values.abs(), mantissa_bits, min_exponent), f"torch {str(v.dtype).removeprefix('torch.')}"
