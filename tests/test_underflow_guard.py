"""The v-underflow hazard (issue 6 item 5): reproduce the m/eps blow-up, see it in ``stale/v/underflow``, and show
that ``StaleStateCallback(underflow_guard=True)`` keeps every single-step parameter change within a few lr.

Reproduction (shared/research/quantized-optimizers.md section 5): Linear(32, 1024) -> ReLU -> Linear(1024, 128),
loss = sum of the outputs, one fixed batch of 4. After the first 8-bit step ~300 first-layer weights hold v at the
zero code with m non-zero; the next step moves some of them by tens (lr 1e-3). Nearest-rounding 8-bit states show
it (QuantizedAdamW ``int8_dynamic``, torchao ``AdamW8bit``); bitsandbytes on CPU hides it (its LUT quantizer never
stores an exact zero), so the layout tests below inject the zero codes into its real state instead.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import logged, make_optimizer, stepped, trainer_for, twin_guarded
from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.optim import QuantizedAdamW
from lightning_stale.act.guard import guard_underflow
from lightning_stale.adapters import adapter_for
from lightning_stale.adapters.protocol import Slot

LR = 1e-3


class DeadUnits(L.LightningModule):
    """The reproduction model; ``kind`` picks the optimizer."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.net = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 128))
        self.x = torch.randn(4, 32)

    def training_step(self, batch, batch_idx):
        return self.net(self.x).sum()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1)

    def configure_optimizers(self):
        return make_optimizer(self.kind, self.parameters(), lr=LR, min_quantized_size=4096)


class StepSize(L.Callback):
    """The largest absolute change of any parameter element in each optimizer step."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.jumps: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.jumps.append(max(float((p.detach() - b).abs().max()) for p, b in zip(pl_module.parameters(), self.before)))


def fit(tmp_path: Path, kind: str, guard: bool, steps: int) -> tuple[StepSize, list[float]]:
    recorder = StepSize()
    trainer = trainer_for(tmp_path, [StaleStateCallback(track="exact", underflow_guard=guard), recorder], steps)
    trainer.fit(DeadUnits(kind))
    return recorder, logged(trainer, "stale/v/underflow")


@pytest.mark.parametrize("kind", ["qadamw:int8_dynamic", pytest.param("torchao", marks=pytest.mark.slow)])
def test_guard_bounds_the_blow_up_that_the_underflow_metric_reports(tmp_path, kind):
    if kind == "torchao":
        pytest.importorskip("torchao.optim")
    steps = 5
    plain, underflow = fit(tmp_path / "plain", kind, guard=False, steps=steps)
    assert max(plain.jumps) > 1000 * LR, "the hazard did not reproduce"
    assert underflow and max(underflow) > 0, "stale/v/underflow did not report the zero-v elements"

    guarded, underflow_guarded = fit(tmp_path / "guarded", kind, guard=True, steps=steps)
    assert len(guarded.jumps) == steps
    assert max(guarded.jumps) <= 4 * LR  # a first-Adam-step size: (1 - b1) / sqrt(1 - b2) ~ 3.2 lr, plus decay
    assert max(underflow_guarded) > 0  # the guard resets m, v still underflows: the metric keeps reporting it


# -- the guard on each slot layout, with zero-v elements injected into real optimizer state --------------------------


def _check_guard(slots: list[Slot], inject: dict[int, torch.Tensor]) -> None:
    """``inject`` maps id(v slot param) -> flat indices to store as zero in v; checks m is zeroed exactly there."""
    by_param = {}
    for s in slots:
        by_param.setdefault(id(s.param), {})[s.moment] = s
    expected_total = 0
    expected_masks = {}
    for pid, index in inject.items():
        v, m = by_param[pid]["v"], by_param[pid]["m"]
        mask = torch.zeros(v.numel, dtype=torch.bool)
        mask[index] = True
        v.zero_elements(mask)
        assert bool(v.zero_mask()[index].all())
        hazard = v.zero_mask() & ~m.zero_mask()
        expected_masks[pid] = hazard
        expected_total += int(hazard.sum())
    assert expected_total > 0
    before = {pid: (d["m"].codes().clone(), d["v"].codes().clone()) for pid, d in by_param.items()}
    assert int(guard_underflow(slots, count=True)) == expected_total
    for pid, d in by_param.items():
        m_before, v_before = before[pid]
        assert torch.equal(d["v"].codes(), v_before), "the guard must not touch v"
        changed = (d["m"].codes() != m_before).reshape(-1)
        hazard = expected_masks.get(pid, torch.zeros_like(changed))
        assert torch.equal(changed, hazard), "m changed outside the hazard elements"
        assert bool((d["m"].value()[hazard] == 0).all())
    assert int(guard_underflow(slots, count=True)) == 0  # idempotent


def test_guard_on_bitsandbytes_8bit_and_fp32_fallback_state():
    import bitsandbytes as bnb

    params = [nn.Parameter(torch.randn(64, 128)), nn.Parameter(torch.randn(100))]  # 8-bit, and fp32 (< 4096)
    opt = bnb.optim.AdamW8bit(params, lr=LR)
    stepped(opt, params)
    slots = adapter_for(opt).slots()
    assert {type(s).__name__ for s in slots} == {"BlockQmapSlot", "FloatSlot"}
    _check_guard(slots, {id(params[0]): torch.arange(0, 8192, 7), id(params[1]): torch.arange(0, 100, 3)})


def test_guard_on_torch_adamw_bf16_state():
    params = [nn.Parameter(torch.randn(300).bfloat16())]
    opt = torch.optim.AdamW(params, lr=LR)
    stepped(opt, params)
    _check_guard(adapter_for(opt).slots(), {id(params[0]): torch.tensor([0, 5, 299])})


def test_guard_on_torchao_4bit_and_fp8_buffers():
    """torchao's own state subclasses, filled by their eager ``copy_`` (no compiled step needed)."""
    pytest.importorskip("torchao.optim")
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    from lightning_stale.adapters.torchao import buffer_slot

    gen = torch.Generator().manual_seed(1)
    for cls, kwargs in ((OptimState4bit, {"block_size": 128}), (OptimStateFp8, {"block_size": 256})):
        p = nn.Parameter(torch.randn(4096, generator=gen))
        slots = []
        for moment, signed in (("m", True), ("v", False)):
            args = (p.shape, signed) if cls is OptimState4bit else (p.shape,)
            buf = cls.zeros(*args, **kwargs)
            values = torch.randn(p.shape, generator=gen)
            buf.copy_(values if signed else values.square())
            slots.append(buffer_slot(p, buf, f"exp_avg{'_sq' * (moment == 'v')}", moment, 0.9))
        if cls is OptimState4bit:  # v's linear map has no zero: only a zero block scale stores zeros
            slots[1].scale[3] = 0.0
            hazard = torch.zeros(4096, dtype=torch.bool)
            hazard[3 * 128:4 * 128] = True
            hazard &= ~slots[0].zero_mask()
            m_before = slots[0].codes().clone()
            assert int(guard_underflow(slots, count=True)) == int(hazard.sum()) > 0
            assert torch.equal(slots[0].codes() != m_before, hazard)
            assert bool((slots[0].value()[hazard] == 0).all())
        else:
            _check_guard(slots, {id(p): torch.arange(1, 4096, 11)})


def test_guard_rejects_a_slot_it_cannot_write_with_a_clear_message():
    class ReadOnlySlot(Slot):
        def __init__(self, param, moment, values):
            super().__init__(param, moment, 0.9, "custom", f"read_only_{moment}")
            self.values = values

        def codes(self):
            return self.values

        def value(self):
            return self.values.reshape(-1)

    p = nn.Parameter(torch.zeros(4))
    slots = [ReadOnlySlot(p, "m", torch.ones(4)), ReadOnlySlot(p, "v", torch.tensor([0.0, 1, 1, 1]))]
    with pytest.raises(TypeError, match="zero_elements.*underflow_guard=False"):
        guard_underflow(slots)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_underflow_guard_argument_must_be_a_bool(value):
    with pytest.raises(ValueError, match="`underflow_guard` must be True or False"):
        StaleStateCallback(underflow_guard=value)


@pytest.mark.parametrize("kind", ["bnb", "torch_fp32", "torch_bf16", "qadamw:int8_dynamic", "qadamw:fp8_e4m3", "qadamw:bf16", "torchao"])
def test_the_one_pass_guard_writes_what_the_counting_guard_writes(kind):
    """Without ``count`` the guard takes one pass per (v, m) pair (fused for the 65,536-element tensor where a
    compiler exists, eager for the small one); it must zero exactly the m elements the exact, counting path zeroes."""
    import lightning_stale.act.guard as guard

    if kind == "torchao":
        pytest.importorskip("torchao.optim")
    counted, fast = twin_guarded(kind, count=True), twin_guarded(kind, count=False)
    assert all(torch.equal(a, b) for a, b in zip(counted, fast))
    assert not guard._fused_failed


def test_the_guard_falls_back_to_eager_ops_when_compiling_fails(monkeypatch):
    import lightning_stale.act.guard as guard

    def broken(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(guard, "_fused", lambda: broken)
    monkeypatch.setattr(guard, "_fused_failed", False)
    monkeypatch.setattr(guard._compat, "compiler_available", lambda: True)
    fast = twin_guarded("bnb", count=False)
    assert guard._fused_failed
    assert all(torch.equal(a, b) for a, b in zip(twin_guarded("bnb", count=True), fast))


@pytest.mark.parametrize("words", [37, 200], ids=["slices-of-a-row", "rows"])
@pytest.mark.parametrize("kind", ["bnb", "torch_bf16", "qadamw:fp8_e4m3"])
def test_the_eager_guard_in_slices_writes_what_the_counting_guard_writes(kind, words, monkeypatch):
    """Without a compiler the pass runs ``EAGER_WORDS`` words at a time (so its temporaries do not grow with the
    tensor): slices of one row, or several whole rows with their scales, write the same bits as the masks."""
    import lightning_stale.act.guard as guard

    monkeypatch.setattr(guard, "_fused_failed", True)
    monkeypatch.setattr(guard, "EAGER_WORDS", words)
    fast = twin_guarded(kind, count=False)
    assert all(torch.equal(a, b) for a, b in zip(twin_guarded(kind, count=True), fast))


def test_guard_does_no_work_where_v_is_fp32():
    """fp32 v cannot underflow in practice: the guard plans nothing for it (issue 29: its cost on fp32 states)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    fp32 = StaleStateMonitor(torch.optim.AdamW(model.parameters(), lr=1e-3), underflow_guard=True)
    low = QuantizedAdamW(model.parameters(), lr=1e-3, state_format="fp8_e4m3", min_quantized_size=0)
    fp8 = StaleStateMonitor(low, underflow_guard=True)
    for opt in (fp32.optimizers[0], low):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 32)).pow(2).mean().backward()
            opt.step()
    assert fp32._pipelines[0].interventions._guard_plan[1] is None  # decided once for the slot set: no plan
    assert fp8._pipelines[0].interventions._guard_plan[1] is not None
    fp32.close()
    fp8.close()
