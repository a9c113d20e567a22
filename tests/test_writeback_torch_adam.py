"""The weight write-back's torch.optim Adam/AdamW family: conformance, moments, implementations."""

from __future__ import annotations

import pytest
import torch

import writeback_checks as checks
from lightning_stale.act.writeback import WeightWriteBack

LR = 1e-2
KW = dict(lr=LR, weight_decay=0.1)

# name -> (optimizer, (largest share of differing weights, largest |difference| / lr)), each step from the
# optimizer's own state. Measured (CPU, torch 2.13, 6 steps): for-loop and foreach round each op to bf16 (AdamW 23%,
# <= 0.098 lr; Adam with L2 decay 28%, 0.061 lr; maximize 21%, 0.098 lr); fused computes in fp32 like the write-back
# (its lerp is a fused multiply-add: < 0.05%, <= 0.003 lr). Bounds about 1.5x the measured worst case.
IMPLEMENTATIONS = {
    "adamw_forloop": (lambda p: torch.optim.AdamW(p, **KW, foreach=False), (0.35, 0.15)),
    "adamw_foreach": (lambda p: torch.optim.AdamW(p, **KW, foreach=True), (0.35, 0.15)),
    "adamw_fused": (lambda p: torch.optim.AdamW(p, **KW, fused=True), (0.01, 0.01)),
    "adam_l2_forloop": (lambda p: torch.optim.Adam(p, **KW, foreach=False), (0.4, 0.1)),
    "adam_l2_fused": (lambda p: torch.optim.Adam(p, **KW, fused=True), (0.01, 0.01)),
    "adam_maximize": (lambda p: torch.optim.Adam(p, **KW, maximize=True, foreach=False), (0.35, 0.15)),
}


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("closure", [True, False], ids=["closure", "plain-loop"])
def test_nearest_rounding_writes_torchs_own_weights(name, closure):
    make, (share, size) = IMPLEMENTATIONS[name]
    worst_share, worst_size, _ = checks.conformance(make, LR, closure=closure)
    assert worst_share <= share and worst_size <= size


def test_nearest_moments_are_torch_fuseds_and_step_counters_advance():
    """From torch's own state, the write-back stores the moments torch's fused AdamW stores (up to its lerp's fused
    multiply-add: measured 0.03% of m and 0.01% of v elements one bf16 ulp apart) and advances ``step``."""
    make = IMPLEMENTATIONS["adamw_fused"][0]
    net = checks.model()
    opt = make(net.parameters())
    gen = torch.Generator().manual_seed(1)
    checks.step(net, opt, torch.randn(32, 64, generator=gen).bfloat16())
    for _ in range(5):
        x = torch.randn(32, 64, generator=gen).bfloat16()
        twin, twin_opt = checks.twin(net, opt, lambda p: torch.optim.AdamW(p, **KW, foreach=False))
        writeback = WeightWriteBack(twin_opt, "nearest")
        checks.step(net, opt, x)
        checks.step(twin, twin_opt, x)
        writeback.close()
        for key in ("exp_avg", "exp_avg_sq"):
            ours, theirs = (torch.cat([o.state[p][key].float().flatten() for p in m.parameters()])
                            for o, m in ((twin_opt, twin), (opt, net)))
            diff = (ours - theirs).abs()
            assert (diff <= torch.maximum(ours.abs(), theirs.abs()) * 2.0**-7 + 1e-10).all()
            assert (diff > 0).float().mean().item() <= 1e-3
        for a, b in zip(net.parameters(), twin.parameters()):
            assert float(twin_opt.state[b]["step"]) == float(opt.state[a]["step"])
        net.load_state_dict(twin.state_dict())
        opt.load_state_dict(twin_opt.state_dict())


@pytest.mark.parametrize("flags", [{"foreach": True}, {"fused": True}])
def test_the_write_back_does_not_depend_on_torchs_implementation(flags):
    """torch's update skips the parameters taken over: for-loop, foreach and fused AdamW, from the same state, end
    with the same weights and state, bit for bit."""
    start = checks.model()
    first = torch.optim.AdamW(start.parameters(), **KW, foreach=False)
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(16, 64, generator=gen).bfloat16() for _ in range(6)]
    checks.step(start, first, inputs[0])  # torch's own first step makes its state
    runs = []
    for kw in ({"foreach": False}, flags):
        net, opt = checks.twin(start, first, lambda p: torch.optim.AdamW(p, **KW, **kw))
        writeback = WeightWriteBack(opt, "compensated", moments="stochastic", seed=2)
        for x in inputs[1:]:
            checks.step(net, opt, x)
        writeback.close()
        runs.append((list(net.parameters()), opt))
    (params_a, opt_a), (params_b, opt_b) = runs
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step", "lightning_stale.compensation"):
            assert torch.equal(opt_a.state[a][key].cpu(), opt_b.state[b][key].cpu())


def test_stochastic_moments_track_the_fp32_average_where_bf16_stalls():
    """After one gradient of 1, a zero gradient for 300 steps: bf16 ``v * 0.999`` rounds back to v under nearest
    rounding (torch's and the write-back's alike), stochastic rounding decays it as fp32 does, on average."""
    results = {}
    for moments in ("nearest", "stochastic"):
        weight = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
        opt = torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.0)
        writeback = WeightWriteBack(opt, "stochastic", moments=moments)
        for step in range(301):
            weight.grad = torch.full_like(weight, 1.0 if step == 0 else 0.0)
            opt.step()
        writeback.close()
        results[moments] = opt.state[weight]["exp_avg_sq"].float().mean().item()
    assert results["nearest"] == pytest.approx(torch.tensor(1e-3).bfloat16().item())  # stalled
    assert results["stochastic"] == pytest.approx(1e-3 * 0.999**300, rel=5e-3)


@pytest.mark.parametrize("rounding,moments", [("nearest", "nearest"), ("compensated", "stochastic"),
                                              ("stochastic", "stochastic")])
def test_updates_stay_near_lr(rounding, moments):
    """Largest |update| / lr beyond the rounding's own share, rows of an embedding without gradient for most steps
    included (their m and v decay; a v stored as 0 beside a non-zero m would give an m / eps step). Measured 1.0 (the
    first Adam step is lr * sign(g))."""
    assert checks.largest_update(lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.0), LR, rounding,
                                 moments) < 1.5


@pytest.mark.parametrize("make,match", [
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.Adam(p, capturable=True), "capturable"),
    (lambda p: torch.optim.AdamW(p, betas=(torch.tensor(0.9), torch.tensor(0.999))), "tensor betas"),
])
def test_refused_configurations_name_the_flag(make, match):
    with pytest.raises(ValueError, match=match):
        WeightWriteBack(make(checks.model().parameters()))
