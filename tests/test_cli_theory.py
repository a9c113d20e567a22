"""``lightning-stale period`` and ``lightning-stale simulate`` through the real CLI entry point."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_stale.cli import main
from lightning_stale.theory import format_rho_hat, reset_period


def _period(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["period", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _number(out: str, label: str) -> float:
    match = re.search(rf"{re.escape(label)}\s+([0-9.,]+)", out)
    assert match, f"{label!r} not in output:\n{out}"
    return float(match.group(1).replace(",", ""))


def test_period_offers_the_papers_float_formats_the_theory_knows():
    from lightning_stale.commands.period import PAPER_FORMATS
    from lightning_stale.theory import FORMAT_EPSILON

    assert set(PAPER_FORMATS) == set(FORMAT_EPSILON)  # spelled twice so that --help does not import torch


def test_period_bf16_prints_the_papers_numbers(capsys):
    rc, out, _ = _period(capsys, "--format", "bf16", "--beta2", "0.999")
    assert rc == 0
    assert "paper's float-grid model" in out and "unlikely to pay off" not in out
    assert _number(out, "rho-hat") == 2.71
    assert _number(out, "steady stall, nearest") == 0.946
    assert _number(out, "steady stall, stochastic") == 0.825
    assert _number(out, "K* (s0 = 0.6):") == 1116
    assert "0.5: 1,004 steps" in out and "0.7: 1,262 steps" in out  # the s0 sweep


def test_period_fp8_startup_windows_with_the_papers_floor(capsys):
    rc, out, _ = _period(capsys, "--format", "fp8_e4m3", "--p-init", "0.53")
    assert rc == 0
    windows = [int(w) for w in re.findall(r"      \d\d%: (\d+) steps", out)]
    assert windows == [0, 15, 36, 61]  # paper Table 8
    assert _number(out, "K* (s0 = 0.6):") == 320


def test_period_rho_below_one_uses_the_extended_rule(capsys):
    rc, out, _ = _period(capsys, "--format", "bf16", "--beta2", "0.99")
    assert rc == 0 and "rho-hat < 1" in out
    assert "unlikely to pay off" in out  # only 13% of updates stall
    assert _number(out, "K* (s0 = 0.6):") == reset_period(format_rho_hat("bf16", 0.99), 0.99)


def test_period_int8_dynamic_uses_the_grid_estimate(capsys):
    rc, out, _ = _period(capsys, "--format", "int8_dynamic")
    assert rc == 0
    assert "grid estimate" in out and "not the paper's" in out and "estimate" in out
    rho = _number(out, "rho-hat")
    assert format_rho_hat("bf16", 0.999) < rho < format_rho_hat("fp8_e4m3", 0.999)


def _train(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int = 5) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        optimizer.step()


def test_period_reads_a_saved_quantized_adamw_state(capsys, tmp_path):
    from lightning_stale.optim import QuantizedAdamW

    params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(4096)),
              torch.nn.Parameter(torch.randn(10))]  # below min_quantized_size: fp32 moments, left out
    opt = QuantizedAdamW(params, betas=(0.9, 0.995), state_format="int8_dynamic")
    _train(opt, params)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    rc, out, _ = _period(capsys, "--state", str(tmp_path / "opt.pt"))
    assert rc == 0
    assert "QuantizedAdamW int8_dynamic" in out and "our extension" in out
    assert "beta2 = 0.995" in out  # read from the saved param group
    assert "from 12,288 stored v values" in out and "1 fp32 state tensor(s) left out" in out


def test_period_reads_a_saved_bitsandbytes_state(capsys, tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    params = [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(80))]  # the bias stays fp32
    opt = bnb.optim.Adam8bit(params, betas=(0.9, 0.999))
    _train(opt, params)
    torch.save(opt.state_dict(), tmp_path / "bnb.pt")
    rc, out, _ = _period(capsys, "--state", str(tmp_path / "bnb.pt"))
    assert rc == 0 and "bitsandbytes 8-bit" in out and "from 5,120 stored v values" in out
    assert format_rho_hat("bf16", 0.999) < _number(out, "rho-hat") < format_rho_hat("fp8_e4m3", 0.999)


def test_period_on_a_bf16_torch_adam_state_matches_the_paper(capsys, tmp_path):
    params = [torch.nn.Parameter(torch.randn(20_000, dtype=torch.bfloat16))]
    opt = torch.optim.AdamW(params)
    _train(opt, params, steps=3)
    torch.save(opt.state_dict(), tmp_path / "adam.pt")
    rc, out, _ = _period(capsys, "--state", str(tmp_path / "adam.pt"))
    assert rc == 0 and "torch bfloat16" in out
    # the harmonic-mean spacing reduces to the paper's eps ln 2 on a float grid
    assert _number(out, "rho-hat") == pytest.approx(format_rho_hat("bf16", 0.999), rel=0.03)


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--beta2", "1.5"], "beta2"),
        (["--s0", "1"], "s0"),
        (["--p-init", "2"], "p_init"),
        (["--state", "nope.pt"], "state"),
    ],
)
def test_period_rejects_bad_arguments_naming_them(capsys, argv, name):
    rc, _, err = _period(capsys, *argv)
    assert rc == 2 and name in err


def test_simulate_writes_table_csvs_and_figure(capsys, tmp_path):
    rc = main(["simulate", "--steps", "300", "--n", "2000", "--change-step", "150", "--reset", "100",
               "--out", str(tmp_path)])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "bf16 nearest, no reset" in out and "bf16 nearest, reset every 100" in out
    for name in ("simulate_no_reset.csv", "simulate_reset.csv"):
        assert len((tmp_path / name).read_text().splitlines()) == 301
    assert (tmp_path / "simulate.png").read_bytes()[:4] == b"\x89PNG"


def test_simulate_rejects_a_bad_reset(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--reset", "often"])
    assert "reset" in capsys.readouterr().err
    assert main(["simulate", "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err


@pytest.mark.slow  # torchao compiles its optimizer step on first use (~30 s on 2 cores)
def test_period_reads_a_saved_torchao_fp8_state(capsys, tmp_path):
    optim = pytest.importorskip("torchao.optim")
    params = [torch.nn.Parameter(torch.randn(64, 128))]
    opt = optim.AdamWFp8(params)
    _train(opt, params, steps=2)
    torch.save(opt.state_dict(), tmp_path / "ao.pt")
    rc, out, _ = _period(capsys, "--state", str(tmp_path / "ao.pt"))
    assert rc == 0 and "torchao fp8" in out
    # block-scaled E4M3: the grid estimate lands on the paper's FP8 rho-hat (43.3) within a few percent
    assert _number(out, "rho-hat") == pytest.approx(format_rho_hat("fp8_e4m3", 0.999), rel=0.05)


@pytest.mark.parametrize("fmt", ["int8_dynamic", "fp4", "fp8_e4m3", "bf16"])
def test_saved_state_reads_what_the_live_adapter_reads(tmp_path, fmt):
    """The saved-state reader and the live adapter use the same slot classes: same v values and spacing."""
    from lightning_stale.adapters import adapter_for
    from lightning_stale.adapters.saved_state import load_v_sample
    from lightning_stale.optim import QuantizedAdamW

    params = [torch.nn.Parameter(torch.randn(64, 130)), torch.nn.Parameter(torch.randn(1001))]  # odd: fp4 padding
    opt = QuantizedAdamW(params, state_format=fmt, min_quantized_size=256)
    _train(opt, params, steps=3)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    values, spacing, _, described = load_v_sample(str(tmp_path / "opt.pt"))
    live = [s for s in adapter_for(opt).slots() if s.moment == "v"]
    expected_values = torch.cat([s.value().reshape(-1) for s in live])
    expected_spacing = torch.cat([s.spacing().reshape(-1) for s in live])
    n = expected_values.numel()  # an odd fp4 tensor adds one padding element to the saved codes
    assert described == f"QuantizedAdamW {fmt}" and values.numel() - n in ((0, 1) if fmt == "fp4" else (0,))
    keep = torch.ones(values.numel(), dtype=torch.bool)
    if values.numel() > n:
        keep[64 * 130 + 1001] = False  # the padding element follows the odd tensor's last code
    torch.testing.assert_close(values[keep], expected_values, rtol=0, atol=0)
    torch.testing.assert_close(spacing[keep], expected_spacing, rtol=0, atol=0)


@pytest.mark.parametrize(("argv", "said"), [
    (("--format", "fp8_e4m3"), ["made the loss worse in every seed, +0.013 [+0.006, +0.020]",
                                "do not support resets of both moments on this storage"]),
    (("--format", "bf16"), ["resets were not measured", "-0.013 [-0.020, -0.005]"]),
    (("--format", "fp4"), ["v's resolution, not its staleness"]),
    (("--format", "int8_dynamic"), ["stale but harmless", "-0.010 [-0.021, +0.000]"]),
    (("--format", "fp16"), ["nothing was measured on this storage"]),
])
def test_period_says_in_plain_words_what_the_measurements_here_say_about_resets(capsys, argv, said):
    rc, out, _ = _period(capsys, *argv)
    assert rc == 0
    flat = " ".join(out.split())
    assert "measured here (BENCHMARKS.md" in flat and all(s in flat for s in said), out
    assert "paid on no storage measured" in flat and "K* is the theory's period, not a measured gain" in flat
    assert "recommended" not in out and "P_init" not in out and "horizon" not in out  # no jargon, no advice
    assert "what these mean:" in out and "rho-hat: how coarse the storage grid is" in out
    assert "the theory's reset period K* (s0 = 0.6):" in out


def test_period_words_a_v_that_stops_following_the_gradients(capsys):
    rc, out, _ = _period(capsys, "--format", "fp8_e4m3")
    assert rc == 0 and re.search(r"v averages over \(nearest\)\s+3\.6e\+13 steps \(fp32: 1,000 steps\): in this model "
                                 r"v practically stops following new gradients", out), out
    rc, out, _ = _period(capsys, "--format", "bf16", "--rounding", "stochastic")
    assert re.search(r"v averages over \(stochastic\)\s+5,7\d\d steps \(fp32: 1,000 steps\)\n", out), out
