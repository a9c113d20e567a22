"""Why full resets cost loss on per-tensor fp8 states: second-moment lanes that a reset leaves at zero and nearest
rounding never lets leave, against the v-only restart the adapters use.

The long plan's model (the demo's decoder at dim 64, lr 2e-3 constant, b2 0.999) with ``QuantizedAdamW`` fp8 states
in a plain loop; at ``--reset-at`` the run branches three ways from the same state: no reset, the paper's reset of
both moments (v back to zero), and the v-only reset as the monitor applies it (``adapter.reset(("v",))``: m kept,
v restarted from m and the last gradient, rounded up). Per branch, over every fp8 v element with a non-zero gradient,
exactly: the share stored as zero, and of those the share whose fp32 EMA of the squared gradients (kept beside the
optimizer from step 1) is at least half the smallest step of the tensor's grid, so would be stored non-zero by an
fp32-then-quantize EMA: lanes *stuck* at zero. And the mean training loss of the last 100 steps.

    python benchmarks/reset_zeros.py                     # reset at step 400, 300 steps after it
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch

FP8_HALF_SMALLEST = 2.0**-10  # half of e4m3's smallest subnormal (2^-9), in units of the tensor's scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reset-at", type=int, default=400)
    parser.add_argument("--after", type=int, default=300, help="steps run after the reset")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    from lightning_stale.adapters import adapter_for
    from lightning_stale.demo.configs import DemoSettings
    from lightning_stale.demo.model import DecoderConfig, LanguageModel
    from lightning_stale.demo.training import prepare_corpus
    from lightning_stale.optim import QuantizedAdamW

    torch.manual_seed(args.seed)
    total = args.reset_at + args.after
    settings = DemoSettings(steps=total, lr=2e-3, seed=args.seed,
                            model=DecoderConfig(dim=64, n_layers=2, n_heads=4, hidden=176, context=64))
    batches = list(prepare_corpus(settings).train_loader(total, settings.batch_size, args.seed))
    beta2 = 0.999

    def optimizer_for(model: LanguageModel) -> QuantizedAdamW:
        return QuantizedAdamW(model.parameters(), lr=2e-3, betas=(0.9, beta2), state_format="fp8_e4m3",
                              min_quantized_size=128)

    def step(model: LanguageModel, optimizer: QuantizedAdamW, batch, shadow: list[torch.Tensor]) -> float:
        loss = model.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for p, ema in zip(model.parameters(), shadow):
            ema.mul_(beta2).add_(p.grad.float().square(), alpha=1 - beta2)
        optimizer.step()
        return loss.item()

    def zeros(model: LanguageModel, optimizer: QuantizedAdamW, shadow: list[torch.Tensor]) -> tuple[float, float]:
        zero = stuck = counted = 0
        for p, ema in zip(model.parameters(), shadow):
            state = optimizer.state[p]
            if state["exp_avg_sq"].dtype != torch.float8_e4m3fn:
                continue
            live = p.grad != 0
            at_zero = (state["exp_avg_sq"].view(torch.uint8) == 0) & live
            zero += int(at_zero.sum())
            stuck += int((at_zero & (ema >= state["exp_avg_sq_scale"] * FP8_HALF_SMALLEST)).sum())
            counted += int(live.sum())
        return zero / counted, stuck / counted

    model = LanguageModel(settings.model)
    optimizer = optimizer_for(model)
    shadow = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(args.reset_at):
        step(model, optimizer, batches[i], shadow)
    zero, stuck = zeros(model, optimizer, shadow)
    print(f"QuantizedAdamW fp8_e4m3, demo model dim 64, lr 2e-3, b2 {beta2}, seed {args.seed}, torch {torch.__version__}")
    print(f"at step {args.reset_at}: v at zero {zero:.2%} of live elements, stuck {stuck:.2%}")
    print("branch     " + "  ".join(f"step {s:>4}" for s in _marks(args)) + "   (v at zero / stuck at zero, of live elements)  loss, last 100")
    snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), [t.clone() for t in shadow])
    for branch in ("no reset", "full reset", "v restart"):
        branch_model = LanguageModel(settings.model)
        branch_model.load_state_dict(snapshot[0])
        branch_optimizer = optimizer_for(branch_model)
        branch_optimizer.load_state_dict(copy.deepcopy(snapshot[1]))
        branch_shadow = [t.clone() for t in snapshot[2]]
        if branch == "full reset":
            branch_optimizer.reset_moments(("m", "v"))
        elif branch == "v restart":
            for p, g in zip(branch_model.parameters(), model.parameters()):
                p.grad = g.grad.clone()  # the restart reads the last gradient, as inside the monitor's hook
            adapter_for(branch_optimizer).reset(("v",))
        losses, cells = [], []
        for i in range(args.reset_at, total):
            losses.append(step(branch_model, branch_optimizer, batches[i], branch_shadow))
            if i + 1 in _marks(args):
                cells.append("%.2f%%/%.2f%%" % tuple(100 * x for x in zeros(branch_model, branch_optimizer,
                                                                              branch_shadow)))
        print(f"{branch:<10} " + "  ".join(f"{c:>9}" for c in cells) + f"   {sum(losses[-100:]) / 100:.4f}")


def _marks(args: argparse.Namespace) -> list[int]:
    return [args.reset_at + 1] + list(range(args.reset_at + 50, args.reset_at + args.after + 1, 50))


if __name__ == "__main__":
    main()
