"""The demo's model, corpus and runner: forward/backward on its own, and a tiny end-to-end ``lightning-stale demo``."""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from lightning_stale.commands import demo as demo_command
from lightning_stale.demo.configs import CONFIGS, DEFAULT_CONFIGS, DemoSettings, resolve_configs
from lightning_stale.demo.data import DEFAULT_CORPUS_SHA256, ByteCorpus, CorpusIdentity, load_corpus
from lightning_stale.demo.model import Decoder, DecoderConfig, LanguageModel, OptimizerSpec, warmup_cosine
from lightning_stale.demo.report import recovered_share
from lightning_stale.demo.runner import run_demo
from lightning_stale.demo.stats import PairedDifference, t975
from lightning_stale.demo.training import optimizer_state_bytes

TINY = DecoderConfig(dim=32, n_layers=1, n_heads=2, hidden=64, context=16)


def test_decoder_shapes_and_backward() -> None:
    torch.manual_seed(0)
    model = Decoder(TINY)
    tokens = torch.randint(0, 256, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 256)
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match="exceeds the model context"):
        model(torch.randint(0, 256, (1, 17)))


def test_decoder_is_causal() -> None:
    torch.manual_seed(0)
    model = Decoder(TINY).eval()
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_rotary_positions_make_order_matter() -> None:
    """Without positions a causal model could not tell 'ab' from 'ba' at the last position; with rotary it can."""
    torch.manual_seed(0)
    model = Decoder(TINY).eval()
    with torch.no_grad():
        ab = model(torch.tensor([[1, 2, 3, 4]]))[0, -1]
        ba = model(torch.tensor([[2, 1, 3, 4]]))[0, -1]
    assert not torch.allclose(ab, ba)


def test_loss_decreases_on_a_tiny_batch() -> None:
    torch.manual_seed(0)
    module = LanguageModel(TINY, OptimizerSpec(lr=1e-2), total_steps=30)
    optimizer = module.configure_optimizers()["optimizer"]
    batch = (torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16)))
    first = module.loss(batch).item()
    for _ in range(30):
        optimizer.zero_grad()
        module.loss(batch).backward()
        optimizer.step()
    assert module.loss(batch).item() < first - 1.0


def test_warmup_cosine_schedule() -> None:
    values = [warmup_cosine(s, 100, 0.1, 0.1) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(values[9:], values[10:]))


def test_invalid_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="state_format"):
        OptimizerSpec(kind="quantized", state_format="fp6")
    with pytest.raises(ValueError, match="kind"):
        OptimizerSpec(kind="sgd")
    with pytest.raises(ValueError, match="n_heads"):
        DecoderConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="unknown configs"):
        resolve_configs("fp32,fp7")


def test_optimizer_state_bytes_counts_state_tensors() -> None:
    model = torch.nn.Linear(64, 64, bias=False)
    fp32 = OptimizerSpec().build(list(model.parameters()))
    model(torch.randn(2, 64)).sum().backward()
    fp32.step()
    # exp_avg + exp_avg_sq in fp32, plus the 4-byte step counter
    assert optimizer_state_bytes(fp32) == 2 * 4 * 64 * 64 + 4
    big = torch.nn.Linear(256, 256, bias=False)
    bnb = OptimizerSpec(kind="bnb_adamw8bit").build(list(big.parameters()))
    big(torch.randn(2, 256)).sum().backward()
    bnb.step()
    n = 256 * 256
    # two uint8 moments, two 256-entry fp32 quantization maps, one fp32 absmax per 256-block for each moment
    assert optimizer_state_bytes(bnb) == 2 * n + 2 * 256 * 4 + 2 * (n // 256) * 4


def test_corpus_errors_and_split(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty corpus"):
        load_corpus(tmp_path / "empty")
    with pytest.raises(ValueError, match="corpus too small"):
        ByteCorpus(b"short text", context=16)
    text = tmp_path / "text.txt"
    text.write_text("hello world\n" * 200)
    corpus = ByteCorpus(load_corpus(text), context=8)
    first = [x for x, _ in corpus.train_loader(steps=3, batch_size=2, seed=5)]
    again = [x for x, _ in corpus.train_loader(steps=3, batch_size=2, seed=5)]
    assert len(first) == 3 and all(torch.equal(a, b) for a, b in zip(first, again))
    x, y = next(iter(corpus.val_loader(batches=1, batch_size=2, seed=5)))
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_default_corpus_is_the_pinned_shipped_text() -> None:
    corpus = load_corpus()
    # the benchmark tables in BENCHMARKS.md name this hash: a change of the shipped bytes must be deliberate
    assert CorpusIdentity.of(corpus, "default") == CorpusIdentity("default", DEFAULT_CORPUS_SHA256, 4_000_000)
    assert corpus.startswith(b"\"\"\"Record of phased-in incompatible language changes.")  # CPython's __future__.py
    assert load_corpus(max_bytes=10_000) == corpus[:10_000]
    assert ByteCorpus(corpus[:10_000], context=8, source="x").identity.size == 10_000


def test_paired_difference_interval() -> None:
    diff = PairedDifference.of([1.0, 2.0, 3.0, 4.0, 5.0])  # sd 1.5811, t(4) 2.776: half-width 1.963
    assert (diff.mean, diff.n) == (3.0, 5) and diff.half_width == pytest.approx(1.9630, abs=1e-4)
    assert diff.significant and not PairedDifference.of([-1.0, 0.5, 1.0]).significant
    assert PairedDifference.of([-0.2, -0.21, -0.19]).significant  # below zero counts too
    assert not PairedDifference.of([0.5]).significant and str(PairedDifference.of([0.5])) == "+0.5000 (n=1)"
    assert t975(40) == pytest.approx(2.0211, abs=2e-4) and t975(1000) == pytest.approx(1.9623, abs=2e-4)
    with pytest.raises(ValueError, match="df"):
        t975(0)


def test_recovered_share() -> None:
    assert recovered_share(1.52, baseline_loss=1.60, reference_loss=1.50) == pytest.approx(0.8)
    assert math.isnan(recovered_share(1.50, baseline_loss=1.501, reference_loss=1.50))  # gap below the noise floor


def test_command_help_names_a_few_configs_and_the_grammar_of_all() -> None:
    assert demo_command.DEFAULT_CONFIGS == ",".join(DEFAULT_CONFIGS)
    featured = [n for names, _ in demo_command.FEATURED for n in names.split(",")]
    assert set(featured) <= set(CONFIGS) and len(demo_command.FEATURED) <= 10
    assert featured[:3] == list(DEFAULT_CONFIGS)
    assert sorted(demo_command.composed_configs()) == sorted(CONFIGS)  # the grammar in --help gives the catalogue
    assert CONFIGS["fp8-sr+reset"].reset == "theory" and CONFIGS["fp8-sr+reset"].baseline == "fp8"
    parser = argparse.ArgumentParser()
    demo_command.add_arguments(parser)
    defaults, settings = parser.parse_args([]), DemoSettings()
    assert (defaults.steps, defaults.seed, defaults.threads, defaults.lr) == \
        (settings.steps, settings.seed, settings.threads, settings.lr)
    assert CONFIGS["torchbf16+auto"].remedy == "auto" and CONFIGS["torchbf16+auto"].precision == "bf16-true"
    assert CONFIGS["fp8+auto"].remedy == "auto" and CONFIGS["bnb8bit+guard"].underflow_guard
    assert CONFIGS["fp4+drift"].reset == "drift" and CONFIGS["int8-sr+periodic"].every == 300
    from lightning_stale import cli

    text = cli.build_parser()._subparsers._group_actions[0].choices["demo"].format_help()
    assert "fp8-sr+periodic" not in text and "STORAGE[-sr][+REMEDY]" in text and len(text.splitlines()) < 60
    with pytest.raises(ValueError, match=r"did you mean torchbf16\+auto"):
        resolve_configs("torchbf16+aut")


def test_parallel_demo_runs_give_the_serial_results(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("for i in range(10):\n    print(i * 2)\n" * 400)
    settings = DemoSettings(steps=10, model=TINY, batch_size=4, val_batches=2, log_every=2, evaluations=2,
                            data=str(text), progress_bar=False)
    configs = resolve_configs("fp32,fp8+auto")
    serial = run_demo(settings, configs, tmp_path / "serial")
    parallel = run_demo(settings, configs, tmp_path / "parallel", workers=2)
    assert [r.name for r in parallel] == ["fp32", "fp8+auto"]
    assert [r.val_loss for r in parallel] == [r.val_loss for r in serial]
    assert "auto: w/guard/SR/reset" in (tmp_path / "parallel" / "results.txt").read_text()


def test_demo_smoke_run(tmp_path: Path) -> None:
    """Three configurations, a few steps on a tiny model: the table, the logs and the figure are written; the
    bf16-true run has the weight columns and its weights are taken over by remedy="auto"."""
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    out = tmp_path / "out"
    settings = DemoSettings(steps=12, model=TINY, batch_size=4, val_batches=2, log_every=1, evaluations=2,
                            data=str(text), progress_bar=False)
    results = run_demo(settings, resolve_configs("fp32,bnb8bit+reset,torchbf16+auto"), out)
    assert [r.name for r in results] == ["fp32", "bnb8bit+reset", "torchbf16+auto"]
    assert all(torch.isfinite(torch.tensor(r.val_loss)) for r in results)
    assert (out / "demo.png").stat().st_size > 10_000
    saved = json.loads((out / "results.json").read_text())
    assert [r["val_loss"] for r in saved["results"]] == [r.val_loss for r in results]
    assert saved["corpus"]["source"] == str(text) and saved["corpus"]["size"] == len(text.read_bytes())
    assert saved["cpu_kernels"].split(" (")[0] == torch.backends.cpu.get_cpu_capability()
    table = (out / "results.txt").read_text()
    assert table.startswith("config") and "bnb8bit+reset" in table
    header = table.splitlines()[0]
    assert "w stall" in header and "w stall pred" in header and "auto: w/guard/SR/reset" in header
    for r in results:
        with (Path(r.log_dir) / "metrics.csv").open() as handle:
            columns = next(csv.reader(handle))
        assert {"train/loss", "val/loss", "stale/v/frac", "stale/v/drift"} <= set(columns)
        assert r.curves["val/loss"][-1][0] == 12 and r.curves["lr"]  # the lr the figure draws beside the w stall
    runs = {r.name: r for r in results}
    assert math.isnan(runs["fp32"].w_frac) and 0 <= runs["torchbf16+auto"].w_frac <= 1  # bf16 weights only
    assert 0 <= runs["torchbf16+auto"].w_predicted <= 1 and runs["torchbf16+auto"].remedy_weights > 0
    assert runs["fp32"].state_bytes_per_param == pytest.approx(8.0, abs=0.1)
    assert runs["bnb8bit+reset"].state_bytes_per_param < 3.0
    # bf16 moments (4 bytes) and the compensated write's buffers (2 bytes per parameter taken over)
    assert runs["torchbf16+auto"].state_bytes_per_param == pytest.approx(4.0, abs=0.3)
    assert 0 < runs["torchbf16+auto"].weight_buffer_bytes_per_param <= 2.0


def test_demo_command_prints_table_and_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_stale import cli

    text = tmp_path / "corpus.txt"
    text.write_text("import os\nprint(os.getcwd())\n" * 400)
    out = tmp_path / "out"
    assert cli.main(["demo", "--steps", "3", "--configs", "fp32", "--out", str(out), "--data", str(text)]) == 0
    printed = capsys.readouterr().out
    assert "val loss" in printed and str(out / "demo.png") in printed and (out / "demo.png").exists()
    digest = hashlib.sha256(text.read_bytes()).hexdigest()
    assert f"corpus: {text}: {len(text.read_bytes()):,} bytes, sha256 {digest}; CPU kernels: " in printed


def test_runs_under_another_cpu_kernel_set_get_their_own_compile_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_stale.demo.training import separate_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert separate_compile_cache() is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")
    folder = separate_compile_cache()
    assert folder is not None and folder.endswith("_avx2") and os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", folder[: -len("_avx2")])  # torch's default, as torch writes it
    assert separate_compile_cache() == folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/mine")
    assert separate_compile_cache() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/mine"


def test_a_diverged_run_shows_nan_in_the_table() -> None:
    from lightning_stale.demo.report import format_table
    from lightning_stale.demo.training import RunResult

    runs = [RunResult("torchbf16", 0, 2.0, 4.0, 1.0, ""), RunResult("torchbf16+auto", 0, math.nan, 6.0, 1.0, "")]
    row = format_table(runs, reference="torchbf16").splitlines()[3]
    assert row.split()[:3] == ["torchbf16+auto", "nan", "+nan"]


def test_demo_reports_a_missing_data_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_stale import cli

    assert cli.main(["demo", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().out


def test_optimizer_spec_takes_one_format_per_moment():
    param = torch.nn.Parameter(torch.randn(64, 64))
    opt = OptimizerSpec(kind="quantized", state_format="fp32/fp4").build([param])
    assert (opt.moment_format(param, "m").name, opt.moment_format(param, "v").name) == ("fp32", "fp4")
    assert OptimizerSpec(kind="quantized", state_format="fp8_e4m3").build([param]).moment_format(param, "v").name \
        == "fp8_e4m3"
    with pytest.raises(ValueError, match="`state_format` must be one of"):
        OptimizerSpec(kind="quantized", state_format="fp4/fp6")


def test_master_weight_adamw_is_torch_adamw_in_fp32_and_its_rounding_in_bf16() -> None:
    """The bf16-compute control: on fp32 parameters it is torch AdamW bit for bit; on bf16 parameters each stored
    weight is its fp32 master (which follows torch AdamW on the same gradients) rounded to nearest."""
    from lightning_stale.demo.master import MasterWeightAdamW

    torch.manual_seed(0)
    start = torch.randn(64, 32)
    grads = [torch.randn(64, 32) * 1e-2 for _ in range(20)]
    kwargs = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    reference, fp32, bf16 = (torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone()),
                             torch.nn.Parameter(start.to(torch.bfloat16)))
    optimizers = [torch.optim.AdamW([reference], foreach=False, **kwargs), MasterWeightAdamW([fp32], **kwargs),
                  MasterWeightAdamW([bf16], **kwargs)]
    for grad in grads:
        for param, optimizer in zip((reference, fp32, bf16), optimizers):
            param.grad = grad.to(param.dtype)
            optimizer.step()
    assert torch.equal(fp32, reference)
    master = optimizers[2].state[bf16]["master"]
    assert master.dtype == torch.float32 and torch.equal(bf16, master.to(torch.bfloat16))
    moved = (bf16.float() - start.to(torch.bfloat16).float()).abs()
    assert (master - start).abs().max() > 0 and (moved > 0).any()
    with pytest.raises(ValueError, match="amsgrad"):
        MasterWeightAdamW([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)


def test_master_weight_adamw_stochastic_storages_follow_the_fp32_run_on_average() -> None:
    """Weights (or moments) stored in bf16 with stochastic rounding: no fp32 copy kept, and updates far below the
    bf16 grid gap still move the weights as the all-fp32 run does on average, where nearest rounding stalls them."""
    from lightning_stale.demo.master import MasterWeightAdamW

    start = torch.ones(4096)
    kwargs = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # update ~1e-4, grid gap at 1: 2^-7
    runs = {}
    for weights, moments in (("fp32", "fp32"), ("stochastic", "fp32"), ("fp32", "stochastic")):
        param = torch.nn.Parameter(start.to(torch.bfloat16))
        optimizer = MasterWeightAdamW([param], weights=weights, moments=moments, **kwargs)
        for _ in range(50):
            param.grad = torch.ones_like(param)
            optimizer.step()
        state = optimizer.state[param]
        assert ("master" in state) == (weights == "fp32")
        assert state["exp_avg"].dtype == (torch.float32 if moments == "fp32" else torch.bfloat16)
        runs[weights, moments] = state.get("master", param.detach().float())
    exact = runs["fp32", "fp32"]
    assert abs(float(exact.mean()) - (1 - 50e-4)) < 1e-4
    assert abs(float(runs["stochastic", "fp32"].mean() - exact.mean())) < 2e-4
    assert abs(float(runs["fp32", "stochastic"].mean() - exact.mean())) < 2e-4
    with pytest.raises(ValueError, match="weights"):
        MasterWeightAdamW([torch.nn.Parameter(torch.zeros(2))], weights="nearest")
