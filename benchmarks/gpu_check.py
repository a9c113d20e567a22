"""The prepared GPU check: the whole product verified on one GPU in one command, every result written to a folder.

Parts (each in its own process, with its own time limit; a failure is recorded and the next part runs):

- ``tests``: the CUDA half of the device-parametrized suite (``pytest -k cuda``; the kernel's file is the next part).
- ``kernel``: the write-back's Triton kernel against its eager ops on the GPU, bit for bit, every rounding.
- ``syncs``: every front-end (plain loop, Trainer, Fabric, Hugging Face Trainer) for some steps with each family and
  remedy, ``torch.cuda.set_sync_debug_mode("error")`` around every optimizer step and the package's batch hooks
  that do not log (after set-up): a host sync there raises.
- ``step``: the write-back's optimizer step against torch AdamW ``fused=True`` and torch-optimi's Kahan step, and
  bitsandbytes AdamW8bit with and without the compensated write, at 66 / 291 / 1020 bf16 tensors of a 12M-parameter
  LLaMA-shaped stack and at 291 / 1020 tensors of a 1B one; each configuration's bytes per parameter kept beyond the
  weights and gradients, and its extra peak in the step (``benchmarks/weight_writeback.py --device cuda``).
- ``train``: 300 steps of the demo decoder in fp32, bf16-true, and bf16-true with ``remedy="auto"`` (the gap to fp32
  and the share of it recovered).
- ``monitor``: the callback's share of a training step at 291 and 1024 tensors (``benchmarks/overhead.py``).

The lent machines have no network and no bitsandbytes, torchao or torch-optimi: their cp312 wheels travel with the
working tree (about 47 MB of the 64 MiB a call carries). Here, once::

    echo /.whl/ >> .git/info/exclude
    python benchmarks/gpu_check.py --download .whl

and on the machine, from the repository root (the machine's own torch; about 8 minutes)::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --install .whl --out $OUT

``--out`` receives ``summary.json`` (each part's exit code, seconds and numbers, and the targets met or not) and
``report.txt`` (every part's output). ``python benchmarks/gpu_check.py --device cpu --quick`` runs every part on the
CPU at toy sizes (the suite runs it, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The packages the lent machines lack, as cp312 wheels for x86-64 Linux (pip download --no-deps).
WHEELS = ("bitsandbytes==0.50.2", "torchao==0.18.0", "torch-optimi==0.3.3")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
SITE = Path(tempfile.gettempdir()) / "gpu_check_site"  # where --install puts the carried wheels
TARGETS = {"step over torch fused": 1.5, "monitor share of a step": 0.01}


def download(folder: Path) -> None:
    """Fetch the carried wheels into ``folder`` (here, with network)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS], "-d", str(folder), *WHEELS]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    total = sum(f.stat().st_size for f in folder.glob("*.whl"))
    print(f"{folder}: {total / 2**20:.1f} MiB of wheels")


def install(folder: Path) -> str:
    """Install the carried wheels into :data:`SITE` (no index, no dependencies: the machine has the rest); the
    ``PYTHONPATH`` the parts run with."""
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
    return os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")])


# ------------------------------------------------------------------------------------------------------------------
# The parts: each returns a dict of numbers for the summary and prints what it did.

def part_train(device: str, quick: bool) -> dict[str, Any]:
    """fp32, bf16-true and bf16-true + auto on the demo decoder: the validation loss of each, the gap, the share
    recovered."""
    from lightning_stale.demo.configs import DEMO_MODEL, DemoSettings, resolve_configs
    from lightning_stale.demo.model import DecoderConfig
    from lightning_stale.demo.training import prepare_corpus, train_config

    model = DecoderConfig(dim=16, n_layers=1, n_heads=2, hidden=32, context=16) if quick else DEMO_MODEL
    settings = DemoSettings(steps=20 if quick else 300, lr=1e-3, model=model, accelerator=device, progress_bar=False,
                            val_batches=2 if quick else 20, evaluations=1, threads=None,
                            max_bytes=200_000 if quick else DemoSettings.max_bytes)
    corpus = prepare_corpus(settings)
    losses = {}
    with tempfile.TemporaryDirectory() as logs:
        for config in resolve_configs("fp32,torchbf16,torchbf16+auto"):
            result = train_config(config, settings, corpus, Path(logs))
            losses[config.name] = result.val_loss
            print(f"{config.name}: val loss {result.val_loss:.4f} in {result.seconds:.0f} s; weights taken over "
                  f"{result.remedy_weights}")
    gap = losses["torchbf16"] - losses["fp32"]
    recovered = (losses["torchbf16"] - losses["torchbf16+auto"]) / gap if gap > 0 else float("nan")
    print(f"gap bf16-true - fp32 {gap:+.4f}; auto recovers {recovered:.0%} of it")
    return {"losses": losses, "gap": gap, "recovered": recovered}


def part_step(device: str, quick: bool) -> dict[str, Any]:
    """The write-back's step against the peers (``benchmarks/weight_writeback.py``), at 12M and 1B parameters."""
    runs = [["--tensors", "66", "--total", "3e4", "--rounds", "2", "--warmup", "1"]] if quick else [
        ["--tensors", "66", "291", "1020", "--rounds", "20"],
        ["--tensors", "291", "1020", "--total", "1e9", "--rounds", "8", "--only", "fused", "auto", "kahan_sum, foreach",
         "bnb"]]
    out: dict[str, Any] = {}
    for i, extra in enumerate(runs):
        with tempfile.NamedTemporaryFile(suffix=".json") as file:
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "weight_writeback.py"), "--device", device,
                            "--json", file.name, *extra], check=True)
            out["12M" if i == 0 else "1B"] = json.loads(Path(file.name).read_text())
    return out


def part_syncs(device: str, quick: bool) -> dict[str, Any]:
    """Every front-end's steps under the host-sync check (see the module)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_syncs import run_front_ends

    return run_front_ends(device, quick)


PARTS = ("tests", "kernel", "syncs", "step", "train", "monitor")


def commands(device: str, quick: bool) -> dict[str, tuple[list[str], int]]:
    """Each part's command and time limit in seconds."""
    python, me = sys.executable, str(Path(__file__).resolve())
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    own = [python, me, "--device", device] + (["--quick"] if quick else [])
    if device == "cpu":  # the plumbing of the same parts at toy sizes
        tests = pytest + ["tests/test_devices.py", "-k", "underflow_guard_on_the_device and cpu"]
        kernel = pytest + ["tests/test_writeback_triton.py", "-k", "every_size_around_blocks_and_chunks and adam"]
    else:
        tests = pytest[:-1] + ["-k", "cuda", "--continue-on-collection-errors", "--ignore",
                               "tests/test_writeback_triton.py", "tests"]
        kernel = pytest + ["tests/test_writeback_triton.py", "-k", "cuda"]
    overhead = [python, "benchmarks/overhead.py", "--device", device, "--precision", "bf16-true", "--optimizers",
                "torch AdamW", "--modes", "default"]
    overhead += ["--tensors", "16", "--rounds", "1", "--steps", "6", "--warmup", "2", "--memory-params", "0"] \
        if quick else ["auto", "--tensors", "291", "1024", "--rounds", "2", "--steps", "60"]
    return {"tests": (tests, 240), "kernel": (kernel, 90), "syncs": (own + ["--part", "syncs"], 90),
            "step": (own + ["--part", "step"], 150), "train": (own + ["--part", "train"], 120),
            "monitor": (overhead, 120)}


def run_part(name: str, command: list[str], timeout: int, env: dict[str, str], numbers: Path) -> dict[str, Any]:
    """Run one part; its output kept, a failure or a timeout recorded, never raised."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**env, "GPU_CHECK_NUMBERS": str(numbers)})
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as error:
        parts = [p.decode(errors="replace") if isinstance(p, bytes) else p for p in (error.stdout, error.stderr) if p]
        text, code = "".join(parts) + f"\nTIMEOUT after {timeout} s", 124
    seconds = time.perf_counter() - start
    result = {"name": name, "exit": code, "seconds": round(seconds, 1), "command": " ".join(command)}
    if numbers.exists():
        result["numbers"] = json.loads(numbers.read_text())
        numbers.unlink()
    print(f"== {name}: exit {code} in {seconds:.0f} s\n{text[-3000:]}", flush=True)
    result["output"] = text
    return result


def targets(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The targets, read off the parts' numbers: met, missed or not measured."""
    out: dict[str, Any] = {}
    step = results.get("step", {}).get("numbers", {})
    auto = "torch AdamW + weights='compensated+moments' (auto)"
    for size, tables in step.items():
        for tensors, table in tables.items():
            fused = table.get(f"{auto} / torch AdamW fused")
            kahan = table.get(f"{auto} / torch-optimi AdamW kahan_sum, foreach")
            if fused is not None:
                out[f"step over torch fused, {size} {tensors} tensors"] = {
                    "value": round(fused, 3), "met": fused <= TARGETS["step over torch fused"]}
            if kahan is not None:
                out[f"step over torch-optimi Kahan, {size} {tensors} tensors"] = {"value": round(kahan, 3),
                                                                                 "met": kahan < 1.0}
    train = results.get("train", {}).get("numbers")
    if train:
        out["bf16-true recovered by auto"] = {"value": train["recovered"], "met": train["recovered"] >= 0.8}
    syncs = results.get("syncs", {}).get("numbers")
    if syncs:
        worst = max((r["syncs"] for r in syncs["runs"]), default=0)
        failed = [r["run"] for r in syncs["runs"] if r["error"]]
        out["host syncs on steps that do not log"] = {"value": worst, "failed runs": failed,
                                                      "met": worst == 0 and not failed}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check")
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the same parts, for CI)")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the script's plumbing, not measurements")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--download", type=Path, metavar="FOLDER", help="fetch the carried wheels and stop")
    parser.add_argument("--install", type=Path, metavar="FOLDER", help="install the carried wheels from FOLDER first")
    parser.add_argument("--part", choices=("step", "train", "syncs"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.download:
        download(args.download)
        return
    if args.part:  # one part, in its own process: its numbers to the file the runner named
        numbers = {"step": part_step, "train": part_train, "syncs": part_syncs}[args.part](args.device, args.quick)
        Path(os.environ.get("GPU_CHECK_NUMBERS", os.devnull)).write_text(json.dumps(numbers, default=str))
        return
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = install(args.install) if args.install else os.pathsep.join(
        [str(ROOT), env.get("PYTHONPATH", "")])
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    import torch

    machine = {"torch": torch.__version__, "device": args.device, "quick": args.quick,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else None,
               "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(machine), flush=True)
    results = {}
    for name, (command, timeout) in commands(args.device, args.quick).items():
        if name in args.parts:
            results[name] = run_part(name, command, timeout, env, args.out / f".{name}.json")
    summary = {"machine": machine, "seconds": round(time.perf_counter() - start, 1), "targets": targets(results),
               "parts": [{k: v for k, v in r.items() if k != "output"} for r in results.values()]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (args.out / "report.txt").write_text("\n\n".join(f"== {r['name']}: exit {r['exit']} in {r['seconds']} s\n"
                                                     f"$ {r['command']}\n{r['output']}" for r in results.values()))
    print(json.dumps({k: summary[k] for k in ("seconds", "targets")}, indent=1))
    for r in results.values():
        print(f"{r['name']}: exit {r['exit']} ({r['seconds']} s)")
    sys.exit(0 if all(r["exit"] == 0 for r in results.values()) else 1)


if __name__ == "__main__":
    main()
