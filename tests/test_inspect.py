"""``lightning-stale inspect``: the report of a saved checkpoint against the live monitor of the same run.

Each test trains a few steps with the monitor attached (Lightning with bitsandbytes AdamW8bit and QuantizedAdamW fp8,
a plain loop saved as the README's recipe, a Hugging Face Trainer, a distributed checkpoint), saves what that loop
saves, inspects it and compares: formats with ``monitor.slots()``, rho-hat and periods with ``monitor.rows()`` and
the live estimator, resets and steps since reset with the saved callback state, zero shares with a direct count on
the saved tensors. Bad inputs each get a one-line message.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.cli import main
from lightning_stale.commands.inspect import build_report
from lightning_stale.decide import slot_theory

CLI = [sys.executable, "-m", "lightning_stale.cli"]
# Whether torch.optim's Adam saves ``decoupled_weight_decay`` in its groups (newer torch; 2.6 does not): without it
# a saved state cannot tell Adam from AdamW, and inspect names both (or takes the run's hyperparameters.yaml).
SAVES_DECOUPLED = "decoupled_weight_decay" in torch.optim.Adam([torch.zeros(1, requires_grad=True)]).defaults


def saved_name(name: str, yaml: bool = False) -> str:
    """What inspect names a saved torch.optim Adam/AdamW on this torch (``yaml``: the folder has LitGPT's
    hyperparameters.yaml)."""
    if SAVES_DECOUPLED:
        return f"{name} (torch.optim)"
    return f"{name} (torch.optim, as hyperparameters.yaml names it)" if yaml else "Adam or AdamW (torch.optim)"


class Tiny(L.LightningModule):
    """Linear 32 -> 256 -> ReLU -> Linear 4 on a fixed regression; 8-bit and fp8 states from 256 elements on."""

    def __init__(self, optimizer: str, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.optimizer, self.betas = optimizer, betas
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(256, 32, generator=g), torch.randn(256, 4, generator=g)),
                          batch_size=8)

    def configure_optimizers(self):
        if self.optimizer == "bnb":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(self.parameters(), lr=1e-3, betas=self.betas, min_8bit_size=256)
        from lightning_stale.optim import QuantizedAdamW

        return QuantizedAdamW(self.parameters(), lr=1e-3, betas=self.betas, state_format="fp8_e4m3",
                              min_quantized_size=256, compile=False)


def _fit(tmp_path: Path, module: Tiny, callback: StaleStateCallback, steps: int,
         log_every_n_steps: int = 50) -> tuple[L.Trainer, Path]:
    trainer = L.Trainer(max_steps=steps, callbacks=[callback], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        log_every_n_steps=log_every_n_steps)
    trainer.fit(module)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    return trainer, path


def _inspect(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _rows(report) -> dict[tuple[str, str], object]:
    """(unit key, state key) -> the report's row of that moment."""
    return {(p.unit, m.key): m for o in report.optimizers for p in o.params for m in p.moments}


def _live(monitor: StaleStateMonitor, index: int = 0) -> dict[tuple[str, str], object]:
    """(unit key, state key) -> the live slot."""
    return {(e.unit.key, e.slot.key): e.slot for e in monitor.engines()[index].entries.values()}


def test_lightning_bitsandbytes_checkpoint_matches_the_live_monitor(tmp_path, capsys):
    # b2 = 0.99: the live grid estimate is re-taken on the check steps (every 10) and final from 0.2 EMA horizons (20
    # steps) on, so at step 20 the live monitor has estimated rho-hat on the very state the checkpoint holds
    callback = StaleStateCallback(reset="theory")
    _, path = _fit(tmp_path, Tiny("bnb", betas=(0.9, 0.99)), callback, steps=20, log_every_n_steps=10)
    monitor = callback.monitor
    report = build_report(str(path))
    rows, live = _rows(report), _live(monitor)
    assert report.kind == "a Lightning checkpoint" and report.step == 20
    params = report.optimizers[0].params
    assert [p.name for p in params] == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert "matched by order and shape" in report.names
    assert set(rows) == set(live)
    for key, slot in live.items():
        assert rows[key].format == slot.format and rows[key].elements == slot.numel  # int8_dynamic; fp32 for the bias
        if slot.format == "int8_dynamic":  # the live grid estimator on the live state, on the same sample
            assert rows[key].rho == slot_theory.estimate_rho(slot, key[0]) is not None
    saved = torch.load(path, weights_only=True)
    ledger = next(iter(saved["callbacks"].values()))["optimizers"][0]["ledger"]
    for p, unit in zip(params, monitor.rows()):
        assert p.unit == unit.key and p.step == 20
        assert p.monitor["period"] == unit.period and ledger[unit.key]["period"] == (unit.period or -1)
        assert p.monitor["age"] == unit.age == 20 and p.monitor["resets"] == 0
        v = next(m for m in p.moments if m.moment == "v")
        assert p.monitor["rho"] == unit.rho == v.rho  # the live monitor's rho-hat, saved, and the report's
        assert v.k_star == unit.period
    # zero shares: a direct count on the saved codes of net.0.weight's v
    state = saved["optimizer_states"][0]["state"][0]["__bnb_optimizer_quant_state__"]
    v = state["qmap2"][state["state2"].long()] * state["absmax2"].repeat_interleave(256)[:8192].view(256, 32)
    m = state["qmap1"][state["state1"].long()] * state["absmax1"].repeat_interleave(256)[:8192].view(256, 32)
    assert rows[("opt0.0", "state2")].zero == (v == 0).float().mean().item()
    assert rows[("opt0.0", "state2")].lone_zero == ((v == 0) & (m != 0)).float().mean().item()

    # the table and `period --state` read the same checkpoint
    rc, out, err = _inspect(capsys, str(path))
    assert rc == 0 and not err
    assert "optimizer 0: Adam, AdamW or LAMB (bitsandbytes, 8-bit), 4 parameters (4 with state), state step 20" in out
    assert "policy TheoryReset" in out and "net.0.weight" in out and "live rho" in out
    rc, out, _ = (main(["period", "--state", str(path)]), *capsys.readouterr())
    assert rc == 0 and "bitsandbytes 8-bit" in out and "stale but harmless" in " ".join(out.split())


def test_lightning_quantized_adamw_fp8_checkpoint_with_resets(tmp_path, capsys):
    callback = StaleStateCallback(reset="periodic", every=5)
    _, path = _fit(tmp_path, Tiny("qadamw"), callback, steps=12)
    monitor = callback.monitor
    report = build_report(str(path))
    rows, live = _rows(report), _live(monitor)
    for key, slot in live.items():
        assert rows[key].format == slot.format  # fp8_e4m3 from 256 elements on, fp32 below
    for p, unit in zip(report.optimizers[0].params, monitor.rows()):
        v = next(m for m in p.moments if m.moment == "v")
        # a closed form: the live monitor's rho-hat and the report's agree exactly, K* from the same rule
        assert v.rho == unit.rho or (v.rho is None and unit.rho is None)
        assert v.k_star == slot_theory.reset_period(unit.rho, 0.999, 0.6)[0]
        assert p.monitor["resets"] == unit.resets == 2 and p.monitor["age"] == unit.age == 2
        assert p.monitor["last_reset_step"] == 10 and p.step == 2  # a full reset restarts the state's own counter
    # zero, lone zero and bottom-of-grid shares: a direct count on the saved fp8 codes of net.0.weight
    state = torch.load(path, weights_only=True)["optimizer_states"][0]["state"][0]
    v, m = state["exp_avg_sq"].float(), state["exp_avg"].float()
    row = rows[("opt0.0", "exp_avg_sq")]
    assert row.zero == (v == 0).float().mean().item() and row.lone_zero == ((v == 0) & (m != 0)).float().mean().item()
    assert row.bottom == (v == 2.0**-9).float().mean().item() and row.top == (v == 448).float().mean().item()
    rc, out, _ = _inspect(capsys, str(path), "--json")
    saved = json.loads(out)
    assert rc == 0 and saved["optimizers"][0]["family"] == "lightning_stale"
    assert saved["optimizers"][0]["monitor"]["reset_events"] == 2


def test_plain_loop_checkpoint_table_json_and_figure(tmp_path, capsys):
    """The README's plain-loop recipe: model, optimizer and monitor state in one torch.save'd dict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 2)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = StaleStateMonitor(optimizer, reset="theory", names=model)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        x = torch.randn(8, 16, generator=g, dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path / "run.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "stale": monitor.state_dict()}, path)
    report = build_report(str(path))
    assert report.names == "the model state_dict under 'model', matched by order and shape"
    assert [p.name for p in report.optimizers[0].params] == [n for n, _ in model.named_parameters()]
    for p, unit in zip(report.optimizers[0].params, monitor.rows()):
        v = next(m for m in p.moments if m.moment == "v")
        assert v.format == "bf16" and v.rho == unit.rho and v.k_star == unit.period == p.monitor["period"]
    rc, out, err = _inspect(capsys, str(path), "--plot", str(tmp_path / "inspect.png"), "--top", "2")
    assert rc == 0 and not err
    assert "2 of 4 (--top 0 for all)" in out and "monitor state ('stale')" in out
    assert (tmp_path / "inspect.png").read_bytes()[:4] == b"\x89PNG"

    torch.save(optimizer.state_dict(), tmp_path / "bare.pt")  # a bare state_dict: no names, no monitor state
    report = build_report(str(tmp_path / "bare.pt"))
    assert report.kind == "an optimizer state_dict" and report.names.startswith("by position")
    assert [p.name for p in report.optimizers[0].params] == ["param 0", "param 1", "param 2", "param 3"]


def test_hugging_face_checkpoint_folder(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from lightning_stale.hf import add_stale_callback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64,
                                                                 n_positions=16))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8,
                                          logging_steps=2, optim="adamw_bnb_8bit", report_to=[], use_cpu=True,
                                          save_strategy="steps", save_steps=4, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    callback = add_stale_callback(trainer, reset="theory")
    trainer.train()
    folder = tmp_path / "checkpoint-4"
    report = build_report(str(folder))
    assert report.kind == "a Hugging Face checkpoint folder" and report.step == 4
    assert report.names.startswith("the model built from config.json (the Trainer's parameter groups)")
    names = [p.name for p in report.optimizers[0].params]
    assert names[0] == "transformer.wte.weight" and "transformer.h.0.ln_1.bias" in names
    trained = dict(model.named_parameters())
    live = _live(callback.monitor)
    for p in report.optimizers[0].params:
        assert tuple(p.shape) == tuple(trained[p.name].shape)  # names and shapes agree
        for m in p.moments:
            assert m.format == live[(p.unit, m.key)].format  # the embeddings stay fp32 (the Trainer's override)
        assert p.monitor["age"] == 4
    rc, out, _ = _inspect(capsys, str(folder))
    assert rc == 0 and "monitor state (trainer_state.json)" in out


def test_distributed_checkpoint_folders(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 2)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    with pytest.warns(UserWarning):  # torch: no process group, saved from a single process
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=str(tmp_path / "dcp"))
    report = build_report(str(tmp_path / "dcp"))
    assert report.kind.startswith("a distributed checkpoint folder")
    assert report.names == "the optimizer state's own keys"  # FQN-keyed, as FSDP2 saves it
    assert [p.name for p in report.optimizers[0].params] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert {m.format for p in report.optimizers[0].params for m in p.moments} == {"bf16"}

    # Lightning's ModelParallelStrategy layout: state_dict and optimizer_<i> in the folder, the rest in meta.pt
    callback = StaleStateCallback()
    _, path = _fit(tmp_path, Tiny("bnb"), callback, steps=3)
    saved = torch.load(path, weights_only=True)
    folder = tmp_path / "lightning-dcp"
    with pytest.warns(UserWarning):
        dcp.save({"state_dict": saved.pop("state_dict"), "optimizer_0": saved.pop("optimizer_states")[0]},
                 checkpoint_id=str(folder))
    torch.save(saved, folder / "meta.pt")
    rc, out, err = _inspect(capsys, str(folder))
    assert rc == 0 and not err and "a Lightning distributed checkpoint folder, global step 3" in out, err
    assert "net.0.weight" in out and "monitor state (StaleStateCallback" in out


def test_torchao_states_load_without_unrelated_warnings(tmp_path):
    """torchao's subclasses need torchao imported to load: the CLI imports it quietly (a subprocess, so that the
    import really happens there)."""
    ao = pytest.importorskip("torchao.optim")
    from lightning_stale.adapters import adapter_for

    params = [nn.Parameter(torch.randn(64, 128)), nn.Parameter(torch.randn(8))]
    optimizer = ao.AdamW4bit(params)
    g = torch.Generator().manual_seed(0)
    for p in params:  # the state a first step creates, filled with codes and scales (no compiled step needed)
        state = optimizer.state[p]
        state["step"] = torch.tensor(3.0)
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            state[key] = buffer = optimizer._new_buffer(p, signed)
            if hasattr(buffer, "codes"):
                buffer.codes.copy_(torch.randint(0, 256, buffer.codes.shape, generator=g, dtype=torch.uint8))
                buffer.scale.copy_(torch.rand(buffer.scale.shape, generator=g))
            else:
                buffer.copy_(torch.rand(buffer.shape, generator=g))
    torch.save(optimizer.state_dict(), tmp_path / "ao.pt")
    done = subprocess.run([*CLI, "inspect", str(tmp_path / "ao.pt"), "--json"], check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == ""
    saved = json.loads(done.stdout)["optimizers"][0]
    live = adapter_for(optimizer).slots()
    assert saved["family"] == "torchao"
    assert [m["format"] for p in saved["params"] for m in p["moments"]] == [s.format for s in live]
    assert [m["zero"] for p in saved["params"] for m in p["moments"]] == \
        [s.zero_mask().float().mean().item() for s in live]


@pytest.mark.parametrize("make, expected, found", [
    (lambda d: (d / "notes.txt").write_text("hello, not a checkpoint\n"), "a checkpoint written by torch.save",
     "a text file"),
    (lambda d: (d / "empty").mkdir(), "a checkpoint folder", "an empty folder"),
    (lambda d: ((d / "hf").mkdir(), (d / "hf" / "config.json").write_text("{}")), "a checkpoint folder",
     "a Hugging Face model folder without optimizer.pt"),
    (lambda d: torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {"w": torch.ones(2)}},
                          d / "weights.ckpt"), "a checkpoint with optimizer state",
     "a Lightning checkpoint without 'optimizer_states'"),
    (lambda d: torch.save({"state": {0: {"foo": torch.ones(2), "bar": torch.ones(2)}},
                           "param_groups": [{"params": [0]}]}, d / "odd.pt"),
     "an optimizer state of a known family", "keys ['bar', 'foo']"),
    (lambda d: torch.save({"model": {"w": torch.ones(2)}, "epoch": 3}, d / "model.pt"), "an optimizer state_dict",
     "a dict with keys ['model', 'epoch'] and no optimizer state in it"),
    (lambda d: torch.save({"saved": datetime.date(2026, 1, 1)}, d / "dated.pt"),
     "a checkpoint that torch.load reads with weights_only=True", "a pickle that needs datetime.date"),
    (lambda d: None, "a checkpoint file or folder", "nothing at"),
])
def test_bad_inputs_get_one_line_naming_what_was_expected(tmp_path, capsys, make, expected, found):
    make(tmp_path)
    target = next((p for p in tmp_path.iterdir()), tmp_path / "missing.ckpt")
    rc, out, err = _inspect(capsys, str(target))
    assert rc == 2 and not out
    assert err.count("\n") == 1 and err.startswith("lightning-stale inspect: error: ")
    assert expected in err and ", found " in err and found in err


def test_an_error_prints_nothing_else(tmp_path):
    """A text file: the one line, no warning of an unrelated import before it."""
    (tmp_path / "notes.txt").write_text("101 reasons\n")
    done = subprocess.run([*CLI, "inspect", str(tmp_path / "notes.txt")], check=False, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    expected = ("lightning-stale inspect: error: a checkpoint written by torch.save, found a text file (it starts "
                f"with '101 reasons\\n'): '{tmp_path / 'notes.txt'}'")
    assert done.stderr.splitlines() == [expected]


# -- what a newcomer reads: the optimizer's class, the weights' stall, the remedy per row, a legend -------------------

def _bf16_run(optimizer: str = "AdamW", remedy: str | None = "auto", steps: int = 12):
    """A bf16-true model with a LayerNorm (gains at 1.0: half their grid gap, 0.004, is above lr, so the automatic
    remedy takes them over at fit start and nothing else); returns model, optimizer and monitor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 4)).to(torch.bfloat16)
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-3, weight_decay=0.01)
    monitor = StaleStateMonitor(opt, remedy=remedy, names=model, coverage_steps=50)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 32, generator=g, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
    return model, opt, monitor


def _expected_weight_stall(weight: torch.Tensor, state: dict, group: dict, decoupled: bool) -> float:
    """The share of elements (with m != 0) whose next AdamW update is under half the bf16 grid gap, counted here
    from the saved tensors without the package."""
    (b1, b2), lr, eps, step = group["betas"], group["lr"], group["eps"], float(state["step"])
    m, v, w = state["exp_avg"].float(), state["exp_avg_sq"].float(), weight.float()
    update = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    if decoupled:
        update = update + group["weight_decay"] * w
    exponent = torch.floor(torch.log2(w.abs().clamp(min=2.0**-126)))
    gap = 2.0 ** (exponent - 7)  # bf16: 7 stored mantissa bits; subnormals share the smallest exponent's gap
    keep = m != 0
    return float(((update.abs() * lr < gap / 2) & keep).sum() / keep.sum())


def test_a_bf16_true_checkpoint_shows_the_weights_stall_the_remedy_per_row_and_the_optimizer(tmp_path, capsys):
    model, opt, monitor = _bf16_run()
    path = tmp_path / "run.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "stale": monitor.state_dict()}, path)
    report = build_report(str(path))
    saved = report.optimizers[0]
    assert saved.name == saved_name("AdamW") and saved.lrs == [1e-3]
    writeback = monitor._pipelines[0].writeback
    named = dict(model.named_parameters())
    state, group = opt.state_dict()["state"], opt.param_groups[0]
    for p in saved.params:
        taken = writeback.takes_over(named[p.name])
        assert p.remedy == ("write-back (compensated, stochastic moments)" if taken else "none"), (p.name, p.remedy)
        assert p.weight.format == "bf16" and p.weight.elements == named[p.name].numel()
        expected = _expected_weight_stall(named[p.name].detach(), state[p.index], group, decoupled=True)
        assert p.weight.stall == pytest.approx(expected, abs=1e-12), p.name
    assert {p.name for p in saved.params if p.remedy != "none"} == {"1.weight"}  # the LayerNorm gain, at 1.0
    rc, out, _ = _inspect(capsys, str(path))
    assert rc == 0
    assert f"optimizer 0: {saved_name('AdamW')}, 6 parameters (6 with state), state step 12, betas (0.9, 0.999), " \
           "lr 0.001" in out
    assert "weight write-back: compensation buffers for 6 parameter(s), 1 of them taken over" in out
    assert f"bf16 weights: 6 parameter(s) ({sum(p.numel() for p in model.parameters()):,} elements); at the saved " \
           "lr 0.001, " in out
    assert "w stall" in out and "write-back (compensated, stochastic moments)" in out
    legend = out[out.index("what the columns mean:"):]
    for term in ("rho-hat", "K*", "lone zero", "w stall", "remedy", "live rho"):
        assert f"\n  {term}" in legend, term
    assert "tolerance s0 = 0.6" in " ".join(legend.split())

    # without the monitor's state the buffers tell it: a residual means the write-back wrote the weights
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "bare.pt")
    rows = {p.name: p.remedy for p in build_report(str(tmp_path / "bare.pt")).optimizers[0].params}
    assert rows == {name: "write-back (compensated)" if name == "1.weight" else "none" for name in named}


def test_the_optimizer_class_is_read_from_the_saved_param_groups(tmp_path):
    model, opt, _ = _bf16_run("Adam", remedy=None, steps=2)
    torch.save(opt.state_dict(), tmp_path / "adam.pt")
    report = build_report(str(tmp_path / "adam.pt"))
    assert report.optimizers[0].name == saved_name("Adam")
    assert all(p.remedy is None and p.weight is None for p in report.optimizers[0].params)  # nothing to tell
    assert "the checkpoint holds no model weights" in report.notes[-1]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model[0](torch.randn(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    sgd.step()
    torch.save(sgd.state_dict(), tmp_path / "sgd.pt")
    assert build_report(str(tmp_path / "sgd.pt")).optimizers[0].name == "SGD (torch.optim)"


def _litgpt_run(out: Path, steps: int = 4):
    """A LitGPT model trained as ``litgpt pretrain`` does (Fabric, bf16-true, torch AdamW from the bare name
    ``AdamW``), with the automatic remedy; saved as it saves: ``fabric.save(<dir>/lit_model.pth, state)`` beside
    ``hyperparameters.yaml``. Returns the Fabric, the state and the callback."""
    litgpt = pytest.importorskip("litgpt")
    from lightning_stale.fabric import StaleStateFabricCallback

    torch.manual_seed(0)
    config = litgpt.Config(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=1, n_head=2, n_embd=32,
                           rotary_percentage=1.0, bias=False)
    callback = StaleStateFabricCallback(log_every_n_steps=0, remedy="auto")
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true", callbacks=[callback])
    with fabric.init_module():
        model = litgpt.GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 17), generator=g)
        logits = model(tokens[:, :-1])
        fabric.backward(nn.functional.cross_entropy(logits.float().reshape(-1, 64), tokens[:, 1:].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    return fabric, {"model": model, "optimizer": optimizer, "iter_num": steps, "step_count": steps}, callback


def test_litgpt_folders_are_read_or_named(tmp_path, capsys):
    fabric, state, callback = _litgpt_run(tmp_path)
    out = tmp_path / "out"
    # pretraining: final/ and every step-*/ hold model, optimizer and counters
    fabric.save(out / "final" / "lit_model.pth", state)
    (out / "final" / "hyperparameters.yaml").write_text("optimizer: AdamW\nprecision: bf16-true\n")
    report = build_report(str(out / "final"))  # the folder, as LitGPT's docs name it
    assert report.kind == "LitGPT's lit_model.pth (optimizer state under 'optimizer')" and report.step == 4
    saved = report.optimizers[0]
    assert saved.name == saved_name("AdamW", yaml=True)
    assert report.names == "the model state_dict under 'model', matched by order and shape"
    names = [p.name for p in saved.params]
    assert names[0] == "lm_head.weight" or "transformer.wte.weight" in names
    writeback = callback.monitors[next(iter(callback.monitors))]._pipelines[0].writeback
    trained = dict(state["model"].module.named_parameters())
    for p in saved.params:
        assert p.weight is not None and p.weight.format == "bf16" and p.weight.stall is not None
        taken = writeback.takes_over(trained[p.name])
        assert p.remedy == ("write-back (compensated)" if taken else "none"), (p.name, p.remedy)
    assert any(p.remedy != "none" for p in saved.params)  # the RMSNorm gains at 1.0 stall at lr 1e-3
    rc, printed, err = _inspect(capsys, str(out / "final"))
    assert rc == 0 and not err and f"optimizer 0: {saved_name('AdamW', yaml=True)}" in printed

    # finetuning: final/ holds the model alone, step-*/ everything: the error names where the optimizer is
    fabric.save(out / "step-000004" / "lit_model.pth", state)
    fabric.save(out / "final" / "lit_model.pth", {"model": state["model"]})
    rc, printed, err = _inspect(capsys, str(out / "final"))
    assert rc == 2 and not printed
    assert "LitGPT model weights only in" in err and str(out / "step-000004" / "lit_model.pth") in err
    # the out_dir itself: the folders holding a lit_model.pth are named
    rc, printed, err = _inspect(capsys, str(out))
    assert rc == 2 and "final/lit_model.pth" in err and "step-000004/lit_model.pth" in err


def test_a_folder_holding_one_checkpoint_file_is_read_and_several_are_named(tmp_path, capsys):
    _, path = _fit(tmp_path, Tiny("bnb"), StaleStateCallback(), steps=3)
    assert build_report(str(tmp_path)).kind == "a Lightning checkpoint"  # the folder holding last.ckpt
    torch.save(torch.load(path, weights_only=True), tmp_path / "epoch=0.ckpt")
    rc, out, err = _inspect(capsys, str(tmp_path))
    assert rc == 2 and "a folder holding 2: epoch=0.ckpt, last.ckpt (pass one of them)" in err


def test_a_hugging_face_bf16_checkpoint_with_the_automatic_remedy(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from lightning_stale.hf import add_stale_callback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64,
                                                                 n_positions=16)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8,
                                          logging_steps=2, report_to=[], use_cpu=True, save_strategy="steps",
                                          save_steps=4, disable_tqdm=True, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    callback = add_stale_callback(trainer, remedy="auto")
    trainer.train()
    report = build_report(str(tmp_path / "checkpoint-4"))
    saved = report.optimizers[0]
    assert saved.name == saved_name("AdamW")
    writeback = callback.monitor._pipelines[0].writeback
    trained = dict(model.named_parameters())
    for p in saved.params:
        taken = writeback.takes_over(trained[p.name])
        assert p.remedy.startswith("write-back (compensated, stochastic moments)") == taken, (p.name, p.remedy)
        assert p.weight is not None and p.weight.stall is not None  # the weights from model.safetensors
    assert any(p.remedy.startswith("write-back") for p in saved.params)  # the LayerNorm gains
    rc, out, _ = _inspect(capsys, str(tmp_path / "checkpoint-4"))
    assert rc == 0 and "bf16 weights: " in out and "w stall" in out
