"""A storage format from outside the package is one class and one ``register_format`` call: the toy format below
(6-bit codes on a uniform grid, one scale per tensor) trains in ``QuantizedAdamW``, the monitor measures its stall
exactly, its adapter reads and restarts it, and ``inspect`` reads its checkpoint, with nothing else changed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from lightning_stale import StaleStateMonitor
from lightning_stale.adapters import adapter_for
from lightning_stale.adapters.restart import restarted_v
from lightning_stale.formats import FORMATS, QuantizedState, StateFormat, get_format, register_format
from lightning_stale.formats.base import grid_spacing_table, uniform_from_bits
from lightning_stale.optim import QuantizedAdamW


class Uniform6Format(StateFormat):
    """6-bit codes, one per byte, on a uniform grid scaled by the tensor's absmax: signed, the 63 levels -31..31 / 31
    (code = level + 31); unsigned, the 64 levels 0..63 / 63."""

    name = "uniform6"
    bits = 8

    def __init__(self, signed: bool) -> None:
        super().__init__(signed)
        self.top = 31 if self.signed else 63  # the largest level
        self.offset = 31 if self.signed else 0  # code - level
        self._grid = torch.arange(-self.offset, self.top + 1, dtype=torch.float32) / self.top
        self._spacing = grid_spacing_table(self._grid)

    def quantize_with_noise(self, x: Tensor, noise: Tensor | None) -> QuantizedState:
        scale = (x.abs().amax() if x.numel() else x.new_zeros(())).clamp(min=1e-12).reshape(1)
        scaled = x / scale * self.top
        level = scaled.round() if noise is None else (scaled + uniform_from_bits(noise.reshape(x.shape))).floor()
        codes = level.clamp(-self.offset, self.top).add(self.offset).to(torch.uint8)
        return QuantizedState(codes, scale, x.shape)

    def _per_code(self, q: QuantizedState, table: Tensor) -> Tensor:
        return table.to(q.codes.device)[q.codes.long()].reshape(q.shape) * q.scale

    def dequantize(self, q: QuantizedState) -> Tensor:
        return self._per_code(q, self._grid)

    def spacing(self, q: QuantizedState) -> Tensor:
        return self._per_code(q, self._spacing)

    def empty(self, shape: torch.Size | tuple[int, ...]) -> QuantizedState:
        return QuantizedState(torch.full(shape, self.offset, dtype=torch.uint8), torch.zeros(1), torch.Size(shape))

    def bytes_per_element(self, numel: int) -> float:
        return 1.0 + 4.0 / max(numel, 1)

    def element_codes(self, q: QuantizedState) -> Tensor:
        return q.codes.reshape(-1)

    def zero_code(self) -> int:
        return self.offset

    def grid(self) -> Tensor:
        return self._grid


@pytest.fixture
def uniform6() -> Iterator[None]:
    """The toy format registered for one test."""
    register_format(Uniform6Format)
    yield
    del FORMATS["uniform6"]


def _model_and_optimizer() -> tuple[nn.Module, QuantizedAdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))  # the biases stay below the size: fp32
    return model, QuantizedAdamW(model.parameters(), lr=1e-2, state_format="uniform6", min_quantized_size=256,
                                 count_stalls=True, compile=False)


def _train(model: nn.Module, optimizer: QuantizedAdamW, steps: int, counts: list[int] | None = None) -> None:
    """``steps`` steps on random regression batches (the last gradients kept); ``counts`` (stalled, counted) of v
    gathers the optimizer's own exact count."""
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(16, 32)), torch.randn(16, 4)).backward()
        optimizer.step()
        if counts is not None:
            for per_moment in optimizer.last_stall_counts().values():
                stalled, counted = per_moment["v"]
                counts[0] += int(stalled)
                counts[1] += int(counted)


def test_the_toy_format_rounds_to_its_grid(uniform6: None) -> None:
    fmt = get_format("uniform6", signed=True)
    x = torch.randn(1000)
    q = fmt.quantize(x)
    assert torch.all((fmt.dequantize(q) - x).abs() <= fmt.spacing(q) / 2 + 1e-7)
    assert torch.equal(fmt.element_codes(fmt.quantize(torch.zeros(5))), torch.full((5,), fmt.zero_code()))
    stochastic = torch.stack([fmt.dequantize(fmt.quantize(x, "stochastic", torch.Generator().manual_seed(s)))
                              for s in range(200)]).mean(0)
    assert torch.allclose(stochastic, x, atol=3 * float(q.scale) / 31 / 200**0.5)  # unbiased


def test_quantized_adamw_trains_in_it_and_the_monitor_measures_its_stall(uniform6: None) -> None:
    model, optimizer = _model_and_optimizer()
    monitor = StaleStateMonitor(optimizer, track="exact", names=model, log_per_param=True)
    _train(model, optimizer, 3)
    monitor.reset_window()  # closes the first window
    counts = [0, 0]
    _train(model, optimizer, 7, counts)
    metrics = monitor.compute()
    assert metrics["stale/v/frac"] == pytest.approx(counts[0] / counts[1], rel=1e-12)
    assert 0 < metrics["stale/0.weight/exp_avg_sq/frac"] < 1
    assert {"stale/m/frac", "stale/v/drift", "stale/v/predicted"} <= set(metrics)
    monitor.close()


def test_the_adapter_reads_it_and_restarts_v_onto_its_grid(uniform6: None) -> None:
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer, 3)
    adapter = adapter_for(optimizer)
    weight = model[0].weight
    slots = {slot.moment: slot for slot in adapter.slots() if slot.param is weight}
    for moment, slot in slots.items():
        fmt, q = optimizer.moment_format(weight, moment), optimizer.moment_state(weight, moment)
        assert slot.format == "uniform6" and slot.zero_code() == fmt.zero_code()
        assert torch.equal(slot.value(), fmt.dequantize(q).reshape(-1))
        assert torch.equal(slot.codes().reshape(-1), fmt.element_codes(q))
        assert torch.allclose(slot.spacing(), fmt.spacing(q).reshape(-1))
    beta1, beta2 = optimizer.param_groups[0]["betas"]
    m_hat = slots["m"].value() / (1 - beta1**3)
    target = restarted_v(m_hat, weight.grad.reshape(-1), 3, beta2)
    adapter.reset(("v",))  # the bounded restart: v rounded up onto the toy grid, its age kept
    v = slots["v"].value()
    assert torch.all(v >= target) and torch.all(v[target > 0] > 0) and int(optimizer.state[weight]["step_v"]) == 3
    _train(model, optimizer, 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_its_checkpoint_loads_and_inspect_reads_it(uniform6: None, tmp_path) -> None:
    from lightning_stale.commands.inspect import build_report

    model, optimizer = _model_and_optimizer()
    _train(model, optimizer, 3)
    path = tmp_path / "uniform6.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    twin, resumed = _model_and_optimizer()
    resumed.load_state_dict(torch.load(path)["optimizer"])
    for a, b in zip(optimizer.state.values(), resumed.state.values()):
        assert all(torch.equal(a[key], b[key]) for key in a)
    [report] = build_report(str(path)).optimizers
    formats = {row.name: [m.format for m in row.moments] for row in report.params}
    assert formats["0.weight"] == ["uniform6", "uniform6"] and formats["0.bias"] == ["fp32", "fp32"]


def test_registration_checks_the_class_and_unknown_names_list_the_registered_ones(uniform6: None) -> None:
    with pytest.raises(TypeError, match="StateFormat subclass"):
        register_format(int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="non-empty string `name`"):
        register_format(type("Nameless", (Uniform6Format,), {"name": ""}))
    with pytest.raises(ValueError, match=r"'int8_dynamic', 'uniform6'\)"):
        QuantizedAdamW([nn.Parameter(torch.zeros(3))], state_format="uniform7")


def test_a_registered_format_that_names_a_theory_format_gets_its_closed_form_rho(uniform6: None) -> None:
    from types import SimpleNamespace

    from lightning_stale import theory
    from lightning_stale.decide.slot_theory import closed_form_rho

    slot = SimpleNamespace(beta=0.999, format="uniform6", moment="v")
    assert closed_form_rho(slot) == (None, "grid estimate (uniform6)", True)  # a grid: estimated from stored values

    class Bf16Like(Uniform6Format):
        name = "uniform6-as-bf16"
        theory_name = "bf16"

    register_format(Bf16Like)
    try:
        slot = SimpleNamespace(beta=0.999, format="uniform6-as-bf16", moment="v")
        assert closed_form_rho(slot) == (theory.format_rho_hat("bf16", 0.999), "bf16 format", False)
    finally:
        del FORMATS["uniform6-as-bf16"]
