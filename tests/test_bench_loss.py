"""Smoke tests of the loss benchmark (fastgrpo/bench/loss.py): it runs, writes its results files, and every method
computes the same loss as the reference on the same inputs (never a timed assertion)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastgrpo.bench.loss import FLOORS, GEMMS, HEADS, Case, flop_count, main, valid_tokens

ROOT = str(Path(__file__).resolve().parents[1])  # run the checkout's fastgrpo in the child, not an installed one


def bench(*args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    return subprocess.run([sys.executable, "-m", "fastgrpo.bench.loss", *args], capture_output=True, text=True,
                          cwd=cwd, env=env)


def close(value, expected, rel):
    return abs(value - expected) <= rel * abs(expected) + 1e-6


@pytest.mark.slow
def test_bench_loss_tiny_writes_results_and_agrees_with_reference(tmp_path):
    pytest.importorskip("matplotlib")
    methods = ["fastgrpo", "reference", "torch_lce", *FLOORS] + (["trl"] if _installed("trl") else [])
    out = bench("--device", "cpu", "--heads", "cpu-h64-v4096", "--tokens", "80", "--beta", "0", "0.04",
                "--repeats", "1", "--warmup", "0", "--threads", "1", "--methods", *methods, "liger",
                "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (json_path,) = tmp_path.glob("loss-*.json")
    (md_path,) = tmp_path.glob("loss-*.md")
    (png_path,) = tmp_path.glob("loss-*.png")
    assert png_path.stat().st_size > 0
    rows = json.loads(json_path.read_text())["rows"]
    for row in rows:
        assert "error" not in row, row
        assert row["rounds"] == 1
        assert row["seconds"] > 0 and row["peak_bytes"] is not None and row["flops"] == flop_count(
            row["method"], row["mode"], Case(row["head"], row["tokens"], row["beta"], row["mode"]))
        for key in ("device", "torch", "transformers", "date", "dtype", "hidden_size", "vocab_size", "tokens"):
            assert row[key] is not None, key
    # 3 modes x 2 betas per loss method, 3 modes per floor (no loss, so no beta)
    liger_installed = _installed("liger_kernel")
    loss_methods = [m for m in methods if m not in FLOORS] + (["liger"] if liger_installed else [])
    assert sorted(r["method"] for r in rows) == sorted(loss_methods * 6 + [*FLOORS] * 3)
    assert liger_installed or "liger: skipped, liger_kernel is not installed" in md_path.read_text()
    reference = {(r["beta"], r["mode"]): r for r in rows if r["method"] == "reference"}
    for row in rows:
        if row["method"] in ("reference", *FLOORS):
            continue
        ref = reference[row["beta"], row["mode"]]
        # fp32 on a CPU: the chunked paths and the full-logit reference differ by summation order only (~1e-7
        # relative); 1e-5 leaves room for the vocab-chunked logsumexp and the fp32 gradient accumulation.
        if row["mode"] == "forward" and row["method"] == "liger":  # its loss: liger has no logprob API
            assert close(row["loss"], reference[row["beta"], "full"]["loss"], 1e-5), (row, ref)
        elif row["mode"] == "forward":
            assert close(row["mean_logp"], ref["mean_logp"], 1e-5), (row, ref)
        else:
            assert close(row["loss"], ref["loss"], 1e-5), (row, ref)
        if row["mode"] == "full":
            assert close(row["grad_hidden_norm"], ref["grad_hidden_norm"], 1e-4), (row, ref)
            assert close(row["grad_weight_norm"], ref["grad_weight_norm"], 1e-4), (row, ref)
        if row["method"] == "fastgrpo":
            assert row["time_vs_floor"] > 0 and row["time_vs_floor4"] > 0 and row["time_vs_reference"] > 0
            assert row["time_vs_linear"] > 0
            assert row["time_vs_torch_lce"] > 0
    assert "| fastgrpo |" in md_path.read_text() and "| floor |" in out.stdout


def test_rounds_interleave_the_methods_and_keep_each_cases_median(tmp_path, monkeypatch):
    """--rounds 3: A B, A B, A B (so a drifting machine slows every method alike); each case's row is the round of
    the median time."""
    from fastgrpo.bench import loss

    calls = []

    def fake_run(method, cases, settings):
        calls.append(method)
        seconds = {"fastgrpo": [3.0, 1.0, 2.0], "floor": [5.0, 6.0, 4.0]}[method][calls.count(method) - 1]
        return [{"method": method, **vars(c), "dtype": settings.dtype, "seconds": seconds, "peak_bytes": 1,
                 "flops": 1, "tflops": 1.0, "round": calls.count(method)} for c in cases]

    monkeypatch.setattr(loss, "run_isolated", fake_run)
    monkeypatch.setattr(loss, "plot", lambda rows, path: None)
    rows = loss.run(loss_args(tmp_path, "--rounds", "3", "--methods", "fastgrpo", "floor", "--modes", "full"))
    assert calls == ["fastgrpo", "floor"] * 3
    chosen = {row["method"]: (row["seconds"], row["round"], row["rounds"]) for row in rows}
    assert chosen == {"fastgrpo": (2.0, 3, 3), "floor": (5.0, 1, 3)}
    assert rows[[r["method"] for r in rows].index("fastgrpo")]["time_vs_floor"] == 2.0 / 5.0


def loss_args(tmp_path, *args):
    import argparse

    from fastgrpo.bench import loss

    parser = argparse.ArgumentParser()
    loss.add_arguments(parser)
    return parser.parse_args(["--device", "cpu", "--heads", "cpu-h64-v4096", "--tokens", "80", "--beta", "0.04",
                              "--out-dir", str(tmp_path), *args])


def test_bench_loss_flop_formulas():
    H, V = HEADS["qwen2.5-7b"]
    case = Case("qwen2.5-7b", 8192, 0.0, "full")
    nv = valid_tokens(8192)
    assert nv == 8 * (1024 - 102)  # the last 10% (rounded) of each of the 8 rows is masked
    # fastgrpo's gradient is computed in its forward: 3 GEMMs, the floor's; the recomputing peers 4, floor4's
    assert flop_count("fastgrpo", "full", case) == 6 * nv * H * V == flop_count("floor", "full", case)
    assert flop_count("trl", "full", case) == 8 * nv * H * V == flop_count("floor4", "full", case)
    assert flop_count("torch_lce", "full", case) == 8 * nv * H * V
    assert flop_count("fastgrpo", "backward", case) == 0
    assert flop_count("reference", "full", case) == 6 * 8192 * H * V
    assert flop_count("floor", "forward", Case("qwen2.5-7b", 8192, None, "forward")) == 2 * nv * H * V
    assert set(GEMMS) == {"fastgrpo", "reference", "trl", "torch_lce", "liger", "floor", "floor4", "linear"}
    assert GEMMS["linear"] == GEMMS["floor"]


def test_bench_loss_floors_compute_the_same_logits(monkeypatch):
    """The floors' vocab blocks on a CPU (several here) form the bare linear layer's z, and their GEMMs' results."""
    import torch

    from fastgrpo import chunked
    from fastgrpo.bench.loss import Settings, _blocked_gemm, floor_backward, floor_logits, make_inputs

    monkeypatch.setattr(chunked, "CPU_BLOCK_BYTES", 1)  # blocks of 128 columns
    inp = make_inputs(Case("cpu-h64-v4096", 80, 0.0, "full"), Settings("cpu", "fp32", 1, 0, 1))
    z = floor_logits(inp, "linear")
    assert torch.allclose(floor_logits(inp), z, rtol=1e-6, atol=1e-6)
    assert torch.allclose(_blocked_gemm(inp), z[:, -128:], rtol=1e-6, atol=1e-6)
    for got, want in zip(floor_backward(inp), floor_backward(inp, z, "linear"), strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--tokens", "5"], "--tokens must be >= 10"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--beta", "-0.1"], "--beta must be a finite number >= 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--heads", "gpt-5"], "invalid choice: 'gpt-5'"),
    (["--modes", "sideways"], "invalid choice: 'sideways'"),
])
def test_bench_loss_rejects_bad_arguments(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", *args, "--out-dir", str(tmp_path)])
    assert exit_info.value.code != 0
    assert message in str(exit_info.value.code) + capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _installed(package):
    import importlib.util

    return importlib.util.find_spec(package) is not None


def test_fastgrpo_bench_without_a_suite_runs_the_loss_suite(monkeypatch):
    from fastgrpo import cli
    from fastgrpo.bench import loss

    seen = []
    monkeypatch.setattr(loss, "run", lambda args: seen.append((args.suite, args.quick)))
    cli.main(["bench", "--quick"])
    assert seen == [("loss", True)]
