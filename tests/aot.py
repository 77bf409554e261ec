"""Ahead-of-time builds of the Triton kernels for real GPUs, on a machine without one.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` lowers a kernel to PTX and a cubin for the given
compute capability; `ptxas-blackwell -v` (shipped in triton's wheel, it reads the newest PTX versions) reports
registers, shared memory and spills of the PTX; `cuobjdump -sass` (also in the wheel) lists the cubin's instructions.
"""

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fastgrpo.kernels import decode_ops, logit_rows, paged_attention, sampling

# Sizes the JIT also sees as multiples of 16 in real models (hidden, intermediate and vocabulary sizes).
ALIGNED_SIZES = ("H", "V", "width")

# The builds need real JIT functions: this module runs as its own process, without TRITON_INTERPRET.
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_PTXAS = os.path.join(_BIN, "ptxas-blackwell")
if not os.path.exists(_PTXAS):  # (triton < 3.6 ships one ptxas)
    _PTXAS = os.path.join(_BIN, "ptxas")


@dataclass
class Build:
    ptx: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    ptxas_report: str
    cubin: bytes

    def uses_tensor_cores(self, cc: int) -> bool:
        # sm_90 runs tiles of M >= 64 on wgmma; smaller tiles (decode attention) on mma.sync, still tensor cores.
        return "wgmma.mma_async" in self.ptx or "mma.sync" in self.ptx if cc >= 90 else "mma.sync" in self.ptx


def build(fn, signature: dict, constexprs: dict, cc: int, num_warps: int, num_stages: int) -> Build:
    """Compile `fn` for sm_<cc> and read its resource usage from ptxas."""
    # The JIT marks pointers and int arguments that are multiples of 16 (strides of real models) as such, which
    # lets loads vectorize; do the same for pointers and strides here.
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, ty in signature.items()
               if ty.startswith("*") or name.startswith("stride") or name in ALIGNED_SIZES}
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned),
        target=GPUTarget("cuda", cc, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx = compiled.asm["ptx"]
    arch = "sm_90a" if cc == 90 else f"sm_{cc}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([_PTXAS, "-v", f"--gpu-name={arch}", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True)
    finally:
        os.unlink(f.name)
    report = out.stdout + out.stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return Build(ptx=ptx, registers=regs, spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
                 shared_bytes=compiled.metadata.shared, ptxas_report=report.strip(), cubin=compiled.asm["cubin"])


def sass_opcodes(cubin: bytes) -> list[str]:
    """The cubin's SASS instructions' opcodes (with their modifiers), in order."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                             check=True)
    finally:
        os.unlink(f.name)
    return re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", out.stdout)


# -- the shipped kernels, with their launchers' settings ------------------------------------------------------------

def attention(dt, decode: bool, fp8_kv: bool = False, group: int = 6, head_dim: int = 128, window: int = 0,
              softcap: bool = False, sinks: bool = False):
    """Paged attention with a Qwen2.5-1.5B head layout by default: 12 query heads on 2 KV heads (group 6), head_dim
    128; with fp8_kv, over float8_e4m3fn pages and their per-head scales (queries and output in `dt`). The variants
    (a sliding window, a softcap, sinks) with the head layouts of the models that have them."""
    kv = "fp8e4nv" if fp8_kv else dt
    sig = dict(q_ptr=f"*{dt}", k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}", out_ptr=f"*{dt}", block_tables_ptr="*i32",
               context_lens_ptr="*i32", query_starts_ptr="*i32", tile_seqs_ptr="*i32", tile_starts_ptr="*i32",
               k_scale_ptr="*fp32" if fp8_kv else "*i32", v_scale_ptr="*fp32" if fp8_kv else "*i32",
               sinks_ptr="*fp32" if sinks else "*i32", scale="fp32", softcap="fp32",
               **{name: "i32" for name in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb",
                                           "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
                                           "stride_bt")})
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    tiles = paged_attention.tiles_for(group, 1 if decode else 2, dtype, head_dim)
    consts = dict(BLOCK_SIZE=16, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=tiles.block_m,
                  BLOCK_N=tiles.block_n, DOT_PRECISION="tf32", KV_SCALED=fp8_kv, WINDOW=window, SOFTCAP=softcap,
                  SINKS=sinks)
    return paged_attention._paged_attention_kernel, sig, consts, tiles.num_warps, tiles.num_stages


KERNELS = {"paged_attention_decode": lambda dt: attention(dt, decode=True),
           "paged_attention_prefill": lambda dt: attention(dt, decode=False)}
# The variants with their models' head layouts: gpt-oss (64 query heads on 8 KV heads, head_dim 64, window 128,
# sinks), Gemma 2/3 (8 on 4, head_dim 256, window 1024 / 4096, a softcap for Gemma 2), Gemma 4's global layers
# (head_dim 512, no window).
VARIANT_KERNELS = {
    f"paged_attention_{phase}_{name}": (lambda dt, decode=phase == "decode", kw=kw: attention(dt, decode, **kw))
    for phase in ("decode", "prefill")
    for name, kw in (("gpt_oss", dict(group=8, head_dim=64, window=128, sinks=True)),
                     ("gemma2", dict(group=2, head_dim=256, window=4096, softcap=True)),
                     ("gemma4_global", dict(group=8, head_dim=512)))
}
KERNELS.update(VARIANT_KERNELS)
GEMM_KERNELS = ("paged_attention_decode", "paged_attention_prefill", *VARIANT_KERNELS)


def logit_row_stats(_dt):
    """The row statistics over fp32 logits (z is fp32 only), softcap on."""
    sig = dict(Z="*fp32", Ids="*i64", Out="*fp32", C="i32", V="i32", stride_z="i32", softcap="fp32")
    block_v, warps = logit_rows.STATS_TILE
    consts = dict(HAS_SOFTCAP=True, BLOCK_V=block_v, VEC=logit_rows._VEC)
    return logit_rows._logit_row_stats_kernel, sig, consts, warps, 1


def logit_row_grad(dt):
    """The logit gradient over fp32 logits, written in `dt` (fp32: in place), softcap and entropy term on."""
    sig = dict(Z="*fp32", Ids="*i64", Lse="*fp32", Ent="*fp32", G="*fp32", Hgrad="*fp32", Out=f"*{dt}", V="i32",
               stride_z="i32", stride_out="i32", scale="fp32", softcap="fp32")
    block_v, warps = logit_rows.GRAD_TILE[{"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dt]]
    consts = dict(HAS_H=True, HAS_SOFTCAP=True, BLOCK_V=block_v)
    return logit_rows._logit_row_grad_kernel, sig, consts, warps, 1


KERNELS.update(logit_row_stats=logit_row_stats, logit_row_grad=logit_row_grad)
# The row kernels read fp32 logits: they build per output dtype, not for test_aot's bf16 default.
ROW_DTYPES = {"logit_row_stats": ("fp32",), "logit_row_grad": ("fp32", "bf16")}
# The attention variants build for the dtypes their models train in (bf16) and the tests' fp32.
ROW_DTYPES.update(dict.fromkeys(VARIANT_KERNELS, ("bf16", "fp32")))


# -- the decode step's elementwise kernels and the sampler (memory-bound: 16-byte accesses, no spills) --

def add_rms_norm(hidden):
    def kernel(dt):
        sig = dict(X=f"*{dt}", R=f"*{dt}", W=f"*{dt}", Out=f"*{dt}", ROut=f"*{dt}", stride_x="i32", stride_r="i32",
                   stride_o="i32", stride_ro="i32", H="i32", eps="fp32")
        consts = dict(HAS_RESIDUAL=True, BLOCK_H=triton.next_power_of_2(hidden))
        return decode_ops._add_rms_norm_kernel, sig, consts, decode_ops.norm_warps(hidden), 1
    return kernel


def rope_store(heads, kv_heads, qk_norm, fp8_kv=False):
    def kernel(dt):
        kv, scale = ("fp8e4nv", "fp32") if fp8_kv else (dt, dt)  # (the launcher's placeholder scale pointer: cos)
        sig = dict(QKV=f"*{dt}", Cos=f"*{dt}", Sin=f"*{dt}", QNormW=f"*{dt}", KNormW=f"*{dt}", Q=f"*{dt}",
                   KCache=f"*{kv}", VCache=f"*{kv}", Slots="*i64", KScale=f"*{scale}", VScale=f"*{scale}",
                   **{name: "i32" for name in ("stride_qkv", "stride_cos", "stride_sin", "stride_qt", "stride_qh",
                                               "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
                                               "stride_vh")}, eps="fp32")
        total = heads + 2 * kv_heads
        consts = dict(NUM_Q=heads, NUM_KV=kv_heads, HEAD_DIM=128, PAGE=16, HAS_QK_NORM=qk_norm, KV_SCALED=fp8_kv,
                      BLOCK_HEADS=triton.next_power_of_2(total))
        return decode_ops._rope_store_kernel, sig, consts, decode_ops.rope_warps(total, 128), 1
    return kernel


def silu_mul(dt):
    sig = dict(GU=f"*{dt}", Out=f"*{dt}", stride_gu="i32", stride_o="i32", width="i32")
    return decode_ops._silu_mul_kernel, sig, dict(BLOCK=decode_ops.SILU_BLOCK), 4, 1


def sample_tile_stats(dt):
    """Over the lm_head's logits (Qwen2.5's vocabulary: 75 tiles), temperature and top-k on."""
    sig = dict(Logits=f"*{dt}", TileMax="*fp32", TileSum="*fp32", TileArg="*i32", Kth="*fp32", stride_l="i32",
               V="i32", temperature="fp32")
    consts = dict(NUM_TILES=triton.cdiv(151936, sampling.BLOCK_V), SCALED=True, TOP_K=True,
                  BLOCK_V=sampling.BLOCK_V)
    return sampling._tile_stats_kernel, sig, consts, sampling.NUM_WARPS, 1


def sample_pick(dt):
    sig = dict(Logits=f"*{dt}", TileMax="*fp32", TileSum="*fp32", TileArg="*i32", Kth="*fp32", U="*fp64",
               Tokens="*i64", Logprobs="*fp32", stride_l="i32", V="i32", temperature="fp32")
    tiles = triton.cdiv(151936, sampling.BLOCK_V)
    consts = dict(NUM_TILES=tiles, BLOCK_T=triton.next_power_of_2(tiles), SCALED=True, TOP_K=True, GREEDY=False,
                  BLOCK_V=sampling.BLOCK_V)
    return sampling._pick_kernel, sig, consts, sampling.NUM_WARPS, 1


# Hidden sizes of Qwen2.5-1.5B and Llama-3-70B (the widest row the kernel is built for); head layouts of
# Qwen2.5-1.5B (12 on 2) and Qwen3-8B-like q/k norms at 32 on 8 heads.
DECODE_KERNELS = {"add_rms_norm_1536": add_rms_norm(1536), "add_rms_norm_8192": add_rms_norm(8192),
                  "rope_store_12_2": rope_store(12, 2, False), "rope_store_qk_norm_32_8": rope_store(32, 8, True),
                  "silu_mul": silu_mul, "sample_tile_stats": sample_tile_stats, "sample_pick": sample_pick}
KERNELS.update(DECODE_KERNELS)
# The sampler's one logits read must be 16-byte vectors; the pick kernel reads one tile of the row.
VECTOR_LOADS = ("logit_row_stats", "logit_row_grad", "add_rms_norm_1536", "add_rms_norm_8192", "rope_store_12_2",
                "rope_store_qk_norm_32_8", "silu_mul", "sample_tile_stats")

# kv_cache_dtype="fp8": the kernels that write (rope_store) and read (paged attention) e4m3 pages, for the GPUs with
# e4m3 conversions (sm_89+; the engine refuses Triton fp8 pages below). Model dtype bf16.
FP8_KV_KERNELS = {"paged_attention_decode_fp8kv": lambda dt: attention(dt, decode=True, fp8_kv=True),
                  "paged_attention_prefill_fp8kv": lambda dt: attention(dt, decode=False, fp8_kv=True),
                  "rope_store_12_2_fp8kv": rope_store(12, 2, False, fp8_kv=True),
                  "rope_store_qk_norm_32_8_fp8kv": rope_store(32, 8, True, fp8_kv=True)}
KERNELS.update(FP8_KV_KERNELS)
VECTOR_LOADS += ("rope_store_12_2_fp8kv", "rope_store_qk_norm_32_8_fp8kv")


# Bytes of each global -> shared async copy (cp.async, 4, 8 or 16 bytes); PTX conversions to or from e4m3.
_ASYNC_COPY_SIZE = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.\w+)* \[[^]]+\], \[[^]]+\], 0x([0-9a-f]+)")
_E4M3_CVT = re.compile(r"cvt(?:\.\w+)*\.e4m3\w*(?:\.\w+)*")


def build_all(cases):
    """cases: [(kernel name, dtype, cc)] -> [dict of resource usage], with fp32 GEMMs in exact ("ieee") mode."""
    results = []
    for name, dtype, cc in cases:
        fn, sig, consts, warps, stages = KERNELS[name](dtype)
        if dtype == "fp32" and name in GEMM_KERNELS:
            consts = {**consts, "DOT_PRECISION": "ieee"}
        b = build(fn, sig, consts, cc, warps, stages)
        results.append(dict(name=name, dtype=dtype, cc=cc, registers=b.registers, shared_bytes=b.shared_bytes,
                            spill_stores=b.spill_stores, spill_loads=b.spill_loads,
                            tensor_cores=b.uses_tensor_cores(cc),
                            wgmma_bf16="wgmma.mma_async.sync.aligned" in b.ptx and ".bf16" in b.ptx,
                            vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v4", b.ptx)),
                            vector_stores=len(re.findall(r"st\.global(?:\.\w+)*\.v4", b.ptx)),
                            async_copies_16b=len(re.findall(r"cp\.async\.cg\.shared\.global(?:\.\w+)* \[[^]]+\], "
                                                            r"\[[^]]+\], 0x10", b.ptx)),
                            async_copy_bytes=sum(int(size, 16) for size in _ASYNC_COPY_SIZE.findall(b.ptx)),
                            ptx_e4m3=sorted(set(_E4M3_CVT.findall(b.ptx))),
                            sass_e4m3=sorted({op for op in sass_opcodes(b.cubin) if "E4M3" in op})
                            if name in FP8_KV_KERNELS else [],
                            num_warps=warps, num_stages=stages, constexprs=consts,
                            ptxas_report=b.ptxas_report))
    return results


if __name__ == "__main__":
    import sys

    print(json.dumps(build_all(json.loads(sys.argv[1]))))
