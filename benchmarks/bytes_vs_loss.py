"""Bytes per parameter against final validation loss for the bf16-weight set-ups of the long plan (README's table).

Bytes per parameter are weights + gradients (from their dtypes: fp32 4 + 4, bf16 2 + 2; bf16-mixed keeps fp32
weights and gradients), plus the optimizer state measured in each run (``state_bytes_per_param`` in runs.json), plus
the write-back's compensation buffers (measured at the end of each run, ``weight_buffer_bytes_per_param``; runs
saved before it was recorded count 2 bytes per bf16 parameter for the ``compensated`` rows). Losses are means over
seeds; the difference to fp32 is paired by seed with its 95% interval; "recovered" is the share of the storage's
gap to fp32 that the row closes, over the same seeds. Run on a merged long-plan runs.json:

    python benchmarks/bytes_vs_loss.py out/recovery-long-all/runs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from lightning_stale.demo.stats import PairedDifference

ROWS = (  # configuration, words, weight + gradient bytes, write-back buffer bytes where runs.json has no measure
    ("fp32", "fp32 weights, torch AdamW (`32-true`)", 4 + 4, 0),
    ("torchmixed", "`bf16-mixed`, torch AdamW (fp32 weights and states)", 4 + 4, 0),
    ("torchmaster", "`bf16-true` compute, fp32 master weights and states (torch AdamW)", 2 + 2, 0),
    ("torchbf16", "`bf16-true`, torch AdamW (bf16 weights and states)", 2 + 2, 0),
    ("torchbf16+wsr", "  + `weights=\"stochastic\"`", 2 + 2, 0),
    ("torchbf16+wkahan", "  + `weights=\"compensated\"`", 2 + 2, 2),
    ("torchbf16+wsrm", "  + `weights=\"stochastic+moments\"`", 2 + 2, 0),
    ("torchbf16+wkahanm", "  + `weights=\"compensated+moments\"`", 2 + 2, 2),
    ("torchbf16+auto", "  + `remedy=\"auto\"`", 2 + 2, 0),
    ("bnb8bitbf16", "`bf16-true`, bitsandbytes AdamW8bit (8-bit states)", 2 + 2, 0),
    ("bnb8bitbf16+wsr", "  + `weights=\"stochastic\"`", 2 + 2, 0),
    ("bnb8bitbf16+wkahan", "  + `weights=\"compensated\"`", 2 + 2, 2),
    ("bnb8bitbf16+auto", "  + `remedy=\"auto\"`", 2 + 2, 0),
)


def table(runs: list[dict]) -> str:
    loss: dict[str, dict[int, float]] = {}
    state: dict[str, float] = {}
    buffers: dict[str, list[float]] = {}
    for run in runs:
        loss.setdefault(run["name"], {})[run["seed"]] = run["val_loss"]
        state[run["name"]] = run["state_bytes_per_param"]
        if "weight_buffer_bytes_per_param" in run:
            buffers.setdefault(run["name"], []).append(run["weight_buffer_bytes_per_param"])
    lines = ["| set-up | bytes / parameter | val loss, mean (seeds) | vs fp32, paired [95%] | recovered |",
             "|---|---|---|---|---|"]
    for name, words, weights, buffer in ROWS:
        if name not in loss:
            continue
        if name in buffers:
            buffer = statistics.fmean(buffers[name])
        seeds = sorted(s for s in loss[name] if s in loss["fp32"])
        diff = PairedDifference.of([loss[name][s] - loss["fp32"][s] for s in seeds])
        base = name.split("+")[0]
        gap = PairedDifference.of([loss[base][s] - loss["fp32"][s] for s in seeds if s in loss.get(base, {})])
        recovered = f"{100 * (gap.mean - diff.mean) / gap.mean:.1f}%" if "+" in name else "-"
        lines.append(f"| {words} | {weights + state[name] + buffer:.1f} | "
                     f"{statistics.fmean(loss[name][s] for s in seeds):.4f} ({len(seeds)}) | "
                     f"{'-' if name == 'fp32' else diff} | {recovered} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="a runs.json of benchmarks/recovery.py (merged long-plan runs)")
    print(table(json.loads(parser.parse_args().runs.read_text())["runs"]))


if __name__ == "__main__":
    main()
