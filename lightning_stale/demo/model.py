"""A small LLaMA-style byte-level language model as a LightningModule, with its optimizer chosen by a config.

The architecture follows LLaMA in miniature: pre-norm RMSNorm, rotary position embeddings, causal self-attention and
a SwiGLU feed-forward block, no biases. The vocabulary is the 256 byte values, so no tokenizer is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_stale.vocab import check_choice, check_int, check_rounding

OPTIMIZER_KINDS = ("adamw", "adamw_master", "adamw_master_srw", "adamw_master_srs", "bnb_adamw8bit", "quantized",
                   "optimi_kahan", "torchao_bf16_sr")
MASTER_STORAGES = {"adamw_master": {}, "adamw_master_srw": {"weights": "stochastic"},  # MasterWeightAdamW's options
                   "adamw_master_srs": {"moments": "stochastic"}}
STATE_FORMATS = ("fp8_e4m3", "fp4", "bf16", "int8_dynamic", "fp32")


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of the decoder. ``hidden`` is the SwiGLU width (LLaMA uses about 8/3 of ``dim``)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    hidden: int = 352
    context: int = 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "hidden", "context"):
            check_int(name, getattr(self, name))
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"dim ({self.dim}) / n_heads ({self.n_heads}) must be an even integer for rotary positions"
            )


@dataclass(frozen=True)
class OptimizerSpec:
    """Which AdamW to build: torch (``adamw``), torch's math on fp32 master weights and states (``adamw_master``, the
    bf16-compute control of :mod:`~lightning_stale.demo.master`; ``_srw``: weights, ``_srs``: states stored in bf16
    with stochastic rounding instead), bitsandbytes ``AdamW8bit``, ``QuantizedAdamW``, or the weight write-back's
    peers: torch-optimi's ``AdamW(kahan_sum=True)`` and torchao's ``AdamW(bf16_stochastic_round=True)``.

    ``state_format`` and ``rounding`` apply to ``quantized`` only; ``state_format`` is one name for both moments or
    ``"<m format>/<v format>"`` (e.g. ``"fp32/fp4"``: fp4 second moment only). ``min_quantized_size`` is the smallest
    tensor whose states are stored in low precision (bitsandbytes' ``min_8bit_size``); it is low by default so that a
    small model has nearly all of its states quantized.
    """

    kind: str = "adamw"
    state_format: str = "fp32"
    rounding: str = "nearest"
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    min_quantized_size: int = 128

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, OPTIMIZER_KINDS)
        for name in self.state_format.split("/", 1):
            check_choice("state_format", name, STATE_FORMATS)
        check_rounding(self.rounding)
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """Instantiate the optimizer over ``params``."""
        common = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        if self.kind == "adamw":
            return torch.optim.AdamW(params, **common)
        if self.kind in MASTER_STORAGES:
            from lightning_stale.demo.master import MasterWeightAdamW

            return MasterWeightAdamW(params, **MASTER_STORAGES[self.kind], **common)
        if self.kind == "bnb_adamw8bit":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, min_8bit_size=self.min_quantized_size, **common)
        if self.kind == "optimi_kahan":  # the peers of the weight write-back (optional packages)
            import optimi

            return optimi.AdamW(params, kahan_sum=True, **common)
        if self.kind == "torchao_bf16_sr":
            import torchao.optim

            adamw = getattr(torchao.optim, "AdamW", None) or torchao.optim._AdamW  # 0.18 keeps it private
            return adamw(params, bf16_stochastic_round=True, **common)
        from lightning_stale.optim import QuantizedAdamW

        m_format, _, v_format = self.state_format.partition("/")
        return QuantizedAdamW(
            params,
            state_format={"m": m_format, "v": v_format or m_format},
            rounding=self.rounding,
            min_quantized_size=self.min_quantized_size,
            **common,
        )


class RMSNorm(nn.Module):
    """Scale by the reciprocal root-mean-square of the features, then by a learned gain (no centring, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(context: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of shape (context, head_dim) for rotary position embeddings."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs (i, i + head_dim/2) of ``x`` (batch, heads, time, head_dim) by position-dependent angles."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions on queries and keys."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, time, dim = x.shape
        q, k, v = self.qkv(x).view(batch, time, 3, self.n_heads, dim // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, time, dim))


class SwiGLU(nn.Module):
    """Feed-forward block ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-norm transformer layer: x + attention(norm(x)), then x + swiglu(norm(x))."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.dim)
        self.ffn = SwiGLU(config.dim, config.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    """Token embedding, ``n_layers`` blocks, final RMSNorm and an (untied) output projection to byte logits."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.context, config.dim // config.n_heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks:  # scale residual outputs down with depth, as GPT-2/LLaMA training recipes do
            for proj in (block.attn.out, block.ffn.down):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.n_layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, time, vocab) for ``tokens`` of shape (batch, time), time <= context."""
        time = tokens.shape[1]
        if time > self.config.context:
            raise ValueError(f"sequence length {time} exceeds the model context {self.config.context}")
        cos, sin = self.cos[:time], self.sin[:time]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def warmup_cosine(step: int, total_steps: int, warmup_fraction: float, min_ratio: float) -> float:
    """LR multiplier: linear warm-up over ``warmup_fraction`` of the run, then cosine decay to ``min_ratio``."""
    warmup = max(1, int(total_steps * warmup_fraction))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LanguageModel(pl.LightningModule):
    """Next-byte prediction with :class:`Decoder`; logs ``train/loss`` every step and ``val/loss`` per validation.

    The learning rate follows the paper's protocol: linear warm-up over the first 10% of ``total_steps``, then cosine
    decay to 10% of the peak.
    """

    def __init__(
        self,
        config: DecoderConfig | None = None,
        optimizer: OptimizerSpec | None = None,
        total_steps: int = 1000,
        warmup_fraction: float = 0.1,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        check_int("total_steps", total_steps)
        self.config = config or DecoderConfig()
        self.optimizer_spec = optimizer or OptimizerSpec()
        self.total_steps, self.warmup_fraction, self.min_lr_ratio = total_steps, warmup_fraction, min_lr_ratio
        self.model = Decoder(self.config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-byte cross-entropy of one (inputs, targets) batch."""
        inputs, targets = batch
        logits = self.model(inputs).float()  # bf16-true runs: the loss in fp32
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), prog_bar=True)

    def configure_optimizers(self):  # noqa: ANN201 (Lightning's optimizer/scheduler dict)
        optimizer = self.optimizer_spec.build(list(self.parameters()))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, self.total_steps, self.warmup_fraction, self.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
