"""Offline byte-level corpus for the demo: a pinned, shipped text (the same bytes on every machine), or any text the
user points at.

Every configuration of a demo run sees exactly the same batches in the same order: batch positions are drawn once
from a seeded generator, so differences between runs come from the optimizer, not from the data.
"""

from __future__ import annotations

import hashlib
import lzma
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_stale import _compat

DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_CORPUS = Path(__file__).with_name("corpus") / "cpython-3.11.7-lib.txt.xz"
# sha256 of the decompressed default corpus (CPython 3.11.7's Lib/*.py, first 4 MB; corpus/README.md)
DEFAULT_CORPUS_SHA256 = "1b4fd9d8b14a7d57d8b724082aea6af0184f02b2c734b55b17ef18281995502b"


@dataclass(frozen=True)
class CorpusIdentity:
    """What a run trained on: the source's name, the bytes' sha256 and their count (printed and stored with runs)."""

    source: str
    sha256: str
    size: int

    @classmethod
    def of(cls, corpus: bytes, source: str) -> CorpusIdentity:
        return cls(source=source, sha256=hashlib.sha256(corpus).hexdigest(), size=len(corpus))

    def __str__(self) -> str:
        return f"{self.source}: {self.size:,} bytes, sha256 {self.sha256}"


def _text_files(folder: Path) -> list[Path]:
    """Regular files under ``folder`` that look like text (no NUL byte in their first 4 KiB), sorted by path."""
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with path.open("rb") as handle:
            if b"\0" not in handle.read(4096):
                files.append(path)
    return files


def cpu_kernels() -> str:
    """torch's CPU kernel set in use (``AVX512``, ``AVX2``, ``DEFAULT``...) and the bf16 matrix units beside it
    (``AVX512 (AMX, AVX512-BF16)``): the same corpus and seed give other losses under another set (their reductions
    round differently; one bf16-true seed ended 0.015 apart on two AVX-512 hosts), so reports name it beside the
    corpus."""
    units = _compat.cpu_bf16_units()
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{capability} ({', '.join(units)})" if units else capability


def corpus_source(path: str | Path | None) -> str:
    """The name a corpus is reported under: the shipped default's file name, else the user's path."""
    return DEFAULT_CORPUS.name if path is None else str(Path(path).expanduser())


def load_corpus(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Read up to ``max_bytes`` of text: the shipped default corpus when ``path`` is None, else a text file or a
    folder of them.

    Raises FileNotFoundError for a missing path and ValueError when nothing readable is found.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if path is None:
        return lzma.decompress(DEFAULT_CORPUS.read_bytes())[:max_bytes]
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--data path does not exist: {path}")
    chunks, size = [], 0
    for file in _text_files(path) if path.is_dir() else [path]:
        data = file.read_bytes()[: max_bytes - size]
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    corpus = b"".join(chunks)
    if not corpus:
        raise ValueError(f"empty corpus: no text found in {path}")
    return corpus


class ByteWindows(Dataset):
    """Fixed windows of ``context + 1`` bytes at given offsets; item ``i`` is (input bytes, next bytes)."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, context: int) -> None:
        self.data, self.offsets, self.context = data, offsets, context

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[index])
        window = self.data[start : start + self.context + 1]
        return window[:-1], window[1:]


class ByteCorpus:
    """A corpus split into train and validation bytes, with seeded fixed-order loaders for both.

    ``val_fraction`` of the bytes at the end form the validation split, so no validation window overlaps training.
    ``identity`` names the bytes (source, sha256, size) for reports.
    """

    def __init__(self, corpus: bytes, context: int, val_fraction: float = 0.05, source: str = "text") -> None:
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.identity = CorpusIdentity.of(corpus, source)
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        split = int(len(data) * (1.0 - val_fraction))
        self.train, self.val, self.context = data[:split], data[split:], context
        for name, part in (("train", self.train), ("validation", self.val)):
            if len(part) < context + 2:
                raise ValueError(
                    f"corpus too small: the {name} split has {len(part)} bytes, needs more than context + 1 = "
                    f"{context + 1}; give --data more text or a smaller context"
                )

    def _loader(self, data: torch.Tensor, n_windows: int, batch_size: int, seed: int) -> DataLoader:
        generator = torch.Generator().manual_seed(seed)
        offsets = torch.randint(0, len(data) - self.context - 1, (n_windows,), generator=generator)
        return DataLoader(ByteWindows(data, offsets, self.context), batch_size=batch_size, shuffle=False)

    def train_loader(self, steps: int, batch_size: int, seed: int) -> DataLoader:
        """Exactly ``steps`` batches, the same for every run with this seed."""
        return self._loader(self.train, steps * batch_size, batch_size, seed)

    def val_loader(self, batches: int, batch_size: int, seed: int) -> DataLoader:
        """``batches`` fixed validation batches (drawn with a seed distinct from the training one)."""
        return self._loader(self.val, batches * batch_size, batch_size, seed + 1_000_003)
