"""What the monitor keeps in memory, against the optimizer state it watches, counted two ways: its own
``resident_bytes()`` and an independent walk of every object the monitor references (each tensor storage and numpy
buffer once; the optimizer, its state and the parameters it reads are not the monitor's).

    python benchmarks/memory.py                      # GPT-2 shapes of 20M parameters, bnb AdamW8bit and bf16 AdamW
    python benchmarks/memory.py --layers 4 --steps 6 --kinds bnb

Gradients are random (no forward pass): memory does not depend on them. ``--coverage`` is the logging interval, in
steps, within which every parameter is measured (each cohort's batch plan is kept).
"""

from __future__ import annotations

import argparse
import gc
import types

import numpy as np
import torch
from torch import nn


def walk_bytes(root: object, exclude: set[int]) -> int:
    """Bytes of the tensors and numpy arrays reachable from ``root`` (each storage once), skipping storages whose
    address is in ``exclude``, and without entering optimizers, modules, classes or functions' globals."""
    seen: set[int] = set()
    storages: set[int] = set()
    total, stack = 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            if storage.data_ptr() not in exclude and storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
            continue
        if isinstance(obj, np.ndarray):
            base = obj if obj.base is None else obj.base
            if id(base) not in storages:
                storages.add(id(base))
                total += base.nbytes if isinstance(base, np.ndarray) else obj.nbytes
            continue
        if isinstance(obj, (torch.optim.Optimizer, nn.Module, type, types.ModuleType)):
            continue
        if isinstance(obj, types.FunctionType):  # its closure, not the module globals it can see
            stack.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
            continue
        if isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
            continue
        stack.extend(gc.get_referents(obj))
    return total


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def state_storages(optimizer: torch.optim.Optimizer) -> tuple[set[int], int]:
    """(addresses of the optimizer's state, parameter and gradient storages, bytes of its state)."""
    addresses, state_bytes = set(), 0
    for param, state in optimizer.state.items():
        for value in [param, param.grad, *state.values()]:
            for tensor in _tensors(value):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in addresses and value is not param and value is not param.grad:
                    state_bytes += storage.nbytes()
                addresses.add(storage.data_ptr())
    return addresses, state_bytes


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        inner = [getattr(value, name) for name in ("codes", "scale", "qmap") if isinstance(getattr(value, name, None),
                                                                                         torch.Tensor)]
        return inner or [value]  # torchao's state subclasses keep their data in codes/scale/qmap
    return []


def gpt2(layers: int, width: int, dtype: torch.dtype) -> nn.Module:
    """A GPT-2 of the given depth and width (vocabulary 50257, tied embeddings), built from a config: no download."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=256)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def measure(kind: str, layers: int, width: int, steps: int, coverage: int) -> dict[str, float]:
    from lightning_stale import StaleStateMonitor

    model = gpt2(layers, width, torch.bfloat16 if kind == "torch_bf16" else torch.float32)
    params = list(model.parameters())
    if kind == "bnb":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(params, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4)
    monitor = StaleStateMonitor(optimizer, names=model, coverage_steps=coverage)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
        optimizer.step()
    monitor.compute()
    exclude, state_bytes = state_storages(optimizer)
    walked = walk_bytes(monitor, exclude)
    return {"params": sum(p.numel() for p in params), "tensors": len(params), "state_bytes": state_bytes,
            "resident_bytes": monitor.resident_bytes(), "walked_bytes": walked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--coverage", type=int, default=4)
    parser.add_argument("--kinds", default="bnb,torch_bf16")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"GPT-2 {args.layers} layers x {args.width}, {args.steps} steps, coverage {args.coverage}, torch "
          f"{torch.__version__}")
    print(f"{'optimizer':<11} {'params':>11} {'tensors':>7} {'state MiB':>9} {'resident KiB':>12} "
          f"{'walked KiB':>10} {'walked / state':>14}")
    for kind in args.kinds.split(","):
        r = measure(kind, args.layers, args.width, args.steps, args.coverage)
        print(f"{kind:<11} {r['params']:>11,} {r['tensors']:>7} {r['state_bytes'] / 2**20:>9.1f} "
              f"{r['resident_bytes'] / 1024:>12.1f} {r['walked_bytes'] / 1024:>10.1f} "
              f"{100 * r['walked_bytes'] / r['state_bytes']:>13.3f}%")


if __name__ == "__main__":
    main()
