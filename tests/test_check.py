"""`fastgrpo check`: the kernel checks under Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU),
a broken kernel failing the run by name, the CPU run of a machine without CUDA, the timings' ratios."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastgrpo.check import command, kernels, timings
from fastgrpo.cli import main

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DIR = Path(kernels.__file__).parents[1] / "kernels"


def _check(tmp_path, *args) -> tuple[int, list[dict]]:
    """`fastgrpo check <args>` in this process: (exit code, the JSON file's rows)."""
    code = 0
    try:
        main(["check", *args, "--out-dir", str(tmp_path)])
    except SystemExit as exit:
        code = exit.code
    (path,) = sorted(tmp_path.glob("check-*.json"))[-1:]
    return code, json.loads(path.read_text())["rows"]


# Each @triton.jit entry kernel of fastgrpo/kernels and the launcher `fastgrpo check` calls it through: a new kernel
# fails this test until the check covers it.
LAUNCHERS = {"_logit_row_stats_kernel": "logit_row_stats", "_logit_row_grad_kernel": "logit_row_grad",
             "_paged_attention_kernel": "paged_attention", "_add_rms_norm_kernel": "add_rms_norm",
             "_rope_store_kernel": "rope_store", "_silu_mul_kernel": "silu_mul", "_tile_stats_kernel": "fused_sample",
             "_pick_kernel": "fused_sample"}


def test_every_triton_kernel_is_checked():
    source = "".join(p.read_text() for p in KERNEL_DIR.glob("*.py"))
    assert set(re.findall(r"@triton\.jit\ndef (_\w+_kernel)\(", source)) == set(LAUNCHERS)
    assert set(LAUNCHERS.values()) == set(kernels.KERNELS)
    checked = {kernel for kernel, _, _ in kernels.cases(torch.device("cpu"), kernels.REAL, fp8=True)}
    assert checked == set(kernels.KERNELS)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's sizes (a GPU runs tests/test_cuda.py)")
def test_kernel_checks_pass_in_the_interpreter(tmp_path, capsys):
    code, rows = _check(tmp_path, "--only", "kernels")
    out = capsys.readouterr().out
    assert code == 0, out
    passed = [r for r in rows if r["status"] == "PASS"]
    assert {r["kernel"] for r in passed} == set(kernels.KERNELS)
    assert len(passed) == len(kernels.cases(torch.device("cpu"), kernels.INTERPRETED, fp8=False))
    assert all(0 <= r["worst_error"] <= r["limit"] for r in passed)
    assert [r["name"] for r in rows if r["status"] == "SKIP"] == ["paged_attention and rope_store on fp8 pages"]
    assert "Triton's interpreter (TRITON_INTERPRET=1)" in out and "no CUDA device" not in out
    md = next(tmp_path.glob("check-*.md")).read_text()
    assert "| logit_row_stats fp32 [7 x 4099] | PASS |" in md


@pytest.mark.skipif(not INTERPRETED, reason="runs the kernels in the interpreter")
def test_a_broken_kernel_fails_the_run_by_name(tmp_path, monkeypatch, capsys):
    """logp off by 1e-3 in one row kernel, silu_mul raising: both FAIL by name, every other kernel PASSes, exit 1."""
    from fastgrpo.kernels import decode_ops, logit_rows

    real = logit_rows.logit_row_stats

    def off(z, ids, *, softcap=None):
        lse, logp, entropy = real(z, ids, softcap=softcap)
        return lse, logp + 1e-3, entropy

    def raises(gate_up):
        raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(logit_rows, "logit_row_stats", off)
    monkeypatch.setattr(decode_ops, "silu_mul", raises)
    with pytest.raises(SystemExit) as exit:
        main(["check", "--only", "kernels", "--out-dir", str(tmp_path)])
    message = str(exit.value.code)
    assert message.startswith("fastgrpo check: 3 of ") and "checks failed: logit_row_stats fp32 [7 x 4099];" in message
    assert "silu_mul fp32" in message
    out = capsys.readouterr().out
    assert re.search(r"FAIL  logit_row_stats fp32 \[7 x 4099\]: worst error 1\.0\d*e-03, limit", out), out
    assert "FAIL  silu_mul fp32 [5 x 2 x 1100]: RuntimeError: an illegal memory access was encountered" in out
    rows = json.loads(next(tmp_path.glob("check-*.json")).read_text())["rows"]
    broken = {"logit_row_stats", "silu_mul"}
    assert {r["kernel"] for r in rows if r["status"] == "FAIL"} == broken
    assert {r["kernel"] for r in rows if r["status"] == "PASS"} == set(kernels.KERNELS) - broken


@pytest.mark.skipif(not INTERPRETED, reason="runs the kernels in the interpreter")
def test_a_sampler_that_draws_another_token_fails(tmp_path, monkeypatch):
    from fastgrpo.kernels import sampling

    real = sampling.fused_sample

    def shifted(logits, temperature, u, kth=None):
        tokens, logprobs = real(logits, temperature, u, kth)
        return (tokens + 1) % logits.shape[1], logprobs

    monkeypatch.setattr(sampling, "fused_sample", shifted)
    code, rows = _check(tmp_path, "--only", "kernels")
    assert code != 0
    failed = [r for r in rows if r["status"] == "FAIL"]
    assert {r["kernel"] for r in failed} == {"fused_sample"} and len(failed) == 3
    assert "greedy tokens differ from torch.argmax in 16 of 16 rows" in failed[0]["detail"]
    assert "not at a cdf step between them" in failed[1]["detail"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_checks_pass(tmp_path):
    """On a GPU: every kernel at real shapes, the engine (CUDA graphs, fused layers), a loss step, all PASS."""
    code, rows = _check(tmp_path, "--only", "kernels", "engine", "loss")
    assert code == 0, [r["detail"] for r in rows if r["status"] == "FAIL"]
    assert {r["kernel"] for r in rows if r["status"] == "PASS" and "kernel" in r} == set(kernels.KERNELS)
    assert any(r["name"] == "CUDA graphs captured and replayed" and r["status"] == "PASS" for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_machine_without_cuda_runs_the_cpu_checks(tmp_path):
    """`python -m fastgrpo check` without CUDA and without the interpreter: one line says so, the kernels are skipped,
    the engine, a loss step and a `fastgrpo train` step pass, exit 0 (the timings: test_timings_are_ratios)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "fastgrpo", "check", "--only", "kernels", "engine", "loss", "train",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert sum(line.startswith("no CUDA device") for line in lines) == 1
    assert sum("SKIP" in line for line in lines) == len(kernels.KERNELS)
    assert sum("PASS" in line for line in lines) == 4, done.stdout  # greedy, sampled logprobs, loss, train
    assert re.search(r"PASS  one `fastgrpo train` step: .*loss -?\d", done.stdout)
    assert len(list(tmp_path.glob("check-cpu-*.md"))) == 1


@pytest.mark.slow
def test_timings_are_ratios(tmp_path, monkeypatch, capsys):
    """The timings section on tiny sizes: each benchmark a ratio measured in this run, no failure."""
    tiny = timings.Plan(("cpu-h64-v4096",), (256,), ("fastgrpo", "floor", "trl"), 2, 1, "negligible", 4, 8, 4,
                        dict(shape="negligible", prompts=2, group_size=2, prompt_len=8, max_new_tokens=8))
    monkeypatch.setitem(timings.PLANS, ("cpu", "quick"), tiny)
    results = list(command.timing_results(torch.device("cpu"), "quick"))
    assert [r.status for r in results] == ["PASS"] * 3, [r.line() for r in results]
    loss, decode, sampling = results
    for mode in ("loss step", "no-grad logprobs"):
        assert re.search(mode + r" cpu-h64-v4096 N=256 fp32: [\d.]+ ms, / floor [\d.]+, / TRL [\d.]+", loss.detail)
    assert decode.values["step_ms"] > 0 and decode.values["vs_floor"] == pytest.approx(
        decode.values["step_ms"] / decode.values["floor_ms"])
    assert re.search(r"negligible fp32, 2 x 2, prompt 8, 8 new tokens: \d+ vs \d+ tokens/s, [\d.]+x HF generate",
                     sampling.detail)


def test_cuda_only_options_are_refused_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit, match="^fastgrpo check: --device cuda: no CUDA device is available$"):
        main(["check", "--device", "cuda", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--out-dir .* must be a folder"):
        main(["check", "--out-dir", str(Path(__file__))])


def test_a_check_that_raises_fails_and_the_next_sections_run(tmp_path, monkeypatch, capsys):
    from fastgrpo.check import end_to_end

    def engine_checks(device):
        yield "greedy = HF generate (fp32)", "6 prompts", True
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")

    monkeypatch.setattr(end_to_end, "engine_checks", engine_checks)
    code, rows = _check(tmp_path, "--only", "engine", "loss")
    assert code == "fastgrpo check: 1 of 3 checks failed: engine end to end"
    assert [(r["section"], r["status"]) for r in rows] == [("engine", "PASS"), ("engine", "FAIL"), ("loss", "PASS")]
    assert re.match(r"RuntimeError: CUDA error: an illegal memory access was encountered \(test_check\.py:\d+\)$",
                    rows[1]["detail"])


def test_a_failed_cuda_context_skips_the_checks_of_this_process(monkeypatch):
    """After an illegal access every CUDA call of the process fails: one FAIL names the check it followed, the
    in-process sections say skipped, and the checks run in child processes still run."""
    def poisoned(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", poisoned)
    monkeypatch.setattr(command, "LOST", [])
    lost = command._release(torch.device("cuda"), "kernels", "paged_attention bf16 decode")
    assert lost.status == "FAIL" and lost.name == "the CUDA context, after paged_attention bf16 decode"
    assert lost.detail.startswith("RuntimeError: CUDA error: an illegal memory access was encountered")
    for section in command.IN_PROCESS:
        (skipped,) = command._section(section, torch.device("cuda"), "quick")
        assert (skipped.status, skipped.detail) == ("SKIP", "the CUDA context failed after paged_attention bf16 decode")
    assert command._release(torch.device("cuda"), "kernels", "later") is None  # reported once


def test_a_failing_peer_is_skipped_and_fastgrpos_failure_fails(monkeypatch):
    row = dict(head="qwen2.5-1.5b", tokens=8192, dtype="bf16", mode="full", seconds=0.05, time_vs_floor=1.2)
    rows = [{**row, "method": "fastgrpo", "time_vs_trl": 0.9}, {**row, "method": "floor"},
            {**row, "method": "liger", "error": "OutOfMemoryError: CUDA out of memory"}]
    monkeypatch.setattr(timings, "loss_rows", lambda device, plan: (rows, ["trl: skipped, trl is not installed"]))
    monkeypatch.setattr(timings, "decode_step", lambda device, plan: 1 / 0)
    monkeypatch.setattr(timings, "sampling_rows", lambda device, plan: [{"method": "fastgrpo", "error": "boom"}])
    results = list(command.timing_results(torch.device("cpu"), "quick"))
    assert [(r.name, r.status) for r in results] == [
        ("loss and logprobs vs the 3-GEMM floor and TRL", "PASS"), ("loss timings' trl method", "SKIP"),
        ("loss timings' liger method", "SKIP"), ("decode step vs its bytes floor", "FAIL"),
        ("sampling tokens/s vs HF generate", "FAIL")]
    assert results[0].detail == "loss step qwen2.5-1.5b N=8192 bf16: 50.00 ms, / floor 1.20, / TRL 0.90"
    assert results[2].detail == "qwen2.5-1.5b N=8192 full: OutOfMemoryError: CUDA out of memory"
    assert results[3].detail.startswith("ZeroDivisionError: division by zero")
    rows[0]["error"] = "RuntimeError: Triton compile failed"
    assert next(command.timing_results(torch.device("cpu"), "quick")).status == "FAIL"
