"""Host syncs per optimizer step, counted on real CPU runs of every front-end (:class:`HostSyncCounter`): none on a
step that does not log once set-up is over (the first steps, where parameters' state appears), with every remedy and
every supported optimizer family, after a resume and with missing or sparse gradients; on logging steps a number that
does not grow with the tensor count.

Set-up here: the first two optimizer steps (the state appears in the first; the measurement plans are built at the
second, the first measured one). Check steps (every ``coverage_steps``) are the logging steps of every front-end; the
plain loops log on them too.
"""

from __future__ import annotations

import io

import lightning as L
import pytest
import torch
from helpers import make_optimizer
from torch import nn

from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.fabric import StaleStateFabricCallback
from lightning_stale.testing import HostSyncCounter

EVERY = 4  # logging interval and coverage_steps: check steps are logging steps
STEPS = 12
SETUP = 3  # tallies 1 and 2 are set-up (tally 0 is everything before the first step)
SIZES = [(33, 17), (5,), (300,), (7, 3, 2), (64, 9), (1,), (129,), (16, 16)]  # odd sizes, a 1-element one


def params(n: int = len(SIZES), dtype: torch.dtype = torch.bfloat16) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(SIZES[i % len(SIZES)], dtype=dtype)) for i in range(n)]


OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adamw-forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "bnb-adamw8bit": lambda ps: make_optimizer("bnb", ps, min_8bit_size=256),
    "bnb-lion8bit": lambda ps: make_optimizer("bnb:Lion8bit", ps, min_8bit_size=256),
    "qadamw": lambda ps: make_optimizer("qadamw:int8_dynamic:stochastic", ps, min_quantized_size=256),
    "torchao-adamw8bit": lambda ps: make_optimizer("torchao", ps, block_size=256),
}


def plain_loop(optimizer: torch.optim.Optimizer, ps: list[nn.Parameter], syncs: HostSyncCounter, steps: int = STEPS,
               missing: int | None = None, first: int = 1, **options) -> StaleStateMonitor:
    """A plain loop under ``syncs`` from step ``first``: gradients set directly, made on the parameters' device
    (``device=``: a tensor made without one would be a host tensor to the counter), parameter ``missing`` without one
    on every other step; a row logged every EVERY steps."""
    monitor = StaleStateMonitor(optimizer, coverage_steps=EVERY, **options)
    g = torch.Generator().manual_seed(first)
    for step in range(first, first + steps):
        for i, p in enumerate(ps):
            p.grad = None if i == missing and step % 2 else \
                torch.randn(p.shape, generator=g, device=p.device).to(p.dtype) * 1e-2  # made on the device
        optimizer.step()
        optimizer.zero_grad()
        if step % EVERY == 0:
            syncs.mark_logging()
            monitor.compute()
            monitor.reset_window()
    return monitor


def assert_quiet(syncs: HostSyncCounter, after: int = SETUP) -> None:
    offenders = syncs.offenders(after)
    assert not offenders, "host syncs on steps that do not log:\n" + syncs.summary(offenders)
    assert len(syncs.tallies) > after + EVERY, "too few steps counted to pass set-up"


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "torchao-adamw8bit" else k
                                  for k in OPTIMIZERS])
def test_every_optimizer_family_with_the_automatic_remedy(kind):
    ps = params(dtype=torch.float32 if kind == "torchao-adamw8bit" else torch.bfloat16)
    with HostSyncCounter() as syncs:
        plain_loop(OPTIMIZERS[kind](ps), ps, syncs, remedy="auto", weights="compensated" if kind != "torchao-adamw8bit"
                   else None, missing=3)
    assert_quiet(syncs)


@pytest.mark.parametrize("options", [
    {}, {"reset": "theory"}, {"reset": "periodic", "every": 3}, {"reset": "adaptive", "min_interval": 2, "s0": 0.01},
    {"reset": "drift", "min_interval": 2}, {"underflow_guard": True, "reset": "periodic", "every": 5},
    {"weights": "stochastic"}, {"weights": "compensated", "moments": ("v",), "reset": "periodic", "every": 5},
    {"track": "exact", "remedy": "auto"},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "monitor")
@pytest.mark.parametrize("kind", ["adamw-foreach", "qadamw"])
def test_every_remedy(kind, options):
    ps = params()
    with HostSyncCounter() as syncs:
        plain_loop(OPTIMIZERS[kind](ps), ps, syncs, missing=5, **options)
    assert_quiet(syncs)


@pytest.mark.parametrize("kind", ["adamw-fused", "qadamw"])
def test_v_only_resets_of_step_counters_on_the_device(kind):
    """The bounded v restart computes with the step counter where it lives (torch fused, QuantizedAdamW's ages)."""
    ps = params()
    with HostSyncCounter() as syncs:
        monitor = plain_loop(OPTIMIZERS[kind](ps), ps, syncs, reset="periodic", every=3, moments=("v",))
    assert monitor.reset_events == STEPS // 3
    assert_quiet(syncs)


def test_the_adaptive_policy_resets_without_reading_the_host_between_checks():
    """Constant gradients and beta2 = 0.5: v settles and stalls within ten steps while E(k) falls to nothing, so the
    policy resets, from the fractions handed over at the check steps."""
    ps = params()
    optimizer = torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.5))
    grads = [torch.randn_like(p) for p in ps]
    with HostSyncCounter() as syncs:
        monitor = StaleStateMonitor(optimizer, coverage_steps=EVERY, reset="adaptive", min_interval=2)
        for step in range(1, 21):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            optimizer.step()
            if step % EVERY == 0:
                syncs.mark_logging()
                monitor.compute()
                monitor.reset_window()
    assert_quiet(syncs)
    assert monitor.reset_events > 0


@pytest.mark.parametrize("kind", ["adamw-fused", "qadamw", "sgd"])
def test_after_a_resume(kind):
    """Step counters that live on the device (torch fused, QuantizedAdamW's ages) and a restored monitor: the first
    step after the resume is set-up again, none after it reads."""
    ps = params()
    optimizer = OPTIMIZERS[kind](ps)
    with HostSyncCounter() as before:
        monitor = plain_loop(optimizer, ps, before, steps=6, remedy="auto", weights="compensated")
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in ps], "optimizer": optimizer.state_dict(),
                "monitor": monitor.state_dict()}, buffer)
    monitor.close()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = [nn.Parameter(t.clone()) for t in saved["params"]]
    optimizer = OPTIMIZERS[kind](resumed)
    optimizer.load_state_dict(saved["optimizer"])
    with HostSyncCounter() as syncs:
        plain_loop(optimizer, resumed, syncs, first=7, state=saved["monitor"], remedy="auto", weights="compensated")
    assert_quiet(syncs, after=2)


def test_sparse_gradients():
    torch.manual_seed(0)
    embedding = nn.Embedding(300, 16, sparse=True).to(torch.bfloat16)
    dense = nn.Linear(16, 3).to(torch.bfloat16)
    optimizer = torch.optim.SGD([*embedding.parameters(), *dense.parameters()], lr=1e-2)
    with HostSyncCounter() as syncs:
        monitor = StaleStateMonitor(optimizer, coverage_steps=EVERY, remedy="auto", weights="stochastic")
        for step in range(1, STEPS + 1):
            dense(embedding(torch.randint(0, 300, (8,)))).float().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % EVERY == 0:
                syncs.mark_logging()
                monitor.compute()
                monitor.reset_window()
    assert embedding.weight.grad is None or embedding.weight.grad.is_sparse
    assert_quiet(syncs)


def test_logging_steps_read_the_host_a_number_of_times_that_does_not_grow_with_the_tensors():
    counts = []
    for n in (8, 64):
        ps = params(n)
        with HostSyncCounter() as syncs:
            plain_loop(OPTIMIZERS["adamw-fused"](ps), ps, syncs, remedy="auto", missing=2)
        assert_quiet(syncs)
        counts.append([(t.index, t.reads) for t in syncs.tallies if t.logs or t.index < SETUP])
    assert counts[0] == counts[1], counts
    assert all(0 < reads <= 8 for index, reads in counts[0] if index >= SETUP), counts[0]


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(17, 33), nn.ReLU(), nn.Linear(33, 3)).to(torch.bfloat16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(128, 17, generator=g).to(torch.bfloat16),
                                              torch.randn(128, 3, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


class MarkLogging(L.Callback):
    def __init__(self, syncs: HostSyncCounter) -> None:
        self.syncs = syncs

    def on_train_batch_end(self, trainer, *args) -> None:
        from lightning_stale import _compat

        if _compat.lightning_should_log(trainer):
            self.syncs.mark_logging()


@pytest.mark.parametrize("options", [{"remedy": "auto"}, {"reset": "adaptive", "min_interval": 2}],
                         ids=["auto", "adaptive"])
def test_lightning_trainer(tmp_path, options, host_syncs):
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=STEPS, log_every_n_steps=EVERY, accelerator="cpu",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[StaleStateCallback(**options), MarkLogging(host_syncs)])
    trainer.fit(Regression())
    assert sum(t.logs for t in host_syncs.tallies) == STEPS // EVERY
    assert_quiet(host_syncs)


def test_fabric():
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[StaleStateFabricCallback(EVERY, remedy="auto")])
    model = Regression()
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    with HostSyncCounter() as syncs:
        for step, (x, y) in enumerate(Regression().train_dataloader(), start=1):
            fabric.backward(nn.functional.mse_loss(model.net(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
            if step % EVERY == 0:
                syncs.mark_logging()
            if step == STEPS:
                break
    assert_quiet(syncs)


def test_hugging_face_trainer(tmp_path, host_syncs):
    transformers = pytest.importorskip("transformers")
    from lightning_stale.hf import add_stale_callback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
                                          logging_steps=EVERY, report_to=[], use_cpu=True, save_strategy="no",
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    add_stale_callback(trainer, remedy="auto")

    class MarkLogs(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            host_syncs.mark_logging()

    trainer.add_callback(MarkLogs())
    trainer.train()
    assert sum(t.logs for t in host_syncs.tallies) >= STEPS // EVERY
    assert_quiet(host_syncs)
