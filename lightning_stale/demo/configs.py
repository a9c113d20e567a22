"""The demo's configuration catalogue (an optimizer's state format and rounding plus a remedy) and its settings.

What the command line and the benchmarks choose from; training and the report only read it.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_stale.demo.data import DEFAULT_MAX_BYTES
from lightning_stale.demo.model import DecoderConfig, OptimizerSpec
from lightning_stale.vocab import check_int

FP32_CONTROL_PERIOD = 300  # the paper's fp8 reset period


@dataclass(frozen=True)
class RunConfig:
    """One demo configuration: how the optimizer stores its states and what remedy the callback applies.

    ``reset``, ``every``, ``moments``, ``underflow_guard``, ``remedy`` and ``weights`` are passed to
    :class:`~lightning_stale.StaleStateCallback`; ``baseline`` names the configuration without a remedy (nearest
    rounding) that a variant is compared with; ``precision`` is the Trainer's (``"bf16-true"``: bf16 parameters, so
    torch AdamW keeps bf16 states; ``"bf16-mixed"``: bf16 compute over fp32 parameters and states).
    """

    name: str
    kind: str
    state_format: str = "fp32"
    rounding: str = "nearest"
    reset: str | None = None
    every: int | None = None
    baseline: str | None = None
    description: str = ""
    underflow_guard: bool = False
    remedy: str | None = None
    moments: tuple[str, ...] | None = None
    precision: str = "32-true"
    weights: str | None = None

    def optimizer_spec(self, settings: DemoSettings) -> OptimizerSpec:
        """The optimizer this configuration trains with, at the settings' hyper-parameters."""
        return OptimizerSpec(
            kind=self.kind,
            state_format=self.state_format,
            rounding=self.rounding,
            lr=settings.lr,
            betas=(0.9, settings.beta2),
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            min_quantized_size=settings.min_quantized_size,
        )


STORAGES = {  # name: (optimizer kind, state format, Trainer precision, words)
    "fp32": ("adamw", "fp32", "32-true", "torch AdamW, fp32 states"),
    "bnb8bit": ("bnb_adamw8bit", "fp32", "32-true", "bitsandbytes AdamW8bit (block-wise 8-bit states)"),
    "bf16": ("quantized", "bf16", "32-true", "QuantizedAdamW, bf16 states"),
    "fp8": ("quantized", "fp8_e4m3", "32-true", "QuantizedAdamW, fp8 E4M3 states (per-tensor scale)"),
    "fp4": ("quantized", "fp4", "32-true", "QuantizedAdamW, fp4 states (block 128)"),
    "int8": ("quantized", "int8_dynamic", "32-true", "QuantizedAdamW, int8 dynamic-map states"),
    "torchbf16": ("adamw", "fp32", "bf16-true", "torch AdamW on bf16 parameters (bf16 states, bf16-true)"),
    "bnb8bitbf16": ("bnb_adamw8bit", "fp32", "bf16-true",
                    "bitsandbytes AdamW8bit on bf16 parameters (8-bit states, bf16 weights, bf16-true)"),
    "torchmixed": ("adamw", "fp32", "bf16-mixed", "torch AdamW under bf16-mixed (bf16 compute; fp32 weights, states)"),
    "torchmaster": ("adamw_master", "fp32", "bf16-true",
                    "torch AdamW on fp32 master weights of a bf16-true model (bf16 compute; fp32 weights, states)"),
    "torchsrw": ("adamw_master_srw", "fp32", "bf16-true",
                 "torch AdamW's math in fp32 on a bf16-true model, bf16 weights rounded stochastically, fp32 states"),
    "torchsrs": ("adamw_master_srs", "fp32", "bf16-true",
                 "torch AdamW's math in fp32 on fp32 master weights of a bf16-true model, bf16 states rounded "
                 "stochastically"),
    "optimikahan": ("optimi_kahan", "fp32", "bf16-true",
                    "torch-optimi AdamW(kahan_sum=True) on a bf16-true model (bf16 states to nearest, Kahan weights)"),
    "aobf16sr": ("torchao_bf16_sr", "fp32", "bf16-true",
                 "torchao AdamW(bf16_stochastic_round=True) on a bf16-true model (fp32 math, bf16 weights and states "
                 "rounded stochastically)"),
}
# storages without remedies, one configuration each: fp32, the controls of what bf16's parts cost, and the weight
# write-back's peers
REFERENCES = ("fp32", "torchmaster", "torchsrw", "torchsrs", "optimikahan", "aobf16sr")
LOW_PRECISION_WEIGHTS = ("bf16-true",)  # the Trainer precisions whose weights a weight write-back can take over
REMEDY_SUFFIXES = {  # name suffix: (StaleStateCallback arguments, words)
    "": ({}, ""),
    "+reset": ({"reset": "theory"}, ", theory-period resets"),
    "+vreset": ({"reset": "theory", "moments": ("v",)}, ", theory-period resets of v only"),
    "+adaptive": ({"reset": "adaptive"}, ", adaptive resets"),
    "+periodic": ({"reset": "periodic", "every": FP32_CONTROL_PERIOD}, f", resets every {FP32_CONTROL_PERIOD} steps"),
    "+drift": ({"reset": "drift"}, ", drift-band resets"),
    "+guard": ({"underflow_guard": True}, ", underflow guard"),
    "+auto": ({"remedy": "auto"}, ", automatic remedy"),
}
WEIGHT_SUFFIXES = {  # name suffix: (StaleStateCallback arguments, words), for storages with bf16 weights only
    "+wsr": ({"weights": "stochastic"}, ", weight write-back with stochastic rounding"),
    "+wkahan": ({"weights": "compensated"}, ", weight write-back with compensated summation"),
}
MOMENT_SUFFIXES = {  # likewise, where the moments are torch.optim's (bf16 with bf16 weights)
    "+wsrm": ({"weights": "stochastic+moments"}, ", weight write-back with stochastic rounding of weights and moments"),
    "+wkahanm": ({"weights": "compensated+moments"},
                 ", weight write-back with compensated summation of weights, stochastic rounding of moments"),
}


def _build_configs() -> dict[str, RunConfig]:
    """Name every (storage, rounding, remedy) combination: ``<storage>[-sr][<remedy suffix>]``."""
    configs = {}
    for storage, (kind, state_format, precision, words) in STORAGES.items():
        if storage in REFERENCES:
            configs[storage] = RunConfig(storage, kind, precision=precision, description=words)
            continue
        roundings = ["nearest"] if kind != "quantized" else ["nearest", "stochastic"]
        low = precision in LOW_PRECISION_WEIGHTS
        suffixes = {**REMEDY_SUFFIXES, **(WEIGHT_SUFFIXES if low else {}),
                    **(MOMENT_SUFFIXES if low and kind == "adamw" else {})}
        for rounding in roundings:
            for suffix, (arguments, remedy_words) in suffixes.items():
                name = storage + ("-sr" if rounding == "stochastic" else "") + suffix
                text = words + (", stochastic rounding" if rounding == "stochastic" else "") + remedy_words
                baseline = None if name == storage else storage
                configs[name] = RunConfig(name, kind, state_format, rounding, baseline=baseline, description=text,
                                          precision=precision, **arguments)
    # fp32 states never stall, so the theory gives them no period: the control resets at the fp8 period instead,
    # as the paper's fp32 control used the bf16 period.
    configs["fp32+reset"] = RunConfig(
        "fp32+reset", "adamw", reset="periodic", every=FP32_CONTROL_PERIOD, baseline="fp32",
        description=f"torch AdamW, fp32 states, periodic resets every {FP32_CONTROL_PERIOD} steps (control)",
    )
    return configs


CONFIGS: dict[str, RunConfig] = _build_configs()
# What `lightning-stale demo` runs: torch AdamW on a bf16-true model against fp32, as is and with remedy="auto" (the
# largest gap measured at this scale, and the same sign and size on every seed and CPU kernel set; BENCHMARKS.md)
DEFAULT_CONFIGS = ("fp32", "torchbf16", "torchbf16+auto")
DEMO_MODEL = DecoderConfig(dim=64, n_layers=2, n_heads=4, hidden=176, context=64)  # 0.13M parameters, 17 tensors


def resolve_configs(names: str | Sequence[str]) -> list[RunConfig]:
    """Look up configurations by name (a comma-separated string or a list); unknown names raise ValueError."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError("configs must name at least one configuration")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        close = list(dict.fromkeys(c for n in unknown for c in difflib.get_close_matches(n, CONFIGS, n=3)))
        raise ValueError(f"unknown configs {unknown}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                         + "; names are STORAGE[-sr][+REMEDY], listed by `lightning-stale demo --help`")
    return [CONFIGS[n] for n in dict.fromkeys(names)]


@dataclass(frozen=True)
class DemoSettings:
    """Everything shared by the runs of one comparison (model, data, schedule, logging)."""

    steps: int = 1000
    seed: int = 0
    batch_size: int = 16
    model: DecoderConfig = DEMO_MODEL
    lr: float = 1e-3  # peak; with warm-up and cosine decay to 10%, bf16 weights above about 256 x lr stop moving
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.0
    min_quantized_size: int = 128
    evaluations: int = 6
    val_batches: int = 20
    log_every: int = 10
    data: str | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    progress_bar: bool = True
    threads: int | None = 1  # torch threads per run: one is fastest for this model on a busy or 2-core machine
    accelerator: str = "cpu"  # the Trainer's accelerator (the prepared GPU check trains on "cuda")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "evaluations", "val_batches", "log_every", "max_bytes"):
            check_int(name, getattr(self, name))
        if self.threads is not None:
            check_int("threads", self.threads)


__all__ = [
    "CONFIGS",
    "DEFAULT_CONFIGS",
    "DEMO_MODEL",
    "FP32_CONTROL_PERIOD",
    "REMEDY_SUFFIXES",
    "STORAGES",
    "WEIGHT_SUFFIXES",
    "DemoSettings",
    "RunConfig",
    "resolve_configs",
]
