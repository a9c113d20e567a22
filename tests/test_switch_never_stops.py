"""``LIGHTNING_STALE`` is set once for a whole cluster, so what it switches on never ends a run: an optimizer the package
does not know (LBFGS, a custom class) or none at all gives one warning line, saying what is not supported and what to
do, and training goes on unmonitored, under the Trainer and under Fabric. A callback constructed explicitly keeps its
clear error for an unknown optimizer, and ``strict=False`` keeps its generic adapter."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.fabric.loggers import Logger
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_stale import StaleStateCallback
from lightning_stale.fabric import StaleStateFabricCallback
from lightning_stale.factory import ENV_VAR
from lightning_stale.messages import StaleStateWarning

STEPS = 6


class PlainMomentum(torch.optim.Optimizer):
    """An optimizer class of the user's own: SGD with a momentum buffer, unknown to lightning_stale."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.add_(buf, alpha=-group["lr"])
        return loss


def make_optimizer(kind: str, params):
    return {"lbfgs": lambda: torch.optim.LBFGS(params, lr=0.1, max_iter=2),
            "custom": lambda: PlainMomentum(params), "none": lambda: None}[kind]()


class Model(BoringModel):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def configure_optimizers(self):
        return make_optimizer(self.kind, self.parameters())


def switch_lines(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, StaleStateWarning)
            and str(w.message).startswith(f"{ENV_VAR}=")]


def fit(tmp_path, model: L.LightningModule, callbacks=()) -> L.Trainer:
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=STEPS, limit_val_batches=0, log_every_n_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize("spec", ["1", "auto"])
@pytest.mark.parametrize("kind", ["lbfgs", "custom", "none"])
def test_the_switch_lets_a_trainer_it_cannot_watch_train_on(tmp_path, monkeypatch, spec, kind):
    monkeypatch.setenv(ENV_VAR, spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, Model(kind))
    assert trainer.global_step == STEPS or kind == "none"
    assert trainer.state.finished
    (line,) = switch_lines(caught)
    assert line.startswith(f"{ENV_VAR}={spec!r}: ") and "training goes on without lightning_stale" in line
    if kind == "none":
        assert "no optimizer" in line and "configure_optimizers" in line
    else:
        name = "torch.optim.lbfgs.LBFGS" if kind == "lbfgs" else f"{__name__}.PlainMomentum"
        assert f"{name} is not an optimizer lightning_stale knows" in line
        assert "StaleStateCallback(strict=False)" in line and "register_adapter" in line
    (callback,) = [cb for cb in trainer.callbacks if isinstance(cb, StaleStateCallback)]
    assert callback.monitor is None
    assert not any(key.startswith("stale/") for key in trainer.callback_metrics)


class Rows(Logger):
    """Keeps what ``fabric.log_dict`` sends."""

    name, version = "rows", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.rows.append({"step": step, **metrics})

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def fabric_loop(kind: str, callbacks=None) -> tuple[Rows, nn.Module]:
    """A Fabric loop (LitGPT's shape: the model set up first, then its optimizer); with no optimizer, a hand-written
    update."""
    rows = Rows()
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=rows, callbacks=callbacks)
    torch.manual_seed(0)
    model = fabric.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = make_optimizer(kind, model.parameters())
    optimizer = fabric.setup_optimizers(optimizer) if optimizer is not None else None
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))

        def closure():
            if optimizer is not None:
                optimizer.zero_grad()
            loss = model(x).square().mean()
            fabric.backward(loss)
            return loss

        if kind == "lbfgs":
            optimizer.step(closure)
        elif optimizer is not None:
            closure()
            optimizer.step()
        else:
            closure()
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.01 * p.grad)
                    p.grad = None
    return rows, model


@pytest.mark.parametrize("spec", ["1", "auto"])
@pytest.mark.parametrize("kind", ["lbfgs", "custom", "none"])
def test_the_switch_lets_a_fabric_loop_it_cannot_watch_train_on(monkeypatch, spec, kind):
    monkeypatch.setenv(ENV_VAR, spec)
    monkeypatch.setenv(f"{ENV_VAR}_LOG_EVERY", "2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows, _ = fabric_loop(kind)
    assert rows.rows == []  # nothing logged: nothing watched
    lines = switch_lines(caught)
    if kind == "none":  # no optimizer ever steps: the callback never attaches, and has nothing to say
        assert lines == []
        return
    (line,) = lines  # one line, at the optimizer's first step, not one per step
    name = "torch.optim.lbfgs.LBFGS" if kind == "lbfgs" else f"{__name__}.PlainMomentum"
    assert line.startswith(f"{ENV_VAR}={spec!r}: {name} is not an optimizer lightning_stale knows; training goes on")
    assert "StaleStateFabricCallback(strict=False)" in line and "register_adapter" in line


def test_a_malformed_log_interval_is_warned_and_the_default_kept(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    monkeypatch.setenv(f"{ENV_VAR}_LOG_EVERY", "often")
    with pytest.warns(StaleStateWarning, match="LIGHTNING_STALE_LOG_EVERY='often' is not a non-negative int.*every 50"):
        fabric = L.Fabric(accelerator="cpu", devices=1)
    (callback,) = [cb for cb in fabric._callbacks if isinstance(cb, StaleStateFabricCallback)]
    assert callback.log_every_n_steps == 50 and callback.from_environment


def test_an_explicit_callback_keeps_its_clear_error_for_an_unknown_optimizer(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(TypeError, match="no lightning_stale adapter for optimizer torch.optim.lbfgs.LBFGS.*strict=False"):
        fit(tmp_path, Model("lbfgs"), [StaleStateCallback()])
    with pytest.raises(TypeError, match=f"no lightning_stale adapter for optimizer {__name__}.PlainMomentum"):
        fabric_loop("custom", [StaleStateFabricCallback(log_every_n_steps=2)])


def test_an_explicit_callback_without_an_optimizer_says_so(tmp_path, monkeypatch):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(MisconfigurationException, match="needs at least one optimizer.*configure_optimizers returned"):
        fit(tmp_path, Model("none"), [StaleStateCallback()])


def test_strict_false_watches_an_unknown_optimizer_with_the_generic_adapter(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    callback = StaleStateCallback(strict=False, track="exact")
    with pytest.warns(UserWarning, match="using the generic adapter"):
        trainer = fit(tmp_path, Model("custom"), [callback])
    assert callback.monitor.steps == [STEPS] and callback.monitor.slots()
    assert "stale/v/frac" in trainer.callback_metrics or "stale/m/frac" in trainer.callback_metrics
    fabric_callback = StaleStateFabricCallback(log_every_n_steps=2, strict=False, track="exact")
    with pytest.warns(UserWarning, match="using the generic adapter"):
        rows, _ = fabric_loop("custom", [fabric_callback])
    assert [row["step"] for row in rows.rows] == [2, 4, 6]


def test_a_fabric_callback_collected_during_a_step_ends_no_step():
    """torch runs its global pre-step hooks from a dict that must not change while it does: a Fabric callback that
    is garbage-collected in the middle of a step (another run's, gone out of scope) removes nothing from it."""
    import gc

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    doomed: list = []

    def collect(optimizer, args, kwargs):
        doomed.clear()
        gc.collect()

    handle = register_optimizer_step_pre_hook(collect)  # runs before the hooks of the callbacks made after it
    kept = StaleStateFabricCallback()
    doomed.append(StaleStateFabricCallback())
    try:
        param = torch.nn.Parameter(torch.zeros(3))
        optimizer = torch.optim.SGD([param], lr=0.1)
        for _ in range(2):
            param.grad = torch.ones(3)
            optimizer.step()
    finally:
        handle.remove()
    assert kept.monitors == {} and torch.equal(param.detach(), torch.full((3,), -0.2))
