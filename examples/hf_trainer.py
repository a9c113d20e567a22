"""Hugging Face Trainer with ``optim="adamw_bnb_8bit"``: the stale-state row joins every training log row.

Run: ``python examples/hf_trainer.py`` (needs ``pip install lightning-stale[hf]``; no download).
"""

from __future__ import annotations

import tempfile

import torch
import transformers

from lightning_stale.hf import add_stale_callback


def main(steps: int = 40) -> list[dict[str, float]]:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128,
                                                                 n_positions=32))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (256, 32), generator=g)]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8,
                                              logging_steps=10, optim="adamw_bnb_8bit", report_to=[], use_cpu=True,
                                              save_strategy="no", disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        add_stale_callback(trainer, reset="theory")  # first among the callbacks: the reporters see its metrics
        trainer.train()
    return [row for row in trainer.state.log_history if "stale/v/frac" in row]


if __name__ == "__main__":
    for row in main():
        print({k: round(v, 4) for k, v in row.items() if k.startswith("stale/") or k in ("loss", "step")})
