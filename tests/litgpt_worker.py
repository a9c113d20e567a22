"""LitGPT's own pre-training entry point (``litgpt.pretrain.setup``: Fabric, its own loop, logger, checkpoints and
optimizer instantiation) on a tiny GPT config. Run in a subprocess by ``tests/test_litgpt.py`` with ``LIGHTNING_STALE``
set: nothing here mentions lightning_stale.

    python tests/litgpt_worker.py OUT_DIR probe
        random tokens, bitsandbytes AdamW8bit (32-true) whose class keeps an independent count of unchanged
        second-moment codes, written to ``OUT_DIR/probe.json``
    python tests/litgpt_worker.py OUT_DIR text DATA_DIR [CHECKPOINT]
        LitGPT's documented text pipeline: a tokenizer (``tokenizer.json``, built offline) and plain-text files in
        DATA_DIR read by ``TextFiles`` (litdata), bf16-true, LitGPT's default AdamW, a checkpoint every SAVE_EVERY steps;
        resumed from CHECKPOINT (a ``lit_model.pth``) when given
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import bitsandbytes as bnb
import torch
from litgpt import pretrain
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import DataModule, TextFiles
from torch.utils.data import DataLoader

VOCAB, BLOCK = 128, 32
TEXT_STEPS, SAVE_EVERY = 24, 10
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


def tiny(vocab: int) -> Config:
    return Config(name="tiny", block_size=BLOCK, vocab_size=vocab, padded_vocab_size=vocab, n_layer=2, n_head=2,
                  n_embd=64, rotary_percentage=1.0, bias=False)


def probe(out: Path) -> None:
    pretrain.setup(
        model_name="tiny", model_config=tiny(VOCAB), out_dir=out, precision="32-true", data=RandomTokens(),
        train=TrainArgs(save_interval=10_000, log_interval=1, global_batch_size=4, micro_batch_size=4,
                        lr_warmup_steps=2, max_tokens=4 * BLOCK * 40, max_seq_length=BLOCK, max_norm=1.0,
                        min_lr=1e-4),
        eval=EvalArgs(interval=10_000, max_iters=1, final_validation=False),
        optimizer={"class_path": "__main__.ProbedAdamW8bit", "init_args": {"lr": 1e-3, "min_8bit_size": 256}},
        devices=1, logger_name="csv", seed=0,
    )
    (out / "probe.json").write_text(json.dumps(PROBE))


def text_corpus(data: Path) -> Path:
    """A word-level tokenizer (``tokenizer.json`` and the ``tokenizer_config.json`` naming its bos/eos tokens) and
    three text files (the first is TextFiles' validation split), written once into ``data``; the tokenizer's folder."""
    tokenizer_dir, texts = data / "tokenizer", data / "texts"
    if tokenizer_dir.is_dir():
        return tokenizer_dir
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(0)
    words = [f"w{i}" for i in range(120)]
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer_dir.mkdir(parents=True)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                     "tokenizer_class": "PreTrainedTokenizerFast"}))
    texts.mkdir()
    for i in range(3):  # a Zipf-like stream: frequent words get most of the gradient, rare ones little
        stream = rng.choices(words, weights=[1 / (k + 1) for k in range(len(words))], k=6000)
        (texts / f"part{i}.txt").write_text(" ".join(stream))
    return tokenizer_dir


def text(out: Path, data: Path, checkpoint: Path | None) -> None:
    tokenizer_dir = text_corpus(data)
    pretrain.setup(
        model_name="tiny", model_config=tiny(128), out_dir=out, precision="bf16-true",
        data=TextFiles(train_data_path=data / "texts", num_workers=0), tokenizer_dir=tokenizer_dir,
        resume=checkpoint or False,
        train=TrainArgs(save_interval=SAVE_EVERY, log_interval=1, global_batch_size=4, micro_batch_size=4,
                        lr_warmup_steps=0, max_tokens=4 * BLOCK * TEXT_STEPS, max_seq_length=BLOCK, max_norm=1.0,
                        min_lr=1e-4),
        eval=EvalArgs(interval=10_000, max_iters=1, final_validation=False),
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-3, "weight_decay": 0.0}},
        devices=1, logger_name="csv", seed=0,
    )


if __name__ == "__main__":
    target, mode, rest = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "probe", sys.argv[3:]
    sys.argv[1:] = ["tiny"]  # LitGPT saves the command line's arguments of `litgpt pretrain` with each checkpoint
    if mode == "probe":
        probe(target)
    else:
        text(target, Path(rest[0]), Path(rest[1]) if len(rest) > 1 else None)
