"""The weight write-back's cost, side by side with the peers in one process.

``--part step`` (default): the optimizer step alone on bf16 parameters of LLaMA-shaped stacks (per layer q, k, v, o,
gate, up, down and two norms; plus embedding, final norm and output) at about 66, 291 and 1020 tensors of the same
total size, fixed random gradients, configurations alternating in rounds (the order rotating), one thread. Each
configuration's time is the median over rounds of its step time divided by torch ``AdamW(foreach=True)``'s in the same
round (nearest rounding on the same parameters): torch fused; torch with the monitor alone and with each ``weights``
mode (``"compensated+moments"`` is what ``remedy="auto"`` writes on torch.optim); torch-optimi ``AdamW(kahan_sum=True)``
(foreach and its default); torchao ``AdamW(bf16_stochastic_round=True)``; bitsandbytes ``AdamW8bit`` without and with
the compensated write (what ``remedy="auto"`` writes there). The last rows pair auto with torch fused and torch-optimi
Kahan round by round (the median of auto's time over theirs). The first steps (compiles) are excluded. torch-optimi and
torchao are optional (``pip install torch-optimi torchao``): a line says when one is absent.

``--device cuda`` runs it on a GPU (each step timed between device synchronizations) and adds each configuration's
memory: the bytes per parameter it keeps beyond the weights and gradients (moments, compensation buffers) and the
extra peak inside a step; ``--total`` sets the stack's size (``--total 1e9``: a 1B-parameter stack) and ``--only``
keeps the configurations whose name contains one of its words (and the reference).

``--part first``: what ``remedy="auto"`` costs on bf16 weights where it compiles, model by model (a tiny GPT-2 of 28
tensors, the demo decoder of 17, LLaMA-shaped stacks of 66 and 291 tensors at 12M parameters): each in a fresh process
with torch AdamW, every weight taken over from the first step, its first write (the graphs compiled: from an empty
Inductor cache, then again with the cache the first process left) and then its optimizer step against the plain step
(medians of alternating steps), with the pass compiled and eager.

``--part train``: the long plan's training step (the demo decoder, 17 tensors, bf16-true, batch 16 x 64 bytes):
plain, with the monitor, and with the monitor and ``remedy="auto"`` once it has taken every weight over, for torch
AdamW and bitsandbytes AdamW8bit; medians of alternating steps, as ratios to plain. Run::

    python benchmarks/weight_writeback.py --rounds 30
    python benchmarks/weight_writeback.py --part train --steps 200
    python benchmarks/weight_writeback.py --part first
    python benchmarks/weight_writeback.py --device cuda --tensors 291 --total 1e9 --only fused auto kahan
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_stale import StaleStateMonitor
from lightning_stale.demo.model import Decoder, DecoderConfig

TOTAL = 12_200_000  # elements of every stack
LAYERS = {66: 7, 291: 32, 1020: 113}  # tensors -> layers (9 per layer, plus 3)
REFERENCE = "torch AdamW foreach (nearest)"
AUTO = "torch AdamW + weights='compensated+moments' (auto)"
PEERS = ("torch AdamW fused", "torch-optimi AdamW kahan_sum, foreach", "torch-optimi AdamW kahan_sum")


def llama_shapes(layers: int, total: int = TOTAL) -> list[tuple[int, ...]]:
    """The parameter shapes of a LLaMA-like stack with ``layers`` layers, its width chosen for ``total`` elements."""
    def shapes(dim: int) -> list[tuple[int, ...]]:
        hidden, vocab = (dim * 8 // 3 + 7) // 8 * 8, 2048
        layer = [(dim, dim)] * 4 + [(hidden, dim), (hidden, dim), (dim, hidden), (dim,), (dim,)]
        return [(vocab, dim)] + layer * layers + [(dim,), (vocab, dim)]

    dim = 8
    while sum(torch.Size(s).numel() for s in shapes(dim + 8)) <= total:
        dim += 8
    return shapes(dim)


def parameters(shapes: list[tuple[int, ...]], device: str = "cpu") -> list[torch.nn.Parameter]:
    """bf16 parameters of ``shapes`` on ``device`` with fixed random gradients (the same for every configuration)."""
    gen = torch.Generator(device).manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen, device=device) * 0.02).bfloat16())
        p.grad = (torch.randn(shape, generator=gen, device=device) * 1e-3).bfloat16()
        params.append(p)
    return params


def step_configurations() -> dict[str, Callable[[list[torch.nn.Parameter]], Callable[[], None]]]:
    """name -> (parameters -> one step), each on its own copy of the parameters."""
    def torch_adamw(**kw):
        return lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **kw).step

    def monitored(weights: str | None):
        def make(ps):
            opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True)
            make.monitor = StaleStateMonitor(opt, weights=weights)  # kept alive with the closure
            return opt.step
        return make

    out = {REFERENCE: torch_adamw(foreach=True), "torch AdamW fused": torch_adamw(fused=True),
           "torch AdamW + monitor": monitored(None)}
    for weights in ("stochastic", "compensated", "stochastic+moments"):
        out[f"torch AdamW + weights={weights!r}"] = monitored(weights)
    out[AUTO] = monitored("compensated+moments")
    if importlib.util.find_spec("optimi") is not None:
        import optimi

        out["torch-optimi AdamW kahan_sum, foreach"] = \
            lambda ps: optimi.AdamW(ps, lr=1e-3, weight_decay=0.1, kahan_sum=True, foreach=True).step
        out["torch-optimi AdamW kahan_sum"] = lambda ps: optimi.AdamW(ps, lr=1e-3, weight_decay=0.1,
                                                                       kahan_sum=True).step
    else:
        print("torch-optimi is not installed: its rows are left out (pip install torch-optimi)")
    if importlib.util.find_spec("torchao") is not None:
        import torchao.optim

        # torchao 0.18 keeps its plain AdamW (the one with bf16_stochastic_round) as _AdamW
        AoAdamW = getattr(torchao.optim, "AdamW", None) or torchao.optim._AdamW

        out["torchao AdamW bf16_stochastic_round"] = \
            lambda ps: AoAdamW(ps, lr=1e-3, weight_decay=0.1, bf16_stochastic_round=True).step
    else:
        print("torchao is not installed: its row is left out (pip install torchao)")
    if importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes as bnb

        def bnb_monitored(ps):
            opt = bnb.optim.AdamW8bit(ps, lr=1e-3, weight_decay=0.1)
            bnb_monitored.monitor = StaleStateMonitor(opt, weights="compensated")
            return opt.step

        out["bnb AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3, weight_decay=0.1).step
        out["bnb AdamW8bit + weights='compensated' (auto)"] = bnb_monitored
    return out


def run_steps(tensors: int, rounds: int, warmup: int, device: str = "cpu", total: int = TOTAL,
              only: list[str] | None = None) -> dict[str, float]:
    shapes = llama_shapes(LAYERS[tensors], total)
    base = parameters(shapes, device)
    cuda = device.startswith("cuda")
    makers = {name: make for name, make in step_configurations().items()
              if not only or name == REFERENCE or any(word.lower() in name.lower() for word in only)}
    elements = sum(torch.Size(s).numel() for s in shapes)
    steps, memory = {}, {}
    for name, make in makers.items():  # each on its own copies of the same weights and gradients
        before = torch.cuda.memory_allocated() if cuda else 0
        params = [torch.nn.Parameter(p.detach().clone()) for p in base]
        for p, b in zip(params, base):
            p.grad = b.grad.clone()
        steps[name] = make(params)
        if cuda:  # the first step creates the states: what it keeps beyond weights and gradients, and its peak
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            steps[name]()
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - before - 4 * elements  # bf16 weights and gradients
            memory[name] = (kept / elements, (torch.cuda.max_memory_allocated() - start) / elements)
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            steps[name]()
            if cuda:
                torch.cuda.synchronize()
            if r >= warmup:
                seconds[name].append(time.perf_counter() - start)
    ratios = {name: statistics.median(t / ref for t, ref in zip(seconds[name], seconds[REFERENCE]))
              for name in names}
    for peer in PEERS:  # auto over each one-pass peer, paired round by round (the step-time targets' quantity)
        if peer in seconds and AUTO in seconds:
            ratios[f"{AUTO} / {peer}"] = statistics.median(a / p for a, p in zip(seconds[AUTO], seconds[peer]))
    ratios["_reference_ms"] = 1e3 * statistics.median(seconds[REFERENCE])
    ratios["_elements"] = elements
    ratios["_tensors"] = len(shapes)
    ratios["_memory"] = memory  # name -> (bytes per parameter kept, extra peak per parameter in the first step)
    return ratios


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    """One bf16-true step (forward, backward, optimizer step); its wall time in seconds."""
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    return time.perf_counter() - start


def run_train(steps: int) -> None:
    import bitsandbytes as bnb

    config = DecoderConfig(dim=64, hidden=176, context=64, n_layers=2, n_heads=4)
    for label, make in (("torch AdamW", lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=0.1)),
                        ("bnb AdamW8bit", lambda p: bnb.optim.AdamW8bit(p, lr=2e-3, weight_decay=0.1,
                                                                        min_8bit_size=128))):
        torch.manual_seed(0)
        plain = Decoder(config).to(torch.bfloat16)
        models = {"plain": plain, "monitor": copy.deepcopy(plain), "monitor + auto": copy.deepcopy(plain)}
        opts = {name: make(m.parameters()) for name, m in models.items()}
        monitors = [StaleStateMonitor(opts["monitor"]), StaleStateMonitor(opts["monitor + auto"], remedy="auto")]
        writeback = monitors[1]._pipelines[0].writeback
        writeback.take_over(models["monitor + auto"].parameters())  # what auto reaches within its first checks
        gen = torch.Generator().manual_seed(1)
        times: dict[str, list[float]] = {name: [] for name in models}
        names = list(models)
        for step in range(steps + 10):
            tokens = torch.randint(0, config.vocab_size, (16, config.context + 1), generator=gen)
            for name in names[step % 3:] + names[:step % 3]:
                elapsed = train_step(models[name], opts[name], tokens)
                if step >= 10:
                    times[name].append(elapsed)
        plain_ms = 1e3 * statistics.median(times["plain"])
        print(f"| {label} | {plain_ms:.2f} ms | " + " | ".join(
            f"{statistics.median(t / p for t, p in zip(times[n], times['plain'])):.3f}"
            for n in ("monitor", "monitor + auto")) + f" | {writeback.handled} |")
        for monitor in monitors:
            monitor.close()


FIRST_MODELS = ("tiny GPT-2", "demo decoder", "LLaMA 66 tensors", "LLaMA 291 tensors")


def first_parameters(model: str) -> list[torch.nn.Parameter]:
    """bf16 parameters of ``model`` (one of :data:`FIRST_MODELS`) with fixed gradients."""
    if model == "tiny GPT-2":
        shapes = [(96, 64), (16, 64)] + [(64,), (64,), (64, 192), (192,), (64, 64), (64,), (64,), (64,), (64, 256),
                                         (256,), (256, 64), (64,)] * 2 + [(64,), (64,)]
    elif model == "demo decoder":
        shapes = [tuple(p.shape) for p in Decoder(DecoderConfig(dim=64, hidden=176, context=64, n_layers=2,
                                                                n_heads=4)).parameters()]
    else:
        shapes = llama_shapes(LAYERS[int(model.split()[1])])
    return parameters(shapes)


def first_in_process(model: str, steps: int) -> dict[str, float]:
    """One process of ``--part first``: the first write's seconds, then the median step ratios."""
    from lightning_stale import _compat

    base = first_parameters(model)
    configs = {}
    for name in ("plain", "compiled", "eager"):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in base]
        for p, b in zip(ps, base):
            p.grad = b.grad.clone()
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)
        if name != "plain":
            monitor = StaleStateMonitor(opt, weights="compensated+moments")
            configs[f"{name} monitor"] = monitor  # kept alive
        configs[name] = opt
    threshold = _compat.COMPILE_MIN_NUMEL
    seconds: dict[str, list[float]] = {n: [] for n in ("plain", "compiled", "eager")}
    first = 0.0
    for step in range(steps + 2):
        for name in ("plain", "compiled", "eager")[step % 3:] + ("plain", "compiled", "eager")[:step % 3]:
            _compat.COMPILE_MIN_NUMEL = threshold if name == "compiled" else 1 << 62  # eager: never large enough
            start = time.perf_counter()
            configs[name].step()
            elapsed = time.perf_counter() - start
            if step == 1 and name == "compiled":
                first = elapsed  # the first write (the state appears at step 0): the graphs compile here
            elif step >= 2:
                seconds[name].append(elapsed)
    plain = seconds["plain"]
    return {"elements": sum(p.numel() for p in base), "tensors": len(base), "first": first,
            "plain_ms": 1e3 * statistics.median(plain),
            **{name: statistics.median(t / p for t, p in zip(seconds[name], plain)) for name in ("compiled", "eager")}}


def run_first(steps: int) -> None:
    """Each model in a fresh process, twice: from an empty Inductor cache, then from the cache it left."""
    import os
    import subprocess
    import sys
    import tempfile

    print("| model | tensors | parameters | first write, empty cache (s) | first write, warm cache (s) | plain step | "
          "auto compiled / plain | auto eager / plain |")
    print("|---|---|---|---|---|---|---|---|")
    for model in FIRST_MODELS:
        with tempfile.TemporaryDirectory(prefix="inductor_first_") as cache:
            runs = []
            for _ in range(2):
                out = subprocess.run([sys.executable, __file__, "--part", "first-one", "--model", model, "--steps",
                                      str(steps)], capture_output=True, text=True, check=True,
                                     env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        cold, warm = runs
        print(f"| {model} | {warm['tensors']} | {warm['elements'] / 1e6:.2f}M | {cold['first']:.1f} | "
              f"{warm['first']:.1f} | {warm['plain_ms']:.1f} ms | {warm['compiled']:.2f} | {warm['eager']:.2f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("step", "train", "first", "first-one"), default="step")
    parser.add_argument("--model", choices=FIRST_MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--tensors", type=int, nargs="+", default=sorted(LAYERS), choices=sorted(LAYERS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (--part step)")
    parser.add_argument("--total", type=float, default=TOTAL, help="elements of each stack (--part step)")
    parser.add_argument("--only", nargs="+", default=None,
                        help="keep the configurations whose name contains one of these words (--part step)")
    parser.add_argument("--json", default=None, help="also write the step part's results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning_stale").setLevel(logging.WARNING)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {platform.processor() or '?'}, "
          f"{torch.get_num_threads()} thread(s)")
    if args.part == "first-one":
        print(json.dumps(first_in_process(args.model, args.steps)))
        return
    if args.part == "first":
        run_first(min(args.steps, 30))
        return
    if args.part == "train":
        print("| optimizer | plain step | monitor / plain | monitor + auto / plain | tensors taken over |")
        print("|---|---|---|---|---|")
        run_train(args.steps)
        return
    results = {n: run_steps(n, args.rounds, args.warmup, args.device, int(args.total), args.only)
               for n in args.tensors}
    if args.device != "cpu":
        print(f"device: {torch.cuda.get_device_name() if args.device.startswith('cuda') else args.device}")
    header = [f"{r['_tensors']} tensors, {r['_elements'] / 1e6:.1f}M" for r in results.values()]
    print("| configuration | " + " | ".join(header) + " |")
    print("|---" * (len(header) + 1) + "|")
    for name in (k for k in next(iter(results.values())) if not k.startswith("_")):
        cells = [f"{r[name]:.2f}" + (f" ({r['_reference_ms']:.1f} ms)" if name == REFERENCE else "")
                 for r in results.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    memory = [r["_memory"] for r in results.values() if r["_memory"]]
    if memory:
        print("\nbytes per parameter beyond bf16 weights and gradients: kept / extra peak in the first step")
        for name in memory[0]:
            print(f"| {name} | " + " | ".join(f"{m[name][0]:.2f} / {m[name][1]:.2f}" for m in memory) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(n): r for n, r in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
