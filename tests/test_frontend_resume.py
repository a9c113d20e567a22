"""Every front-end resumes from its own checkpoints exactly as the uninterrupted run: the Hugging Face Trainer (through
its callback-state export) and Lightning Fabric (``fabric.save``/``fabric.load`` in a new process); reset steps,
logged counters and weights equal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_stale.hf import add_stale_callback  # noqa: E402
from lightning_stale.optim import QuantizedAdamW  # noqa: E402
from lightning_stale.state import STATE_VERSION  # noqa: E402

STEPS, SAVE_EVERY = 30, 10


class Events(transformers.TrainerCallback):
    """Records the reset steps of the stale-state callback's monitor (added after it, so its monitor exists)."""

    def __init__(self, stale) -> None:
        self.stale, self.steps = stale, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.stale.monitor.add_reset_listener(lambda event: self.steps.append(event.step))


def hf_run(out: Path, kind: str, with_callback: bool = True, resume: str | None = None):
    """A tiny GPT-2 trained for STEPS steps with checkpoints every SAVE_EVERY; returns (weights, reset steps, rows)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=96,
                                                                 n_positions=16))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (256, 16), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8, logging_steps=2, report_to=[],
        use_cpu=True, save_strategy="steps", save_steps=SAVE_EVERY, disable_tqdm=True, seed=0,
        optim="adamw_bnb_8bit" if kind.startswith("bnb") else "adamw_torch", learning_rate=3e-3)
    if "bf16" in kind:  # bf16 weights and gradients (torch AdamW: bf16 states): the weight write-back's set-up
        model = model.to(torch.bfloat16)
    optimizers = (None, None)
    if kind == "fp8":
        optimizers = (QuantizedAdamW(model.parameters(), lr=3e-3, state_format="fp8_e4m3", min_quantized_size=256,
                                     compile=False), None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers)
    events = None
    if with_callback:
        options = {"bnb": {"reset": "periodic", "every": 7}, "bf16": {"weights": "stochastic", "reset": "periodic",
                                                                      "every": 7}}.get(kind, {"remedy": "auto"})
        stale = add_stale_callback(trainer, **options)
        events = Events(stale)
        trainer.add_callback(events)
    trainer.train(resume_from_checkpoint=resume)
    rows = [{k: v for k, v in row.items() if k.startswith("stale/")} for row in trainer.state.log_history
            if "stale/v/frac" in row]
    return [p.detach().clone() for p in model.parameters()], events.steps if events else None, rows


@pytest.mark.parametrize("kind", ["bnb", "fp8", "bf16", "bnbbf16", "bf16auto"])
def test_hugging_face_resume_continues_the_callback_exactly(tmp_path, kind):
    """bf16: ``weights="stochastic"`` (no state); bnbbf16 and bf16auto: ``remedy="auto"`` over bf16 weights on
    bitsandbytes and torch AdamW, with compensated summation: the buffers travel in Hugging Face's ``optimizer.pt``,
    the rest of the write-back in ``trainer_state.json``, and the run resumes exactly."""
    weights, resets, rows = hf_run(tmp_path / "full", kind)
    assert resets or rows[-1].get("stale/remedy/guard", 0) > 0 or rows[-1].get("stale/remedy/weights", 0) > 0
    saved = json.loads((tmp_path / "full" / "checkpoint-20" / "trainer_state.json").read_text())
    saved_state = saved["stateful_callbacks"]["StaleStateHFCallback"]["attributes"]["saved_state"]
    assert saved_state["version"] == STATE_VERSION
    if "bf16" in kind:
        compensated = kind != "bf16"
        assert saved_state["optimizers"][0]["weights"]["rounding"] == ("compensated" if compensated else "stochastic")
        optimizer = torch.load(tmp_path / "full" / "checkpoint-20" / "optimizer.pt", weights_only=True)
        buffers = [entry for entry in optimizer["state"].values() if "lightning_stale.compensation" in entry]
        assert len(buffers) == (len(optimizer["state"]) if compensated else 0)
    plain_weights, _, _ = hf_run(tmp_path / "plain", kind, with_callback=False)
    for at in (10, 20):
        checkpoint = str(tmp_path / "full" / f"checkpoint-{at}")
        resumed_weights, resumed_resets, resumed_rows = hf_run(tmp_path / f"resumed{at}", kind, resume=checkpoint)
        assert resumed_resets == [s for s in resets if s > at], at  # ResetEvent.step counts the optimizer's steps
        assert resumed_rows == rows[len(rows) - len(resumed_rows):], at  # every logged number, counters included
        for ours, theirs in zip(resumed_weights, weights):
            assert torch.equal(ours, theirs), at
        plain_resumed, _, _ = hf_run(tmp_path / f"plain{at}", kind, with_callback=False,
                                     resume=str(tmp_path / "plain" / f"checkpoint-{at}"))
        assert all(torch.equal(a, b) for a, b in zip(plain_resumed, plain_weights))  # HF's own resume is exact


@pytest.mark.slow  # two Fabric runs in subprocesses: about 40 s on a loaded 2-core machine
@pytest.mark.parametrize("kind", ["bnb", "bf16", "bf16auto"])
def test_fabric_resume_in_a_new_process_equals_the_uninterrupted_run(tmp_path, kind):
    """bnb: 8-bit states with periodic resets; bf16: a bf16-true model whose weights the compensated write-back
    writes (its buffers travel in ``fabric.save``; without them the resumed weights differ); bf16auto: the same model
    under ``remedy="auto"``, which takes the weights over with compensated summation (choices and buffers resume)."""
    worker = Path(__file__).with_name("fabric_resume_worker.py")
    for part in ("full", "resumed"):
        subprocess.run([sys.executable, str(worker), str(tmp_path), part, kind], check=True, timeout=300)
    full = json.loads((tmp_path / "full.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    if kind.startswith("bf16"):  # every bf16 element taken over: 2 bytes each
        assert full["rows"][-1]["stale/remedy/weights"] > 0 and full["compensation_bytes"] == 2 * (32 * 256 + 256 +
                                                                                                   256 * 8 + 8)
    periodic = kind != "bf16auto"
    assert full["resets"] == ([10, 20, 30, 40] if periodic else [])
    assert resumed["resets"] == ([40] if periodic else [])  # the optimizer's step count, not the loop's first step
    assert resumed["rows"] == [row for row in full["rows"] if row["step"] > 30]  # stale/resets included
    for ours, theirs in zip(torch.load(tmp_path / "resumed_weights.pt"), torch.load(tmp_path / "full_weights.pt")):
        assert torch.equal(ours, theirs)
