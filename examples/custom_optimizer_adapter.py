"""Make a home-made quantized optimizer monitorable and resettable by lightning_stale.

``Int8MomentumSGD`` stands for an optimizer you wrote: SGD whose momentum buffer is stored as int8 codes with one
fp32 scale per tensor. lightning_stale cannot guess that layout, so the adapter below (about 30 lines) tells it
where the stored moment lives (``slots``) and how to restore the fresh state in place (``reset``).
``register_adapter`` makes ``adapter_for`` and ``StaleStateCallback`` find it; a package can instead expose
``register`` (or the pair ``(Int8MomentumSGD, Int8MomentumSGDAdapter)``) in the entry-point group
``lightning_stale.adapters``.

Run: ``python examples/custom_optimizer_adapter.py``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_stale import adapter_for, register_adapter
from lightning_stale.adapters.protocol import OptimizerAdapter, Slot, resolve_moments


class Int8MomentumSGD(torch.optim.Optimizer):
    """The user's optimizer: momentum buffer stored as int8 codes times a per-tensor scale."""

    def __init__(self, params, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["codes"], state["scale"] = torch.zeros_like(p, dtype=torch.int8), torch.zeros(())
                buf = (state["codes"].float() * state["scale"]).mul_(group["momentum"]).add_(p.grad)
                state["scale"].copy_(buf.abs().max().clamp(min=1e-12) / 127)
                state["codes"].copy_((buf / state["scale"]).round())
                p.add_(buf, alpha=-group["lr"])
        return loss


# --- the adapter: everything lightning_stale needs to know about Int8MomentumSGD ---------------------------------
@dataclass(eq=False, kw_only=True)
class Int8Slot(Slot):
    stored: Tensor  # int8 codes: an unchanged code means the stored momentum did not move
    scale: Tensor

    def codes(self) -> Tensor:
        return self.stored

    def value(self) -> Tensor:
        return self.stored.reshape(-1).float() * self.scale

    def value_at(self, index: Tensor) -> Tensor:
        return self.stored.reshape(-1)[index].float() * self.scale

    def spacing(self) -> Tensor:
        return self.scale.expand(self.stored.numel())  # a uniform grid: one scale step everywhere


class Int8MomentumSGDAdapter(OptimizerAdapter):
    family = "example"
    exact_moment_reset = True  # one moment, no bias correction: zeroing it is the fresh state

    def slots(self) -> list[Slot]:
        return [Int8Slot(p, "m", None, "int8 linear, per-tensor scale", "codes", stored=st["codes"], scale=st["scale"])
                for _, p, st in self.stepped()]

    def reset(self, moments=None, params=None) -> None:
        if "m" in resolve_moments(moments):
            for _, _, st in self.stepped(params):
                st["codes"].zero_()
                st["scale"].zero_()


register_adapter(Int8MomentumSGD, Int8MomentumSGDAdapter)
# ------------------------------------------------------------------------------------------------------------------


def main(steps: int = 30) -> dict[str, float]:
    """Train a tiny regression, measure the fraction of momentum codes a step leaves unchanged, then reset."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 4)
    x, y = torch.randn(256, 32), torch.randn(256, 4)
    opt = Int8MomentumSGD(model.parameters())
    adapter = adapter_for(opt)
    stalled = counted = 0
    for _ in range(steps):
        before = [s.codes().clone() for s in adapter.slots()]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        for slot, old in zip(adapter.slots(), before):
            stalled += int((slot.codes() == old).sum())
            counted += old.numel()
    adapter.reset()
    after = max(float(s.value().abs().max()) for s in adapter.slots())
    result = {"stalled_fraction": stalled / max(counted, 1), "max_after_reset": after}
    print(f"{adapter.describe()}: {result['stalled_fraction']:.1%} of momentum codes unchanged per step; "
          f"after reset max |m| = {after}")
    return result


if __name__ == "__main__":
    main()
