"""StaleStateMonitor in a plain PyTorch loop: metrics as a dict for any logger, resets, checkpointing.

Run: ``python examples/plain_loop.py``
"""

from __future__ import annotations

import io

import torch
from torch import nn

from lightning_stale import StaleStateMonitor
from lightning_stale.optim import QuantizedAdamW


def main(steps: int = 200) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    optimizer = QuantizedAdamW(model.parameters(), lr=1e-3, state_format="bf16")  # bf16 moments, nearest rounding
    monitor = StaleStateMonitor(optimizer, reset="periodic", every=100, names=model)
    metrics: dict[str, float] = {}
    for step in range(1, steps + 1):
        x = torch.randn(32, 64)
        nn.functional.mse_loss(model(x), x[:, :8]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            metrics = monitor.compute()  # everything measured since the last reset_window(): a dict of floats
            monitor.reset_window()  # the next row covers the next 50 steps
            print(step, {k: round(v, 4) for k, v in metrics.items() if k.endswith(("/frac", "/drift", "resets"))})
    buffer = io.BytesIO()  # checkpoint: the monitor's state next to the model's and the optimizer's
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "stale": monitor.state_dict()},
               buffer)
    monitor.close()
    return metrics


if __name__ == "__main__":
    main()
