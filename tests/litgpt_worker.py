"""LitGPT's own pre-training entry point (``litgpt.pretrain.setup``: Fabric, its own loop, logger and optimizer
instantiation) on a tiny GPT config and random tokens, with bitsandbytes AdamW8bit. Run in a subprocess by
``tests/test_litgpt.py`` with ``LIGHTNING_STALE=1``: nothing here mentions lightning_stale. The optimizer class keeps
an independent count of unchanged second-moment codes, written to ``OUT_DIR/probe.json``.

    python tests/litgpt_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import bitsandbytes as bnb
import torch
from litgpt import pretrain
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import DataModule
from torch.utils.data import DataLoader

VOCAB, BLOCK = 128, 32
PROBE: list[tuple[int, int]] = []  # per optimizer step: (unchanged v codes, elements with a finite non-zero gradient)


class ProbedAdamW8bit(bnb.optim.AdamW8bit):
    """bitsandbytes AdamW8bit with an independent count of unchanged v codes (LitGPT builds it from its class path)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_step_pre_hook(self._pre)
        self.register_step_post_hook(self._post)

    def _pre(self, opt, args, kwargs) -> None:
        self._before = {p: s["state2"].clone() for p, s in self.state.items() if s}

    def _post(self, opt, args, kwargs) -> None:
        masks = {p: (p.grad != 0) & torch.isfinite(p.grad) for p in self._before}
        PROBE.append((sum(int(((self.state[p]["state2"] == old) & masks[p]).sum()) for p, old in self._before.items()),
                      sum(int(m.sum()) for m in masks.values())))


class RandomTokens(DataModule):
    """Fixed random token sequences; no tokenizer, no download."""

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int = -1) -> None:
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(list(torch.randint(0, VOCAB, (4096, BLOCK + 1), generator=g)), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        return DataLoader(list(torch.randint(0, VOCAB, (16, BLOCK + 1), generator=g)), batch_size=self.batch_size)


def main(out: Path) -> None:
    config = Config(name="tiny", block_size=BLOCK, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=2,
                    n_embd=64, rotary_percentage=1.0, bias=False)
    pretrain.setup(
        model_name="tiny", model_config=config, out_dir=out, precision="32-true", data=RandomTokens(),
        train=TrainArgs(save_interval=10_000, log_interval=1, global_batch_size=4, micro_batch_size=4,
                        lr_warmup_steps=2, max_tokens=4 * BLOCK * 40, max_seq_length=BLOCK, max_norm=1.0,
                        min_lr=1e-4),
        eval=EvalArgs(interval=10_000, max_iters=1, final_validation=False),
        optimizer={"class_path": "__main__.ProbedAdamW8bit", "init_args": {"lr": 1e-3, "min_8bit_size": 256}},
        devices=1, logger_name="csv", seed=0,
    )
    (out / "probe.json").write_text(json.dumps(PROBE))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
