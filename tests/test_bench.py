"""`fastgrpo bench` smoke tests: the suites run and write their results files (never a timed assertion)."""

import json
import subprocess
import sys

import pytest


def fastgrpo(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastgrpo", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.slow
def test_bench_sampling_quick_writes_results(tmp_path):
    out = fastgrpo("bench", "sampling", "--quick", "--device", "cpu", "--methods", "fastgrpo", "hf_generate",
                   "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (json_path,) = tmp_path.glob("sampling-*.json")
    (md_path,) = tmp_path.glob("sampling-*.md")
    results = json.loads(json_path.read_text())
    assert [row["method"] for row in results["rows"]] == ["fastgrpo", "hf_generate"]
    for row in results["rows"]:
        assert "error" not in row, row
        assert row["generated_tokens"] == 2 * 4 * 16 and row["tokens_per_s"] > 0 and row["peak_memory_bytes"] >= 0
        for key in ("device", "torch", "transformers", "date", "dtype", "shape", "prompt_len"):
            assert row[key], key
    assert "| fastgrpo |" in md_path.read_text() and "| fastgrpo |" in out.stdout


def test_bench_rejects_bad_arguments(tmp_path):
    out = fastgrpo("bench", "sampling", "--prompts", "0", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode != 0 and "--prompts must be >= 1" in out.stderr
    out = fastgrpo("bench", "nosuchsuite", cwd=tmp_path)
    assert out.returncode == 2 and "invalid choice" in out.stderr
    assert not list(tmp_path.iterdir())
