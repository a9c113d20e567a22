"""Shared checks of the weight write-back's optimizer families: every family's test file runs these on its optimizers.

A family conforms when, with nearest rounding, each step it takes over from the optimizer's own state writes the
optimizer's own weights: bit for bit where the optimizer computes in fp32, within measured bounds where it rounds its
arithmetic to bf16 (torch's for-loop and foreach forms).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from lightning_stale.act.writeback import WeightWriteBack

Make = Callable[..., torch.optim.Optimizer]


def model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8)).to(dtype)


def step(net: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, closure: bool = True) -> None:
    """One training step on ``x``, through a closure (as Lightning steps) or a plain loop's backward then step."""
    def compute() -> torch.Tensor:
        opt.zero_grad()
        loss = net(x).float().pow(2).mean()
        loss.backward()
        return loss

    if closure:
        opt.step(compute)
    else:
        compute()
        opt.step()


def twin(net: torch.nn.Module, opt: torch.optim.Optimizer, make: Make) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An independent copy of (net, opt) with the same weights and state."""
    copied = copy.deepcopy(net)
    copied_opt = make(copied.parameters())
    copied_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return copied, copied_opt


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor and number of the optimizer's state, in parameter order, as tensors."""
    return [torch.as_tensor(value) for p in (q for g in opt.param_groups for q in g["params"])
            for value in opt.state[p].values() if isinstance(value, (torch.Tensor, int, float))]


def conformance(make: Make, lr: float, steps: int = 6, closure: bool = True) -> tuple[float, float, bool]:
    """(largest share of weights that differ, largest |difference| / lr, optimizer states equal at every step) of the
    write-back with nearest rounding against the optimizer's own step, each step from the same state."""
    net = model()
    opt = make(net.parameters())
    gen = torch.Generator().manual_seed(1)
    step(net, opt, torch.randn(32, 64, generator=gen).bfloat16(), closure)  # the optimizer initialises its state
    worst_share, worst_size, states_equal = 0.0, 0.0, True
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen).bfloat16()
        copied, copied_opt = twin(net, opt, make)
        writeback = WeightWriteBack(copied_opt, "nearest")
        step(net, opt, x, closure)
        step(copied, copied_opt, x, closure)
        writeback.close()
        diffs = torch.cat([(a.float() - b.float()).abs().flatten() for a, b in zip(net.parameters(),
                                                                                  copied.parameters())])
        worst_share = max(worst_share, (diffs > 0).float().mean().item())
        worst_size = max(worst_size, diffs.max().item() / lr)
        states_equal &= all(torch.equal(a, b) for a, b in zip(state_tensors(opt), state_tensors(copied_opt)))
        net.load_state_dict(copied.state_dict())  # both go on from the write-back's weights
        opt.load_state_dict(copied_opt.state_dict())
    return worst_share, worst_size, states_equal


def largest_update(make: Make, lr: float, rounding: str, moments: str = "nearest", steps: int = 20) -> float:
    """Largest |weight change| / lr over ``steps`` steps of the write-back (the rounding's own share, at most half a
    bf16 gap for nearest and compensated and a whole gap for stochastic, left out), from zero gradients on some rows
    (an embedding whose rows stop getting gradient) and the optimizer's first steps on."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 8)).bfloat16()
    opt = make(net.parameters())
    writeback = WeightWriteBack(opt, rounding, moments=moments)
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for i in range(steps):
        tokens = torch.randint(0, 64 if i < 5 else 4, (16,), generator=gen)  # most rows stop getting gradient
        before = [p.detach().float() for p in net.parameters()]
        opt.zero_grad()
        net(tokens).float().pow(2).mean().backward()
        opt.step()
        for b, p in zip(before, net.parameters()):
            gap = torch.where(b == 0, 0.0, b.abs() * 2.0 ** (-8 if rounding == "nearest" else -7))
            worst = max(worst, ((p.float() - b).abs() - gap).max().item() / lr)
    writeback.close()
    return worst
