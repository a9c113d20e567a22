"""Saved optimizer states, read with the slot classes the live adapters use, and the checkpoints that hold them.

A saved state has no parameters: each slot gets a stand-in of the parameter's shape (no storage), so that its element
count and the grid estimate's sample positions are the live ones. :func:`read_optimizer` gives every stored moment of
every parameter of one optimizer ``state_dict`` (torch.optim, bitsandbytes two-state optimizers in 8 or 32 bits,
torchao low-bit, lightning_stale's QuantizedAdamW, and any family added with :func:`register_saved_reader`, the
offline twin of ``register_adapter``) with the format names the live adapters report.
:func:`load_checkpoint` finds the optimizer state_dicts, the model's parameter names and weights and the monitor's
own saved state in what users have: a Lightning checkpoint, a ``torch.save``'d dict or bare state_dict, LitGPT's
``lit_model.pth``, a Hugging Face checkpoint folder, a distributed checkpoint folder, a folder holding one checkpoint
file. :func:`optimizer_name` says which class saved a state, as far as it tells. :func:`load_v_sample` feeds
``lightning-stale period --state``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale.adapters import bnb_layout
from lightning_stale.adapters.layouts import BlockFp8Slot, BlockQmapSlot, FloatSlot
from lightning_stale.adapters.protocol import Moment, Slot
from lightning_stale.state import from_json, upgrade
from lightning_stale.vocab import COMPENSATION_KEY

BNB_NESTED_KEY = "__bnb_optimizer_quant_state__"  # where bitsandbytes' state_dict nests its quantization state
CHECKPOINT = ("an optimizer state_dict or a checkpoint holding one (a Lightning .ckpt, a torch.save'd dict, LitGPT's "
              "lit_model.pth, a Hugging Face or distributed checkpoint folder)")
FAMILIES = "torch.optim, bitsandbytes, torchao or QuantizedAdamW"
# torch.optim state keys read as moments: key -> (moment, the group entry holding its beta, index in it or None)
TORCH_MOMENTS: dict[str, tuple[Moment, str | None, int | None]] = {
    "exp_avg": ("m", "betas", 0),  # Adam, AdamW, RAdam, NAdam, Adamax
    "exp_avg_sq": ("v", "betas", 1),
    "exp_inf": ("v", None, None),  # Adamax: a decayed running max, not an EMA
    "variance": ("v", None, None),  # Adafactor vectors: its beta2 follows a schedule
    "momentum_buffer": ("m", None, None),  # SGD
    "square_avg": ("v", "alpha", None),  # RMSprop
    "sum": ("v", None, None),  # Adagrad
}
TORCH_FACTORS = ("row_var", "col_var")  # Adafactor's factored v of a matrix: (..., rows, 1) and (..., 1, cols)
MODEL_BUFFERS = ("running_mean", "running_var")  # floating tensors of a model state_dict that no optimizer holds
HF_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
LITGPT_FILE = "lit_model.pth"  # LitGPT's checkpoint file, in its out_dir's final/ and step-*/ folders
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")  # a folder holding one file of these is read as that file
MONITOR_CALLBACK = "StaleStateCallback"  # the Lightning callback's state keys start with its class name


class SavedStateError(ValueError):
    """A saved state or checkpoint this reader cannot use; the message says what was expected and what was found."""

    def __init__(self, expected: str, found: str) -> None:
        super().__init__(f"{expected}, found {found}")


# -- one optimizer's state_dict --------------------------------------------------------------------------------------
@dataclass(eq=False)
class SavedParam:
    """One parameter's saved state: its slots (m before v, as the live adapters list them) and its step counter."""

    index: int  # position in the optimizer's param groups: the live monitor's unit key is f"opt<i>.{index}"
    slots: list[Slot]
    step: int | None
    shape: tuple[int, ...] | None  # None where the state does not show it (QuantizedAdamW's packed fp4 codes)
    compensation: Tensor | None = None  # the weight write-back's compensation buffer, where the state holds one


@dataclass(eq=False)
class SavedOptimizer:
    """The parameters with state of one saved optimizer, in param-group order."""

    family: str  # the live adapters' family names: torch.optim, bitsandbytes, torchao, lightning_stale
    params: list[SavedParam]
    idents: list[int | str]  # every parameter of the param groups, in order, with state or not
    groups: list[Mapping[str, Any]]
    compensated: int = 0  # parameters with a weight write-back compensation buffer (not a moment: no slot)
    name: str = ""  # the optimizer's class, in words, as far as the saved state tells it


def is_optimizer_state(value: Any) -> bool:
    """Whether ``value`` looks like an optimizer ``state_dict``."""
    return isinstance(value, Mapping) and isinstance(value.get("state"), Mapping) \
        and isinstance(value.get("param_groups"), (list, tuple))


def read_optimizer(state_dict: Any, shapes: Mapping[int, tuple[int, ...]] | None = None) -> SavedOptimizer:
    """Every stored moment of every parameter of an optimizer ``state_dict``, as slots. ``shapes`` gives parameter
    shapes (by position) that the state does not show. SavedStateError for anything else or an unknown family."""
    if not is_optimizer_state(state_dict):
        raise SavedStateError("an optimizer state_dict (a mapping with 'state' and 'param_groups')",
                              describe(state_dict))
    groups = list(state_dict["param_groups"])
    idents = [pid for group in groups for pid in group.get("params", [])]
    group_of = {pid: group for group in groups for pid in group.get("params", [])}
    saved = {pid: entry for pid, entry in state_dict["state"].items() if isinstance(entry, Mapping) and entry}
    compensated = sum(1 for entry in saved.values() if COMPENSATION_KEY in entry)
    entries = {pid: entry for pid, entry in ((pid, _flat(entry)) for pid, entry in saved.items()) if entry}
    reader = _reader(entries, groups)
    params = []
    for index, pid in enumerate(idents):
        entry = entries.get(pid, entries.get(str(pid)))  # a distributed checkpoint turns integer keys into strings
        if entry is not None:
            param = reader.read_param(index, entry, group_of[pid], (shapes or {}).get(index))
            buffer = saved.get(pid, saved.get(str(pid), {})).get(COMPENSATION_KEY)
            param.compensation = buffer if isinstance(buffer, Tensor) else None
            params.append(param)
    return SavedOptimizer(reader.family, params, idents, groups, compensated, optimizer_name(reader.family, entries,
                                                                                            groups))


def optimizer_name(family: str, entries: Entries, groups: Sequence[Mapping[str, Any]]) -> str:
    """The optimizer's class as far as its saved state tells it, with its family: torch.optim's param groups name
    their class by their keys (Adam and AdamW by ``decoupled_weight_decay``, which torch 2.6's groups lack); where
    the state cannot tell classes apart, each candidate is named."""
    group = groups[0] if groups else {}
    keys = _keys(entries)
    if family == "torch.optim":
        decoupled = group.get("decoupled_weight_decay")
        if "momentum_decay" in group:
            name = "NAdam"
        elif "amsgrad" in group:
            name = "Adam or AdamW" if decoupled is None else "AdamW" if decoupled else "Adam"
        elif "beta2_decay" in group or keys & {*TORCH_FACTORS, "variance"}:
            name = "Adafactor"
        elif "exp_inf" in keys:
            name = "Adamax"
        elif decoupled is not None and "betas" in group:
            name = "RAdam"
        elif "nesterov" in group or "momentum_buffer" in keys:
            name = "SGD"
        elif "centered" in group or "square_avg" in keys:
            name = "RMSprop"
        elif "lr_decay" in group or "sum" in keys:
            name = "Adagrad"
        else:
            name = "Adam, AdamW, NAdam or RAdam"
        return f"{name} (torch.optim)"
    if family == "bitsandbytes":
        codes = next((entry["state1"] for entry in entries.values() if isinstance(entry.get("state1"), Tensor)), None)
        bits = "8-bit" if codes is not None and codes.dtype == torch.uint8 else "32-bit"
        name = "AdEMAMix" if float(group.get("alpha") or 0.0) > 0 else "Adam, AdamW or LAMB"
        return f"{name} (bitsandbytes, {bits})"
    if family == "torchao":
        return "Adam or AdamW (torchao, low-bit)"
    if family == "lightning_stale":
        return "QuantizedAdamW (lightning_stale)"
    return family


Entries = Mapping[Any, Mapping[str, Any]]  # a state_dict's per-parameter entries (bitsandbytes' nesting merged in)


@dataclass(frozen=True)
class SavedReader:
    """How to read one optimizer family's saved state: ``recognizes(entries, param_groups)`` says whether a state is
    its own, ``read_param(index, entry, group, shape)`` gives one parameter's :class:`SavedParam` (``shape`` where
    known from elsewhere, else None) and ``describe(slot)`` names a stored v for ``period --state``."""

    family: str
    recognizes: Callable[[Entries, Sequence[Mapping[str, Any]]], bool]
    read_param: Callable[[int, Mapping[str, Any], Mapping[str, Any], tuple[int, ...] | None], SavedParam]
    describe: Callable[[Slot], str]


_READERS: list[SavedReader] = []  # the latest registration first


def register_saved_reader(family: str, recognizes: Callable[[Entries, Sequence[Mapping[str, Any]]], bool],
                          read_param: Callable[..., SavedParam],
                          describe: Callable[[Slot], str] | None = None) -> None:
    """Read the saved states that ``recognizes`` accepts with ``read_param`` (see :class:`SavedReader`; tried before
    the readers registered earlier, as a later ``register_adapter`` wins)."""
    _READERS.insert(0, SavedReader(family, recognizes, read_param,
                                   describe or (lambda slot: f"{family} {slot.format}")))


def stand_in(shape: Sequence[int]) -> Tensor:
    """A parameter-shaped placeholder without storage (one element, expanded): slots take their element count and
    sample positions from their parameter's shape, and read nothing from it."""
    return torch.zeros(()).expand(*shape)


def _reader(entries: Entries, groups: Sequence[Mapping[str, Any]]) -> SavedReader:
    if not entries:
        return _by_family("torch.optim")  # no parameter has state: nothing to read, whatever the family
    found = next((reader for reader in _READERS if reader.recognizes(entries, groups)), None)
    if found is None:
        keys = {key for entry in entries.values() for key in entry}
        raise SavedStateError(f"an optimizer state of a known family ({FAMILIES})",
                              f"an optimizer state with keys {sorted(map(str, keys))}")
    return found


def _by_family(family: str) -> SavedReader:
    return next(reader for reader in _READERS if reader.family == family)


def _flat(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's saved entry with bitsandbytes' nested quantization state merged in, without the weight
    write-back's compensation buffer (the optimizer's state, but no moment)."""
    nested = entry.get(BNB_NESTED_KEY)
    flat = {**entry, **nested} if isinstance(nested, Mapping) else dict(entry)
    flat.pop(COMPENSATION_KEY, None)
    return flat


def _is_torchao(value: Any) -> bool:
    return isinstance(value, Tensor) and hasattr(value, "codes") and hasattr(value, "scale")


def _keys(entries: Entries) -> set[str]:
    return {key for entry in entries.values() for key in entry}


def _is_bnb(entries: Entries, groups: Sequence[Mapping[str, Any]]) -> bool:
    keys = _keys(entries)
    if "state1" in keys and "state2" not in keys:
        raise SavedStateError("an optimizer state of a two-state bitsandbytes optimizer (Adam, AdamW, LAMB, AdEMAMix)",
                              "a one-state bitsandbytes state ('state1' only: Lion, SGD, RMSprop or Adagrad, which the "
                              "saved state does not tell apart)")
    return "state1" in keys


def _step(value: Any) -> int | None:
    return None if value is None else int(value)


def _torch_param(index: int, entry: Mapping[str, Any], group: Mapping[str, Any],
                 shape: tuple[int, ...] | None) -> SavedParam:
    from lightning_stale.adapters.torch_optim import FactorSlot, float_slot

    present = [key for key in TORCH_MOMENTS if isinstance(entry.get(key), Tensor)]
    factors = [key for key in TORCH_FACTORS if isinstance(entry.get(key), Tensor)]
    if present:
        shape = tuple(entry[present[0]].shape)
    elif len(factors) == 2:  # the matrix both factors spread over
        shape = (*entry["row_var"].shape[:-1], entry["col_var"].shape[-1])
    placeholder = stand_in(shape or (0,))
    slots: list[Slot] = []
    for key in present:
        moment, beta_key, beta_index = TORCH_MOMENTS[key]
        beta = group.get(beta_key) if beta_key is not None else None
        beta = beta[beta_index] if beta is not None and beta_index is not None else beta
        slots.append(float_slot(placeholder, entry, key, moment, None if beta is None else float(beta)))
    if len(factors) == 2:  # as the live adapter reads them: each element reads its row's and its column's factor
        slots.extend(float_slot(placeholder, entry, key, "v", None, FactorSlot) for key in factors)
    return SavedParam(index, slots, _step(entry.get("step")), shape)


def _torchao_param(index: int, entry: Mapping[str, Any], group: Mapping[str, Any],
                   shape: tuple[int, ...] | None) -> SavedParam:
    from lightning_stale.adapters.torchao import KEYS, buffer_slot

    shape = tuple(entry["exp_avg"].shape)
    placeholder = stand_in(shape)
    slots = [buffer_slot(placeholder, entry[key], key, moment, float(group["betas"][beta_index]))
             for key, moment, beta_index in KEYS]
    return SavedParam(index, slots, _step(entry.get("step")), shape)


def _bnb_param(index: int, entry: Mapping[str, Any], group: Mapping[str, Any],
               shape: tuple[int, ...] | None) -> SavedParam:
    betas = [float(b) for b in group["betas"]]
    shape = tuple(entry["state2"].shape)
    placeholder = stand_in(shape)
    slots = [bnb_layout.slot(placeholder, entry, key, half, moment, betas[beta_index], block_size=_block_size)
             for key, half, moment, beta_index in bnb_layout.two_state_layout(entry["state1"], entry["state2"])]
    return SavedParam(index, slots, _step(entry.get("step")), shape)


def _block_size(numel: int, blocks: int) -> int:
    """The power-of-two block size that splits ``numel`` elements into ``blocks`` blocks."""
    size = 2 ** math.ceil(math.log2(max(1, math.ceil(numel / blocks))))
    if math.ceil(numel / size) != blocks:
        raise SavedStateError("bitsandbytes block-wise 8-bit codes",
                              f"{numel} elements in {blocks} blocks (no power-of-two block size fits)")
    return size


def _quantized_param(index: int, entry: Mapping[str, Any], group: Mapping[str, Any],
                     shape: tuple[int, ...] | None) -> SavedParam:
    from lightning_stale.adapters.quantized import KEYS, format_slot
    from lightning_stale.formats import QuantizedState, get_format

    names = group.get("state_format", {})
    formats = {}
    for moment, key in KEYS.items():
        name = names.get(moment) if isinstance(names, Mapping) else names
        if name is None or (entry[key].dtype == torch.float32 and name != "fp32"):
            name = "fp32"  # parameters below min_quantized_size are stored in fp32
        formats[moment] = get_format(name, signed=moment == "m")
    # codes of fewer than 8 bits are packed into a flat tensor
    shown = [entry[KEYS[m]].shape for m in KEYS if formats[m].bits >= 8]
    shape = tuple(shown[0]) if shown else shape
    # without a shape, an odd count of 4-bit codes contributes one padding element
    numel = math.prod(shape) if shape is not None else 2 * entry[KEYS["v"]].numel()
    placeholder = stand_in(shape or (numel,))
    slots = []
    for (moment, key), beta in zip(KEYS.items(), group["betas"]):
        q = QuantizedState(entry[key], entry.get(f"{key}_scale"), torch.Size(shape or (numel,)))
        slots.append(format_slot(placeholder, moment, float(beta), formats[moment], q))
    return SavedParam(index, slots, _step(entry.get("step_v")), shape)


def _describe_torch(slot: Slot) -> str:
    return f"torch {str(slot.tensor.dtype).removeprefix('torch.')}"


def _describe_torchao(slot: Slot) -> str:
    if isinstance(slot, FloatSlot):
        return _describe_torch(slot)
    return {"int8_dynamic": "torchao 8-bit", "fp8_e4m3": "torchao fp8"}.get(slot.format, "torchao 4-bit")


register_saved_reader("torch.optim", lambda entries, groups: bool(_keys(entries) & {*TORCH_MOMENTS, *TORCH_FACTORS}),
                      _torch_param, _describe_torch)
register_saved_reader("torchao", lambda entries, groups: any(_is_torchao(value) for entry in entries.values()
                                                             for value in entry.values()),
                      _torchao_param, _describe_torchao)
register_saved_reader("bitsandbytes", _is_bnb, _bnb_param, lambda slot: "bitsandbytes 8-bit"
                      if slot.format == "int8_dynamic" else f"bitsandbytes {slot.format}")
register_saved_reader("lightning_stale", lambda entries, groups: any("state_format" in group for group in groups),
                      _quantized_param, lambda slot: f"QuantizedAdamW {slot.format}")


def grid_end_masks(slot: Slot) -> tuple[Tensor, Tensor] | None:
    """Flat bool masks of the elements stored at the smallest non-zero magnitude and at the largest magnitude of their
    grid (before the block's scale: the codes next to zero, and the saturated or block-maximum codes); None for a
    layout without a known grid."""
    if isinstance(slot, BlockQmapSlot):  # and Packed4bitSlot: codes into a map
        magnitudes = slot.qmap.detach().abs().float().cpu()
        bottom = magnitudes == magnitudes[magnitudes > 0].min()
        top = magnitudes == magnitudes.max()
        codes = slot.codes().reshape(-1).long().cpu()
        return bottom[codes], top[codes]
    stored = slot.stored if isinstance(slot, BlockFp8Slot) else slot.tensor if isinstance(slot, FloatSlot) else None
    if stored is None or not stored.is_floating_point():
        return None
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[stored.dtype.itemsize]
    smallest = float(torch.ones(1, dtype=bits).view(stored.dtype).float())  # the smallest subnormal
    magnitudes = stored.detach().reshape(-1).float().abs()
    return magnitudes == smallest, magnitudes == torch.finfo(stored.dtype).max


# -- what period --state reads -----------------------------------------------------------------------------------------
def load_v_sample(path: str, limit: int = 1_000_000, seed: int = 0) -> tuple[Tensor, Tensor, float | None, str]:
    """:func:`v_sample` of every optimizer in the checkpoint at ``path`` (:func:`load_checkpoint`); ValueError
    naming the state when it cannot be read."""
    try:
        checkpoint = load_checkpoint(path)
        return v_sample(checkpoint.optimizers, limit, seed)
    except SavedStateError as error:
        raise ValueError(f"state: {error}") from None


def v_sample(state_dicts: Sequence[Mapping[str, Any]], limit: int = 1_000_000,
             seed: int = 0) -> tuple[Tensor, Tensor, float | None, str]:
    """(values, spacing, beta2 or None, description) of the stored v of every parameter of optimizer state_dicts.

    fp32 states (small parameters that 8-bit optimizers keep in fp32) are left out when any low-precision state
    exists: their tiny spacing would dominate the harmonic mean of the grid estimate. At most ``limit`` elements are
    kept (a uniform random subset, seeded). SavedStateError when no second moment is found.
    """
    optimizers = [read_optimizer(state_dict) for state_dict in state_dicts]
    found = [(slot, _by_family(optimizer.family).describe(slot)) for optimizer in optimizers  # EMAs of g**2 only
             for param in optimizer.params for slot in param.slots if slot.moment == "v" and slot.beta is not None]
    if not found:
        raise SavedStateError("a second moment (QuantizedAdamW exp_avg_sq, bitsandbytes state2, torchao exp_avg_sq, "
                              "or a float exp_avg_sq)", "an optimizer state without one")
    kept = [(slot, kind) for slot, kind in found if slot.format != "fp32"] or found
    v = torch.cat([slot.value().reshape(-1).float() for slot, _ in kept])
    u = torch.cat([slot.spacing().reshape(-1).float() for slot, _ in kept])
    described = ", ".join(sorted({kind for _, kind in kept}))
    if len(kept) < len(found):
        described += f"; {len(found) - len(kept)} fp32 state tensor(s) left out"
    if v.numel() > limit:
        keep = torch.randperm(v.numel(), generator=torch.Generator().manual_seed(seed))[:limit]
        v, u = v[keep], u[keep]
    betas = next((o.groups[0].get("betas") for o in optimizers if o.groups), None)
    return v, u, float(betas[1]) if betas is not None else None, described


# -- checkpoints -------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class MonitorPart:
    """One optimizer's part of a saved monitor state (the current layout: steps, engine, forecast, ledger, ...)."""

    state: Mapping[str, Any]
    index: int  # the optimizer's index inside its monitor: the prefix of its unit keys, f"opt{index}"
    source: str  # where the monitor state was found
    policy: str | None


@dataclass(eq=False)
class Checkpoint:
    """What a checkpoint holds for a staleness report."""

    kind: str
    optimizers: list[Mapping[str, Any]]  # optimizer state_dicts
    # candidate orders of the model's parameters as (name, shape), each with where it comes from, best first
    orders: list[tuple[str, list[tuple[str, tuple[int, ...]]]]] = field(default_factory=list)
    monitors: list[MonitorPart | None] = field(default_factory=list)  # per optimizer
    step: int | None = None  # the training loop's step (Lightning global_step, Hugging Face global_step)
    notes: list[str] = field(default_factory=list)
    # the model's tensors by name, where the checkpoint has them
    weights: dict[str, Tensor] = field(default_factory=dict)
    optimizer_name: str | None = None  # the optimizer's class where the checkpoint names it (LitGPT's hyperparameters)


def describe(value: Any) -> str:
    """A few words on what ``value`` is, for messages."""
    if isinstance(value, Mapping):
        keys = [str(key) for key in value]
        shown = ", ".join(repr(key) for key in keys[:10]) + (f", ... ({len(keys)} keys)" if len(keys) > 10 else "")
        return f"a dict with keys [{shown}]" if keys else "an empty dict"
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def load_checkpoint(path: str | Path, trusted: bool = False) -> Checkpoint:
    """The optimizer state_dicts, parameter names and monitor state saved at ``path`` (a file or a folder).
    ``trusted`` unpickles files without ``weights_only`` (it runs code from the file). SavedStateError otherwise."""
    path = Path(path)
    if path.is_dir():
        if (path / ".metadata").is_file():
            return _distributed(path, trusted)
        if (path / "optimizer.pt").is_file():
            return _hugging_face(path, trusted)
        if (path / LITGPT_FILE).is_file():
            return _litgpt(path / LITGPT_FILE, trusted)
        names = sorted(p.name for p in path.iterdir())
        files = [name for name in names if name.endswith(CHECKPOINT_SUFFIXES) and (path / name).is_file()]
        if len(files) == 1:
            return load_checkpoint(path / files[0], trusted)
        if files:
            raise SavedStateError("one checkpoint file", f"a folder holding {len(files)}: {_listing(files)} (pass one "
                                  f"of them): {str(path)!r}")
        nested = sorted(str(p.relative_to(path)) for p in path.glob(f"*/{LITGPT_FILE}"))
        if nested:
            raise SavedStateError(f"a checkpoint folder (for a LitGPT out_dir, the folder of one {LITGPT_FILE})",
                                  f"LitGPT's out_dir holding {_listing(nested)}: {str(path)!r}")
        if any(name in HF_MODEL_FILES or name == "config.json" for name in names):
            found = "a Hugging Face model folder without optimizer.pt (model weights only)"
        else:
            found = f"a folder holding {_listing(names)}" if names else "an empty folder"
        raise SavedStateError("a checkpoint folder (a Hugging Face checkpoint with optimizer.pt, LitGPT's with "
                              f"{LITGPT_FILE}, a distributed checkpoint with .metadata, or one .ckpt/.pt/.pth file)",
                              f"{found}: {str(path)!r}")
    if not path.exists():
        raise SavedStateError("a checkpoint file or folder", f"nothing at {str(path)!r}")
    if path.name == LITGPT_FILE:
        return _litgpt(path, trusted)
    return _from_object(load_file(path, trusted), "a torch.save'd dict")


def _litgpt(file: Path, trusted: bool) -> Checkpoint:
    """A LitGPT checkpoint file (``lit_model.pth``): ``litgpt pretrain`` saves model, optimizer and counters in every
    ``step-*`` folder and in ``final``; the finetuning scripts save the model alone in ``final`` (and everything in
    ``step-*``). The optimizer class comes from ``hyperparameters.yaml`` beside it, where present."""
    obj = load_file(file, trusted)
    if _is_model_state(obj) or (isinstance(obj, Mapping) and set(obj) == {"model"}):
        steps = sorted(file.parent.parent.glob(f"step-*/{LITGPT_FILE}"), reverse=True)  # the latest first
        hint = (f"; the step folders beside it hold it: {_listing([str(step) for step in steps])}" if steps else
                f"; LitGPT saves it with the model in step-*/{LITGPT_FILE} (after pretraining in final/ too)")
        raise SavedStateError("a checkpoint with optimizer state", f"LitGPT model weights only in {str(file)!r}{hint}")
    checkpoint = _from_object(obj, f"LitGPT's {LITGPT_FILE}")
    if isinstance(obj, Mapping) and isinstance(obj.get("step_count"), int):
        checkpoint.step = obj["step_count"]
    checkpoint.optimizer_name = _litgpt_optimizer(file.parent / "hyperparameters.yaml")
    return checkpoint


def _litgpt_optimizer(file: Path) -> str | None:
    """The optimizer LitGPT's ``hyperparameters.yaml`` names (``optimizer: AdamW`` or a ``class_path``), if any."""
    try:
        import yaml

        optimizer = (yaml.safe_load(file.read_text()) or {}).get("optimizer") if file.is_file() else None
    except Exception:  # noqa: BLE001 - no yaml, or a file it cannot read: the class is then read from the state
        return None
    if isinstance(optimizer, Mapping):
        optimizer = optimizer.get("class_path")
    return str(optimizer) if isinstance(optimizer, str) and optimizer else None


def _listing(names: Sequence[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def load_file(path: Path, trusted: bool = False) -> Any:
    """``torch.load`` of a checkpoint file on the CPU, weights only unless ``trusted`` (torchao's tensor subclasses are
    allowed once torchao is imported, which happens quietly when the file needs it)."""
    with path.open("rb") as file:
        kind = _file_kind(file.read(64))
    if kind is not None:
        raise SavedStateError("a checkpoint written by torch.save", f"{kind}: {str(path)!r}")
    try:
        return _torch_load(path, trusted)
    except Exception as first:  # noqa: BLE001 - every failure becomes a message; torchao's subclasses get a retry
        needed = re.search(r"GLOBAL ([\w.]+)", str(first))
        if needed is not None and needed.group(1).startswith("torchao."):
            try:
                _compat.import_torchao_optim()
                return _torch_load(path, trusted)
            except ImportError:
                raise SavedStateError("a checkpoint whose classes are installed", f"torchao optimizer states in "
                                      f"{str(path)!r}, and torchao is not installed") from None
        if needed is not None:
            raise SavedStateError("a checkpoint that torch.load reads with weights_only=True",
                                  f"a pickle that needs {needed.group(1)} ({str(path)!r}); pass --trusted to unpickle "
                                  "it anyway if you trust the file (it runs code from it)") from None
        raise SavedStateError("a checkpoint written by torch.save",
                              f"a file torch.load cannot read ({type(first).__name__}: {_first_line(first)}): "
                              f"{str(path)!r}") from None


def _torch_load(path: Path, trusted: bool) -> Any:
    return torch.load(path, map_location="cpu", weights_only=not trusted)


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)[:200]


def _file_kind(head: bytes) -> str | None:
    """What a file that torch.load cannot read is, from its first bytes; None for a zip archive or a pickle."""
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return None
    if not head:
        return "an empty file"
    if len(head) > 8 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 0:
        return "a safetensors file (tensors only: model weights, no optimizer state)"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return f"a binary file that is neither a zip archive nor a pickle (it starts with {head[:8]!r})"
    return f"a text file (it starts with {head[:24].decode('utf-8', 'replace')!r})"


def _from_object(obj: Any, kind: str) -> Checkpoint:
    """A checkpoint from a loaded object: a Lightning checkpoint, an optimizer state_dict, or a dict holding them
    (``kind`` names such a dict)."""
    if not isinstance(obj, Mapping):
        raise SavedStateError(CHECKPOINT, describe(obj))
    if is_optimizer_state(obj):
        return Checkpoint("an optimizer state_dict", [obj])
    if "pytorch-lightning_version" in obj or "optimizer_states" in obj:
        return _lightning(obj, list(obj.get("optimizer_states") or []), "a Lightning checkpoint")
    optimizers = [(str(key), value) for key, value in _values(obj) if is_optimizer_state(value)]
    if not optimizers:
        raise SavedStateError(CHECKPOINT, f"{describe(obj)} and no optimizer state in it")
    checkpoint = Checkpoint(f"{kind} (optimizer state under {', '.join(repr(k) for k, _ in optimizers)})",
                            [value for _, value in optimizers])
    model = next(((str(key), value) for key, value in _values(obj) if _is_model_state(value)), None)
    if model is not None:
        checkpoint.orders.append((f"the model state_dict under {model[0]!r}", _model_order(model[1])))
        checkpoint.weights = dict(model[1])
    checkpoint.monitors = _monitors_in(obj, len(optimizers), checkpoint.notes)
    return checkpoint


def _values(obj: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The top-level values of a dict, and the items of its top-level lists (``{"optimizers": [sd, sd]}``)."""
    out = []
    for key, value in obj.items():
        if isinstance(value, (list, tuple)):
            out += [(f"{key}[{i}]", item) for i, item in enumerate(value)]
        else:
            out.append((key, value))
    return out


def _is_model_state(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(isinstance(k, str) for k in value) \
        and all(isinstance(v, Tensor) for v in value.values())


def _model_order(state_dict: Mapping[str, Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    """A model state_dict's floating tensors in saved order, without the normalization statistics no optimizer holds:
    the optimizer order of its parameters when they all are in one optimizer, in ``named_parameters()`` order."""
    return [(name, tuple(t.shape)) for name, t in state_dict.items()
            if t.is_floating_point() and not name.endswith(MODEL_BUFFERS)]


def _lightning(obj: Mapping[str, Any], optimizers: list[Any], kind: str) -> Checkpoint:
    """A Lightning checkpoint: its optimizer states, the model order of its state_dict, the callback's state."""
    if not optimizers:
        raise SavedStateError("a checkpoint with optimizer state", "a Lightning checkpoint without 'optimizer_states' "
                              "(saved with save_weights_only=True?)")
    checkpoint = Checkpoint(kind, optimizers, step=_step(obj.get("global_step")))
    if isinstance(obj.get("state_dict"), Mapping):
        checkpoint.orders.append(("the checkpoint's state_dict", _model_order(obj["state_dict"])))
        checkpoint.weights = {k: v for k, v in obj["state_dict"].items() if isinstance(v, Tensor)}
    callbacks = obj.get("callbacks") or {}
    states = [(key, value) for key, value in callbacks.items() if str(key).startswith(MONITOR_CALLBACK)]
    if len(states) > 1:
        checkpoint.notes.append(f"{len(states)} StaleStateCallback states saved; reading the first ({states[0][0]})")
    checkpoint.monitors = _monitor_parts(states[0][1], states[0][0], len(optimizers), checkpoint.notes) \
        if states else [None] * len(optimizers)
    return checkpoint


def _monitors_in(obj: Mapping[str, Any], count: int, notes: list[str]) -> list[MonitorPart | None]:
    """The monitor state inside a torch.save'd dict: a ``StaleStateMonitor.state_dict()`` or the Fabric front-end's
    ``{"steps", "monitors"}`` under any key."""
    for key, value in obj.items():
        if isinstance(value, Mapping) and "version" in value and "optimizers" in value:
            return _monitor_parts(value, repr(key), count, notes)
        if isinstance(value, Mapping) and isinstance(value.get("monitors"), (list, tuple)):
            parts: list[MonitorPart | None] = []
            for monitor in value["monitors"]:  # one per optimizer, in the order they first stepped
                parts += _monitor_parts(monitor, repr(key), None, notes)
            return _align(parts, count, notes)
    return [None] * count


def _monitor_parts(state: Any, source: str, count: int | None, notes: list[str]) -> list[MonitorPart | None]:
    """One :class:`MonitorPart` per optimizer of a saved monitor state (upgraded to the current layout), aligned with
    ``count`` optimizers when given; notes why a state cannot be read."""
    try:
        state = upgrade(dict(state))
    except (ValueError, TypeError) as error:
        notes.append(f"monitor state under {source} not read: {error}")
        return [None] * (count or 0)
    policy = state.get("policy")
    parts: list[MonitorPart | None] = [MonitorPart(part, i, source, policy)
                                       for i, part in enumerate(state["optimizers"])]
    return parts if count is None else _align(parts, count, notes)


def _align(parts: list[MonitorPart | None], count: int, notes: list[str]) -> list[MonitorPart | None]:
    if len(parts) != count:
        notes.append(f"the monitor state tracks {len(parts)} optimizer(s), the checkpoint holds {count}: matched by "
                     "order")
    return (parts + [None] * count)[:count]


def _hugging_face(folder: Path, trusted: bool) -> Checkpoint:
    """A Hugging Face Trainer checkpoint folder: optimizer.pt beside the model files and trainer_state.json."""
    optimizer = load_file(folder / "optimizer.pt", trusted)
    if not is_optimizer_state(optimizer):
        raise SavedStateError("an optimizer state_dict in optimizer.pt", describe(optimizer))
    checkpoint = Checkpoint("a Hugging Face checkpoint folder", [optimizer])
    checkpoint.orders += [(f"the model built from config.json ({how})", order)
                          for how, order in zip(("the Trainer's parameter groups", "module order"),
                                                _compat.hf_parameter_orders(folder))]
    if (folder / "pytorch_model.bin").is_file():
        model = load_file(folder / "pytorch_model.bin", trusted)
        if _is_model_state(model):
            checkpoint.orders.append(("pytorch_model.bin", _model_order(model)))
            checkpoint.weights = dict(model)
    elif (folder / "model.safetensors").is_file():
        checkpoint.weights = _safetensors(folder / "model.safetensors")
    trainer_state = folder / "trainer_state.json"
    saved = None
    if trainer_state.is_file():
        state = json.loads(trainer_state.read_text())
        checkpoint.step = _step(state.get("global_step"))
        entry = (state.get("stateful_callbacks") or {}).get("StaleStateHFCallback") or {}
        entry = entry[0] if isinstance(entry, list) and entry else entry
        saved = entry.get("attributes", {}).get("saved_state") if isinstance(entry, Mapping) else None
    if saved:
        checkpoint.monitors = _monitor_parts(from_json(saved), "trainer_state.json", 1, checkpoint.notes)
    else:
        checkpoint.monitors = [None]
    return checkpoint


def _safetensors(file: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file by name (empty without the safetensors package or for a file it cannot
    read: the weights are then left out of the report)."""
    try:
        from safetensors.torch import load_file as load_safetensors

        return load_safetensors(str(file))
    except Exception:  # noqa: BLE001 - weights are optional to the report
        return {}


def _distributed(folder: Path, trusted: bool) -> Checkpoint:
    """A torch.distributed.checkpoint folder, loaded whole into this process; Lightning's ModelParallelStrategy layout
    (``state_dict``, ``optimizer_<i>``, the rest in ``meta.pt``) or any dict holding optimizer states."""
    try:
        loaded = _compat.load_distributed_checkpoint(folder)
    except RuntimeError as error:
        raise SavedStateError("a distributed checkpoint this torch reads on one process", str(error)) from None
    except Exception as error:  # noqa: BLE001 - a folder torch cannot read, whatever the reason
        raise SavedStateError("a distributed checkpoint folder torch can read",
                              f"{type(error).__name__}: {_first_line(error)} ({str(folder)!r})") from None
    optimizer_keys = sorted((key for key in loaded if re.fullmatch(r"optimizer_\d+", str(key))),
                            key=lambda key: int(key.split("_")[1]))
    if optimizer_keys and "state_dict" in loaded:
        meta = load_file(folder / "meta.pt", trusted) if (folder / "meta.pt").is_file() else {}
        return _lightning({**meta, **loaded}, [loaded[key] for key in optimizer_keys],
                          "a Lightning distributed checkpoint folder")
    return _from_object(loaded, "a distributed checkpoint folder")
