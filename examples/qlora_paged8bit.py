"""QLoRA-style fine-tuning: LoRA adapters (peft) on a GPT-2 with PagedAdamW8bit and theory resets. LoRA's A factors
get zero gradients until B moves; the monitor waits for their first non-zero state instead of failing.

Run: ``python examples/qlora_paged8bit.py`` (needs ``pip install lightning-stale[hf] peft``; no download).
"""

from __future__ import annotations

import bitsandbytes as bnb
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_stale import StaleStateCallback


class LoRAFineTune(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import peft
        import transformers

        torch.manual_seed(0)
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128,
                                                                   n_positions=32))
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
        self.model = peft.get_peft_model(base, lora)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 128, (256, 32), generator=g)), batch_size=8)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        return bnb.optim.PagedAdamW8bit(trainable, lr=2e-4, min_8bit_size=256)


def main(steps: int = 60) -> dict[str, float]:
    trainer = L.Trainer(max_steps=steps, log_every_n_steps=10, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[StaleStateCallback(reset="theory", log_per_param=False)])
    trainer.fit(LoRAFineTune())
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("stale/")}


if __name__ == "__main__":
    print(main())
