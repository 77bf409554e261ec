"""Smoke tests of the whole-step benchmark (fastgrpo/bench/step.py): both trainers run a quick step end to end, their
phases add up to the step, and the completions stop at different lengths (never a timed assertion)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("trl")

PHASES = ("sampling_seconds", "rewards_seconds", "logprobs_seconds", "update_seconds")


def bench(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastgrpo.bench.step", *args], capture_output=True, text=True,
                          cwd=cwd)


@pytest.mark.slow
def test_bench_step_quick_runs_both_trainers(tmp_path):
    out = bench("--quick", "--device", "cpu", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (json_path,) = tmp_path.glob("step-*.json")
    (md_path,) = tmp_path.glob("step-*.md")
    rows = json.loads(json_path.read_text())["rows"]
    assert [row["method"] for row in rows] == ["trl", "fastgrpo"]
    for row in rows:
        assert "error" not in row, row
        assert len(row["steps"]) == 2, "one warm-up step and one timed step"
        total, phases = row["total_seconds"], [row[key] for key in PHASES]
        assert all(seconds >= 0 for seconds in phases), row
        assert row["sampling_seconds"] > 0 and row["update_seconds"] > 0, row
        # other = the step's remaining bookkeeping (step metrics, the HF loop between micro-batches): a sliver
        assert 0.9 * total <= sum(phases) <= total + 1e-9, row
        assert abs(sum(phases) + row["other_seconds"] - total) < 1e-9, row
        # beta 0, one iteration, one optimizer step per round: neither trainer computes old or reference logprobs
        assert row["logprobs_seconds"] < 0.05 * total, row
        n, cap = row["prompts"] * row["group_size"], row["max_new_tokens"]
        assert row["generated_tokens"] == round(row["mean_length"] * n), row
        # the raised EOS row stops completions early, at different lengths
        assert 1 <= row["min_length"] < row["max_length"] <= cap, row
        assert row["clipped_ratio"] < 1 and row["peak_bytes"] > 0, row
        for key in ("device", "torch", "transformers", "trl", "date", "shape", "dtype", "total_vs_trl",
                    "sampling_vs_trl", "update_vs_trl", "peak_vs_trl"):
            assert row[key] is not None, key
    assert rows[0]["total_vs_trl"] == 1.0
    table = md_path.read_text()
    assert "| trl |" in table and "| fastgrpo |" in table and "| fastgrpo |" in out.stdout


def test_bench_step_rejects_bad_arguments(tmp_path):
    out = bench("--quick", "--micro-batch", "3", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode != 0 and "--micro-batch must divide the 8 completions" in out.stderr
    out = bench("--group-size", "1", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode != 0 and "--group-size must be >= 2" in out.stderr
    out = bench("--eos-every", "1", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode != 0 and "--eos-every must be > 1" in out.stderr
    assert not list(tmp_path.iterdir())
