"""One engine, four front-ends: the Lightning Trainer callback, the Fabric callback (explicit and through the
``LIGHTNING_STALE`` entry point), a plain PyTorch loop and the Hugging Face Trainer. Each logs fractions equal to an
independent count of the stored codes, and the Trainer, Fabric and plain-loop front-ends give the same rows on the
same run. Under all of them, the window is a torchmetrics Metric: computed, reset, synced and collected as one."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.fabric.loggers import CSVLogger as FabricCSVLogger
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import make_optimizer
from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.fabric import StaleStateFabricCallback
from lightning_stale.factory import ENV_VAR

STEPS, EVERY = 16, 4
OPTIONS = dict(track="exact", reset="periodic", every=6)


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)) for _ in range(STEPS)]


class Probe:
    """Independent count per optimizer step of v codes left unchanged where the gradient is finite and non-zero."""

    def __init__(self, opt: torch.optim.Optimizer, key: str = "state2") -> None:
        self.key, self.steps, self.before = key, [], {}
        opt.register_step_pre_hook(self.pre)
        opt.register_step_post_hook(self.post)

    def pre(self, opt, args, kwargs):
        self.before = {p: s[self.key].clone() for p, s in opt.state.items() if s and self.key in s}

    def post(self, opt, args, kwargs):
        if self.before:
            masks = {p: (p.grad != 0) & torch.isfinite(p.grad) for p in self.before}
            self.steps.append((sum(int(((opt.state[p][self.key] == old) & masks[p]).sum())
                                   for p, old in self.before.items()),
                               sum(int(m.sum()) for m in masks.values())))

    def windows(self, every: int, total: int) -> list[float]:
        """The fraction of each logging window (the first optimizer step has nothing to compare)."""
        out = []
        for end in range(every, total + 1, every):
            window = self.steps[max(0, end - every - 1):end - 1]
            out.append(sum(s for s, _ in window) / sum(c for _, c in window))
        return out


def read_csv(path: Path, key: str) -> list[float]:
    with path.open() as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def run_plain() -> tuple[list[dict], Probe]:
    model = network()
    opt = make_optimizer("bnb", model.parameters(), min_8bit_size=256)
    probe = Probe(opt)
    monitor = StaleStateMonitor(opt, names=model, coverage_steps=EVERY, **OPTIONS)
    rows = []
    for step, (x, y) in enumerate(batches(), start=1):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            rows.append(monitor.compute())
            monitor.reset_window()
    monitor.close()
    return rows, probe


def run_fabric(tmp_path: Path, callback: StaleStateFabricCallback | None) -> tuple[Path, Probe]:
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[callback] if callback else None,
                      loggers=FabricCSVLogger(tmp_path, name="fabric", version=0))
    model = network()
    opt = make_optimizer("bnb", model.parameters(), min_8bit_size=256)
    probe = Probe(opt)
    model, opt = fabric.setup(model, opt)
    for x, y in batches():
        fabric.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    for logger in fabric.loggers:
        logger.finalize("success")
    return tmp_path / "fabric" / "version_0" / "metrics.csv", probe


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        x, y = zip(*batches())
        return DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), batch_size=8)

    def configure_optimizers(self):
        opt = make_optimizer("bnb", self.parameters(), min_8bit_size=256)
        self.probe = Probe(opt)
        return opt


def run_trainer(tmp_path: Path) -> tuple[Path, Probe]:
    module, callback = Module(), StaleStateCallback(**OPTIONS)
    assert callback.metric is None  # until the fit starts
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=STEPS, log_every_n_steps=EVERY, accelerator="cpu",
                        logger=CSVLogger(tmp_path, name="trainer", version=0), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(module)
    assert isinstance(callback.metric, torchmetrics.Metric) and callback.metric is callback.monitor.metric
    return tmp_path / "trainer" / "version_0" / "metrics.csv", module.probe


def test_trainer_fabric_and_plain_loop_give_the_same_rows_and_match_the_count(tmp_path):
    plain_rows, plain_probe = run_plain()
    fabric_csv, fabric_probe = run_fabric(tmp_path, StaleStateFabricCallback(log_every_n_steps=EVERY, **OPTIONS))
    trainer_csv, trainer_probe = run_trainer(tmp_path)
    plain = [row["stale/v/frac"] for row in plain_rows]
    # The Fabric callback attaches at the first optimizer step, so its first window starts one step later.
    assert fabric_probe.steps == plain_probe.steps == trainer_probe.steps  # the very same run three times
    assert plain == pytest.approx(plain_probe.windows(EVERY, STEPS), rel=1e-12)
    assert read_csv(trainer_csv, "stale/v/frac") == pytest.approx(plain, rel=1e-6)  # float32 in Lightning's log
    assert read_csv(fabric_csv, "stale/v/frac") == pytest.approx(plain, rel=1e-12)
    assert read_csv(fabric_csv, "stale/resets")[-1] == read_csv(trainer_csv, "stale/resets")[-1] == 2


def test_fabric_compute_is_a_readout_and_reset_window_starts_the_next_row(tmp_path):
    callback = StaleStateFabricCallback(log_every_n_steps=0, **OPTIONS)  # never logs: the user reads the rows
    run_fabric(tmp_path, callback)
    row = callback.compute()
    assert row["stale/v/frac"] > 0 and callback.compute() == row
    callback.reset_window()
    assert callback.compute() == {}


def test_fabric_entry_point_activates_with_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    monkeypatch.setenv(f"{ENV_VAR}_LOG_EVERY", str(EVERY))
    csv_path, probe = run_fabric(tmp_path, None)  # no callback passed: LitGPT's situation
    logged = read_csv(csv_path, "stale/v/frac")
    assert len(logged) == STEPS // EVERY and all(0.0 <= v <= 1.0 for v in logged)


def test_fabric_entry_point_is_inactive_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    assert not any(isinstance(cb, StaleStateFabricCallback) for cb in fabric._callbacks)


def test_hugging_face_trainer_with_bitsandbytes_8bit(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_stale.hf import add_stale_callback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=96, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (64, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4,
                                          logging_steps=EVERY, optim="adamw_bnb_8bit", report_to=[],
                                          use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    callback = add_stale_callback(trainer, track="exact")

    class AttachProbe(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            self.probe = Probe(optimizer.optimizer)  # accelerate's wrapper holds the bitsandbytes optimizer

    attach = AttachProbe()
    trainer.callback_handler.callbacks.insert(0, attach)
    assert callback.metric is None  # until training begins
    trainer.train()
    assert isinstance(callback.metric, torchmetrics.Metric) and callback.metric is callback.monitor.metric
    rows = [r for r in trainer.state.log_history if "stale/v/frac" in r]
    assert len(rows) == 12 // EVERY
    assert [r["stale/v/frac"] for r in rows] == pytest.approx(attach.probe.windows(EVERY, 12), rel=1e-12)
    assert type(callback.monitor.optimizers[0]).__name__ == "AdamW"  # bitsandbytes' 8-bit AdamW class


def test_plain_loop_with_torchao_8bit_matches_the_count():
    torchao_optim = pytest.importorskip("torchao.optim")
    model = network()
    opt = torchao_optim.AdamW8bit(model.parameters(), lr=1e-3)
    before, counts = {}, []

    def codes(state):  # the 8-bit codes, or the plain tensor of parameters below torchao's size threshold
        buf = state["exp_avg_sq"]
        return getattr(buf, "codes", buf).clone()

    def pre(o, args, kwargs):
        before.clear()
        before.update({p: codes(s) for p, s in o.state.items() if s})

    def post(o, args, kwargs):
        masks = {p: (p.grad != 0) & torch.isfinite(p.grad) for p in before}
        if before:
            counts.append((sum(int(((codes(o.state[p]) == old) & masks[p]).sum()) for p, old in before.items()),
                           sum(int(m.sum()) for m in masks.values())))

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    monitor = StaleStateMonitor(opt, track="exact")
    for x, y in batches()[:6]:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    stalled, counted = map(sum, zip(*counts))
    assert monitor.compute()["stale/v/frac"] == pytest.approx(stalled / counted, rel=1e-12)
    assert any(type(s["exp_avg_sq"]).__name__ == "OptimState8bit" for s in opt.state.values())
    monitor.close()


@pytest.mark.slow
def test_fabric_ddp_sums_across_ranks_and_resets_together(tmp_path):
    """2 processes (gloo), per-rank sample seeds: both ranks get the same rows (the reduction ran: their local samples
    differ), close to the exact count, and reset at the same steps with identical states."""
    import json
    import os
    import subprocess
    import sys

    worker = Path(__file__).with_name("fabric_ddp_worker.py")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    if not all(f.exists() for f in files):
        pytest.fail(f"Fabric DDP worker failed (rc {proc.returncode}):\n{proc.stderr[-5000:]}")
    rank0, rank1 = (json.loads(f.read_text()) for f in files)
    assert [r["stale/v/frac"] for r in rank0["rows"]] == [r["stale/v/frac"] for r in rank1["rows"]]
    assert rank0["resets"] == rank1["resets"] == [5, 10] and rank0["state"] == rank1["state"]
    for i, row in enumerate(rank0["rows"]):  # window i: steps 4i+1 .. 4i+4 (the first step is not compared)
        window = [c for c in rank0["probe"][4 * i:4 * (i + 1)] if c[1] > 0]
        exact = sum(s for s, _ in window) / sum(c for _, c in window)
        assert abs(row["stale/v/frac"] - exact) < 0.05


def train(model: nn.Module, optimizers: list[torch.optim.Optimizer], step_end=lambda step, loss: None) -> None:
    """The run of :func:`batches`, every optimizer stepping each batch; ``step_end(step, loss)`` after each step."""
    for step, (x, y) in enumerate(batches(), start=1):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        step_end(step, loss.detach())


def test_the_monitors_metric_is_a_torchmetrics_metric_that_matches_the_count():
    model = network()
    opt = make_optimizer("bnb", model.parameters(), min_8bit_size=256)
    probe = Probe(opt)
    monitor = StaleStateMonitor(opt, names=model, coverage_steps=EVERY, track="exact")
    metric, rows = monitor.metric, []
    assert isinstance(metric, torchmetrics.Metric)

    def log(step: int, loss: torch.Tensor) -> None:
        if step % EVERY == 0:
            rows.append(metric.compute())
            assert monitor.compute() == rows[-1] and metric.compute() == rows[-1]  # a readout
            metric.reset()  # the monitor's reset_window
            assert monitor.compute() == {}

    train(model, [opt], log)
    assert [row["stale/v/frac"] for row in rows] == pytest.approx(probe.windows(EVERY, STEPS), rel=1e-12)


def test_the_metric_sits_in_a_metric_collection_whose_calls_leave_the_window_alone():
    model = network()
    opt = make_optimizer("bnb", model.parameters(), min_8bit_size=256)
    monitor = StaleStateMonitor(opt, names=model, coverage_steps=EVERY)
    collection = torchmetrics.MetricCollection({"loss": torchmetrics.MeanMetric(), "stale": monitor.metric})
    rows = []

    def log(step: int, loss: torch.Tensor) -> None:
        collection.update(loss) if step % 2 else collection(loss)  # update and forward pass the loss to both
        if step % EVERY == 0:
            row = collection.compute()
            assert row["loss"] > 0 and {k: v for k, v in row.items() if k != "loss"} == monitor.compute()
            rows.append(row)
            collection.reset()
            assert monitor.compute() == {}

    train(model, [opt], log)
    assert len(rows) == STEPS // EVERY and all(0.0 <= row["stale/v/frac"] <= 1.0 for row in rows[1:])


def test_the_metric_sums_its_one_state_in_one_collective_on_logging_steps_only():
    """Two identical runs, one as if on two identical ranks (``reduce`` doubles what it sums): the same rows, one
    all-reduce of the window's vector per row, and no collective between logging steps once every parameter has its
    first estimate (the check steps that agree decisions fall on logging steps, as in the front-ends)."""
    calls: list[tuple[int, int]] = []  # (step, elements summed)
    step_now = [0]

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        calls.append((step_now[0], tensor.numel()))
        return tensor * 2

    models = [network(), network()]
    opts = [make_optimizer("bnb", m.parameters(), min_8bit_size=256) for m in models]
    alone, doubled = (StaleStateMonitor(o, names=m, coverage_steps=EVERY, reduce=r)
                      for o, m, r in zip(opts, models, (None, reduce)))
    row_calls = []
    for step, (x, y) in enumerate(batches(), start=1):
        step_now[0] = step
        for model, opt in zip(models, opts):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if step % EVERY == 0:
            before = len(calls)
            rows = [{k: v for k, v in m.compute().items() if not k.endswith("predicted")} for m in (doubled, alone)]
            row_calls.append(calls[before:])
            assert rows[0] == rows[1] != {}  # (with a reduce every rho-hat waits for an agreed estimate: predictions
            # start later)
            doubled.metric.sync()  # by hand: the summed state, then this process's own again
            synced = doubled.metric.window.clone()
            doubled.metric.unsync()
            assert torch.equal(synced, 2 * doubled.metric.window) and synced.any()
            doubled.reset_window()
            alone.reset_window()
    vector = len(doubled.metric.window)
    assert all(call == [(step, vector)] for call, step in zip(row_calls, range(EVERY, STEPS + 1, EVERY)))
    assert all(step % EVERY == 0 for step, _ in calls if step > EVERY), calls


def test_fabric_rows_of_two_optimizers_are_one_metric_collection(tmp_path):
    """The second optimizer's keys under ``stale/opt1/``, as two plain monitors on the same run would give them."""
    def two_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
        return [make_optimizer("bnb", model[0].parameters(), min_8bit_size=256),
                make_optimizer("torch", model[2].parameters())]

    model = network()
    opts = two_optimizers(model)
    plain = [StaleStateMonitor(o, names=model, coverage_steps=EVERY, track="exact") for o in opts]
    train(model, opts)
    expected = {**plain[0].compute(), **{f"stale/opt1/{k.removeprefix('stale/')}": v
                                          for k, v in plain[1].compute().items()}}

    callback = StaleStateFabricCallback(log_every_n_steps=0, track="exact")
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[callback])
    model = network()
    model, *opts = fabric.setup(model, *two_optimizers(model))
    train(model, opts)
    assert isinstance(callback.metric, torchmetrics.MetricCollection) and list(callback.metric) == ["opt0", "opt1"]
    row = callback.compute()
    assert set(row) == set(expected) and "stale/opt1/v/frac" in row
    # the predictions of a monitor attached inside the first step (Fabric's) start apart from a plain loop's
    assert {k: v for k, v in row.items() if "predicted" not in k} == \
        {k: v for k, v in expected.items() if "predicted" not in k}


class Pair(nn.Module):
    """Two named blocks, so that a name says where a parameter lives."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.encoder, self.head = nn.Linear(8, width), nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.encoder(x).relu())


@pytest.mark.parametrize("shape", ["setup", "setup_then_optimizers", "two_models", "setup_module"])
def test_fabric_names_parameters_as_the_set_up_model_does(monkeypatch, shape):
    """Through the entry point (no model handed to the callback): the names ``names=model`` gives, for LitGPT's order
    (``fabric.setup(model)`` then ``fabric.setup_optimizers``), ``fabric.setup(model, optimizer)`` and two models with
    an optimizer each; ``setup_module`` calls no hook, so its parameters keep their ``opt0.<i>`` keys."""
    monkeypatch.setenv(ENV_VAR, "1")
    fabric = L.Fabric(accelerator="cpu", devices=1)
    (callback,) = [cb for cb in fabric._callbacks if isinstance(cb, StaleStateFabricCallback)]
    torch.manual_seed(0)
    models = [Pair(16), Pair(4)] if shape == "two_models" else [Pair(16)]
    originals = list(models)
    optimizers = [torch.optim.AdamW(m.parameters()) for m in models] if shape in ("setup", "two_models") else None
    if optimizers:
        pairs = [fabric.setup(m, o) for m, o in zip(models, optimizers)]
        models, optimizers = [m for m, _ in pairs], [o for _, o in pairs]
    else:
        models = [fabric.setup_module(m) if shape == "setup_module" else fabric.setup(m) for m in models]
        optimizers = [fabric.setup_optimizers(torch.optim.AdamW(m.parameters())) for m in models]
    for model, optimizer in zip(models, optimizers):
        fabric.backward(model(torch.randn(4, 8)).square().mean())
        optimizer.step()
    for i, (original, monitor) in enumerate(zip(originals, callback.monitors.values())):
        named = set(monitor.reset_periods())
        if shape == "setup_module":
            assert named == {f"opt{i}.{j}" for j in range(4)}
        else:  # what names=original gives: its named_parameters (Fabric's wrapper adds "_forward_module.")
            assert named == {name for name, _ in original.named_parameters()} == {"encoder.weight", "encoder.bias",
                                                                                  "head.weight", "head.bias"}
