"""Every Triton kernel builds ahead of time for sm_90 and sm_80 with the launchers' own settings: the GEMM kernels
use tensor cores (wgmma on sm_90, mma on sm_80) and no kernel spills registers. The interpreter proves the math;
this proves the kernels are real for the GPUs they target. Run with -s to see the resource report."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from aot import DECODE_KERNELS, FP8_KV_KERNELS, GEMM_KERNELS, KERNELS, ROW_DTYPES, VECTOR_LOADS

NAMES = tuple(name for name in KERNELS if name not in FP8_KV_KERNELS)
CASES = [(name, dtype, cc) for name in NAMES for dtype in (("bf16", "fp16", "fp32") if name in GEMM_KERNELS else
                                                             ("bf16", "fp32") if name in DECODE_KERNELS else
                                                             ("bf16",)) for cc in (90, 80)]
CASES = [case for case in CASES if case[0] not in ROW_DTYPES] + [
    (name, dtype, cc) for name, dtypes in ROW_DTYPES.items() for dtype in dtypes for cc in (90, 80)]
# fp8 pages: a bf16 model on sm_90 (sm_80 has no e4m3: Triton refuses fp8e4nv there, and so does the engine)
CASES += [(name, "bf16", 90) for name in FP8_KV_KERNELS]
ATTENTION = ("paged_attention_decode", "paged_attention_prefill", "paged_attention_decode_fp8kv",
             "paged_attention_prefill_fp8kv")

# One subprocess builds every kernel for both GPU targets (~17 s on a 2-core CPU) before any test here runs.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def builds():
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # conftest turns the interpreter on for the other tests
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "aot.py"), json.dumps(CASES)],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return {(r["name"], r["dtype"], r["cc"]): r for r in json.loads(out.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("name,dtype,cc", CASES)
def test_kernel_builds_for_gpu(builds, name, dtype, cc):
    b = builds[(name, dtype, cc)]
    print(f"\n{name:24s} {dtype} sm_{cc}: {b['registers']} registers, {b['shared_bytes']} B shared, "
          f"spills {b['spill_stores']}/{b['spill_loads']} B (stores/loads), tensor cores: {b['tensor_cores']}, "
          f"16-byte loads/stores: {b['vector_loads']}/{b['vector_stores']}")
    if name in ATTENTION and dtype != "fp32":  # fp32 "ieee" products run on the FMA units by design
        assert b["tensor_cores"], f"{name} does not use tensor cores on sm_{cc}"
        if cc == 90 and dtype == "bf16" and "decode" not in name:  # wgmma needs M >= 64; decode has 16
            assert b["wgmma_bf16"], "expected bf16 wgmma on sm_90"
    assert b["spill_stores"] == 0 and b["spill_loads"] == 0, b["ptxas_report"]
    if name in VECTOR_LOADS:  # memory-bound passes: 16-byte loads (and stores) of their rows
        assert b["vector_loads"] > 0, f"{name} {dtype} sm_{cc}: no ld.global.v4 in its PTX"
        no_row_store = ("logit_row_stats", "sample_tile_stats")
        assert name in no_row_store or b["vector_stores"] > 0, f"{name}: no st.global.v4 in its PTX"


@pytest.mark.parametrize("dtype,cc", [(dtype, cc) for dtype in ("bf16", "fp16") for cc in (90, 80)])
def test_decode_attention_loads_one_kv_tile_for_the_whole_group(builds, dtype, cc):
    """GQA: a decode program holds every query head of its KV head (BLOCK_M >= GROUP rows), and its PTX copies one
    K tile and one V tile per step of the KV loop (16-byte cp.async, once per pipeline stage): each KV page is read
    once per KV head, not once per query head. tests/test_paged_attention.py counts the programs."""
    b = builds[("paged_attention_decode", dtype, cc)]
    consts = b["constexprs"]
    assert consts["BLOCK_M"] >= consts["GROUP"] > 1
    tile_bytes = consts["BLOCK_N"] * consts["BLOCK_D"] * 2  # one K (or V) tile, 2-byte elements
    copies_per_stage = 2 * tile_bytes // (b["num_warps"] * 32 * 16)  # K and V, 16 bytes per thread and copy
    assert b["async_copies_16b"] == copies_per_stage * b["num_stages"], b["async_copies_16b"]


@pytest.mark.parametrize("name", list(FP8_KV_KERNELS))
def test_fp8_kv_kernels_convert_e4m3_in_hardware(builds, name):
    """kv_cache_dtype="fp8" on sm_90: rope_store rounds K/V to e4m3 with the saturating round-to-nearest-even
    conversion (cvt.rn.satfinite.e4m3x2.f32 -> SASS F2FP.SATFINITE.E4M3), which the torch path's clamp to +-448 and
    .to(float8_e4m3fn) reproduce; paged attention widens e4m3 pages on load (cvt.rn.f16x2.e4m3x2 -> F2FP.F16.E4M3,
    then exactly to bf16) for bf16 tensor-core products; neither spills (test_kernel_builds_for_gpu)."""
    b = builds[(name, "bf16", 90)]
    print(f"\n{name}: PTX {b['ptx_e4m3']}, SASS {b['sass_e4m3']}")
    if name.startswith("rope_store"):
        assert b["ptx_e4m3"] == ["cvt.rn.satfinite.e4m3x2.f32"]
        assert any(op.startswith("F2FP.SATFINITE.E4M3.F32") for op in b["sass_e4m3"]), b["sass_e4m3"]
    else:
        assert b["ptx_e4m3"] == ["cvt.rn.f16x2.e4m3x2"]
        assert any(op.startswith("F2FP.F16.E4M3") for op in b["sass_e4m3"]), b["sass_e4m3"]


def test_fp8_decode_attention_copies_half_the_kv_bytes(builds):
    """A decode program's global -> shared copies of K and V (cp.async, every pipeline stage) hold half the bytes
    over fp8 pages that they hold over bf16 ones, at the same tiles: decode reads half the KV bytes."""
    bf16, fp8 = builds[("paged_attention_decode", "bf16", 90)], builds[("paged_attention_decode_fp8kv", "bf16", 90)]
    consts = bf16["constexprs"]
    assert {k: v for k, v in fp8["constexprs"].items() if k != "KV_SCALED"} == {
        k: v for k, v in consts.items() if k != "KV_SCALED"} and fp8["num_stages"] == bf16["num_stages"]
    threads = bf16["num_warps"] * 32
    kv_tiles_bytes = 2 * consts["BLOCK_N"] * consts["BLOCK_D"] * bf16["num_stages"]  # K and V, per byte of element
    assert bf16["async_copy_bytes"] * threads == 2 * kv_tiles_bytes
    assert fp8["async_copy_bytes"] * threads == kv_tiles_bytes
