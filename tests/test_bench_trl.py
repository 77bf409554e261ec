"""Smoke tests of the TRL step benchmark (fastgrpo/bench/trl_step.py): it runs and writes its results files (never a
timed assertion)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("trl")


def bench(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastgrpo.bench.trl_step", *args], capture_output=True, text=True,
                          cwd=cwd)


@pytest.mark.slow
def test_bench_trl_quick_writes_results(tmp_path):
    out = bench("--quick", "--device", "cpu", "--threads", "1", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (json_path,) = tmp_path.glob("trl-step-*.json")
    (md_path,) = tmp_path.glob("trl-step-*.md")
    rows = json.loads(json_path.read_text())["rows"]
    assert [row["method"] for row in rows] == ["trl", "fastgrpo"]
    for row in rows:
        assert "error" not in row, row
        assert row["tokens"] == 2 * 16 and row["logprobs_seconds"] > 0 and row["step_seconds"] > 0
        for key in ("device", "torch", "transformers", "date", "dtype", "shape", "logprobs_peak_bytes",
                    "step_peak_bytes", "step_speedup_vs_trl"):
            assert row[key] is not None, key
    # Same model, inputs and fp32 math: the two trainers' losses agree to rounding (see tests/test_trl_trainer.py).
    trl_row, fast_row = rows
    assert abs(fast_row["loss"] - trl_row["loss"]) <= 1e-5 * abs(trl_row["loss"]) + 1e-6, rows
    assert abs(fast_row["mean_logp"] - trl_row["mean_logp"]) <= 1e-5 * abs(trl_row["mean_logp"]), rows
    assert "| fastgrpo |" in md_path.read_text() and "| trl |" in out.stdout


def test_bench_trl_rejects_bad_arguments(tmp_path):
    out = bench("--completions", "1", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode != 0 and "--completions must be >= 2" in out.stderr
    out = bench("--repeats", "0", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode != 0 and "--repeats must be >= 1" in out.stderr
    assert not list(tmp_path.iterdir())
