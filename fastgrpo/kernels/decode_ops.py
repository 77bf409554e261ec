"""The elementwise passes of a Llama/Qwen2/Qwen3 decoder layer in the sampling engine, one kernel each.

Per token (one row), in the model dtype `dt`, rounding where transformers' modules round, so each kernel computes
what the chain of PyTorch ops it replaces computes (up to the order of the fp32 sum of squares):

    add_rms_norm   r = dt(x + residual);  y = dt(w * dt(r * rsqrt(mean(r^2) + eps)))            -> (y, r)
                   (without a residual: r = x)
    rope_store     qkv [T, (Hq + 2 Hkv) D] from one GEMM;  per head h of token t, with cos/sin [T, D]:
                       x = rms_norm(x) per head first if the model has q/k norms (Qwen3)
                       out = dt(dt(x * cos) + dt(rotate_half(x) * sin)),  rotate_half(x)_d = -x_{d+D/2} (d < D/2)
                                                                                           x_{d-D/2} (d >= D/2)
                   query heads -> q [T, Hq, D];  key heads -> k_cache[slot_t];  value heads copied to v_cache[slot_t]
                   fp8 caches (float8_e4m3fn) take e4m3(clamp(k / k_scale_g, +-448)), v likewise, one power-of-two
                   scale per KV head g (exact division): what attention.store_kv writes
    silu_mul       gate_up [T, 2I] from one GEMM -> dt(dt(silu(gate)) * up)  [T, I]

Bytes per token (2-byte dtype): add_rms_norm reads 2 x 2H and writes 2 x 2H (the unfused RMSNorm alone moves
~36 bytes per element in 6 ops, the residual add 6 more); rope_store reads and writes each of q, k, v once (the
unfused rotary moves ~20 bytes per q or k element in 5 ops, then the cache store copies k and v again); silu_mul
reads 4I and writes 2I (unfused: 10I in 2 ops). benchmarks/NOTES.md counts them per layer. With an fp8 cache
rope_store writes 1 byte per K/V element instead of 2.

Each op is a torch custom op (`torch.ops.fastgrpo.*`) so that a dispatch-level counter sees one op per kernel and
fake tensors trace it; the kernels run wherever Triton does (CUDA, or the interpreter on a CPU).
"""

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn; larger values saturate to it


@triton.jit
def _add_rms_norm_kernel(
    X,  # [T, H]
    R,  # [T, H] residual stream (unused without HAS_RESIDUAL)
    W,  # [H]
    Out,  # [T, H] normed
    ROut,  # [T, H] x + residual (a copy of x without HAS_RESIDUAL)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ROut.dtype.element_ty)
    tl.store(ROut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * normed).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_kernel(
    QKV,  # [T, (NUM_Q + 2 NUM_KV) HEAD_DIM]
    Cos,  # [T, HEAD_DIM]
    Sin,  # [T, HEAD_DIM]
    QNormW,  # [HEAD_DIM] (unused without HAS_QK_NORM)
    KNormW,  # [HEAD_DIM]
    Q,  # [T, NUM_Q, HEAD_DIM] out
    KCache,  # [num_blocks, PAGE, NUM_KV, HEAD_DIM]
    VCache,  # [num_blocks, PAGE, NUM_KV, HEAD_DIM]
    Slots,  # [T] int64: block * PAGE + offset
    KScale,  # [NUM_KV] fp32: fp8 caches hold k / k_scale (unused without KV_SCALED)
    VScale,  # [NUM_KV] fp32
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    eps,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    KV_SCALED: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    """One program per token: its [heads, HEAD_DIM] tile of q, k and v heads."""
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]: q heads, then k heads, then v heads
    d = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
    is_q = h < NUM_Q
    is_k = (h >= NUM_Q) & (h < NUM_Q + NUM_KV)
    is_v = (h >= NUM_Q + NUM_KV) & (h < NUM_Q + 2 * NUM_KV)
    valid = (is_q | is_k | is_v) & (d < HEAD_DIM)
    partner = (d + HALF) % HEAD_DIM
    row = QKV + t * stride_qkv + h * HEAD_DIM
    x = tl.load(row + d, mask=valid, other=0.0)
    xp = tl.load(row + partner, mask=valid, other=0.0)
    dt = x.dtype
    if HAS_QK_NORM:  # RMSNorm over each q/k head; xp is a permutation of x, so they share the sum of squares
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.where(is_q, tl.load(QNormW + d).to(tl.float32), tl.load(KNormW + d).to(tl.float32))
        wp = tl.where(is_q, tl.load(QNormW + partner).to(tl.float32), tl.load(KNormW + partner).to(tl.float32))
        x_norm = (w * (xf * rstd).to(dt).to(tl.float32)).to(dt)
        xp_norm = (wp * (xp.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
        x = tl.where(is_v, x, x_norm)
        xp = tl.where(is_v, xp, xp_norm)
    cos = tl.load(Cos + t * stride_cos + d).to(tl.float32)
    sin = tl.load(Sin + t * stride_sin + d).to(tl.float32)
    rotated = tl.where(d < HALF, -xp.to(tl.float32), xp.to(tl.float32))
    a = (x.to(tl.float32) * cos).to(dt).to(tl.float32)
    b = (rotated * sin).to(dt).to(tl.float32)
    out = (a + b).to(dt)
    tl.store(Q + t * stride_qt + h * stride_qh + d, out, mask=is_q & valid)
    slot = tl.load(Slots + t)
    block, offset = slot // PAGE, slot % PAGE
    kv_head = tl.where(is_k, h - NUM_Q, h - NUM_Q - NUM_KV)
    k, v = out, x
    if KV_SCALED:  # e4m3 of the rounded k / v over their head's scale; div_rn is exact for powers of two
        k_scale = tl.load(KScale + kv_head, mask=is_k, other=1.0)  # [BLOCK_HEADS, 1]
        v_scale = tl.load(VScale + kv_head, mask=is_v, other=1.0)
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX).to(KCache.dtype.element_ty)
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX).to(VCache.dtype.element_ty)
    tl.store(KCache + block * stride_kb + offset * stride_ks + kv_head * stride_kh + d, k, mask=is_k & valid)
    tl.store(VCache + block * stride_vb + offset * stride_vs + kv_head * stride_vh + d, v, mask=is_v & valid)


@triton.jit
def _silu_mul_kernel(
    GU,  # [T, 2I]: gate, then up
    Out,  # [T, I]
    stride_gu,
    stride_o,
    width,  # I
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=mask)


# -- launch settings (each builds without spills for sm_90/sm_80: tests/aot.py) --

SILU_BLOCK = 1024


def norm_warps(hidden: int) -> int:
    """Warps per row of add_rms_norm: 16-byte accesses, <= 16 fp32 values per thread up to H = 8192."""
    return max(1, min(16, triton.next_power_of_2(hidden) // 512))


def rope_warps(num_heads: int, head_dim: int) -> int:
    """Warps per token of rope_store: <= 16 values of its [heads, head_dim] tile per thread."""
    return max(1, min(16, triton.next_power_of_2(num_heads) * head_dim // 512))


# -- the ops --

@torch.library.custom_op("fastgrpo::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); without a residual (a model's first layer) the second is a
    copy of x, written by the same pass (a custom op cannot return its input)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    has_residual = residual is not None
    residual_out = torch.empty_like(x)
    if num_tokens:
        r = residual if has_residual else x
        _add_rms_norm_kernel[(num_tokens,)](
            x, r, weight, out, residual_out, x.stride(0), r.stride(0), out.stride(0), residual_out.stride(0),
            hidden, eps, HAS_RESIDUAL=has_residual, BLOCK_H=triton.next_power_of_2(hidden),
            num_warps=norm_warps(hidden),
        )  # fmt: skip
    return out, residual_out


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("fastgrpo::rope_store", mutates_args=("k_cache", "v_cache"))
def rope_store(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    q_norm: torch.Tensor | None,  # [D] (Qwen3)
    k_norm: torch.Tensor | None,
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64
    num_heads: int,
    eps: float,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: float8_e4m3fn caches only, which take k / k_scale
    v_scale: torch.Tensor | None = None,  # [Hkv] fp32
) -> torch.Tensor:  # [T, Hq, D] rotated queries
    num_tokens = qkv.shape[0]
    _, page, num_kv_heads, head_dim = k_cache.shape
    scaled = k_cache.dtype == torch.float8_e4m3fn
    assert v_cache.dtype == k_cache.dtype and (k_cache.dtype == qkv.dtype or scaled), (qkv.dtype, k_cache.dtype)
    for scale in (k_scale, v_scale):
        assert (scale is None) != scaled, "fp8 caches need k_scale and v_scale, others neither"
        assert scale is None or (scale.dtype == torch.float32 and scale.shape == (num_kv_heads,)), scale
        assert scale is None or scale.is_contiguous()
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(-1) == 1
    assert head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of 2"
    assert cos.stride(-1) == sin.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert (q_norm is None) == (k_norm is None)
    q = qkv.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens:
        has_norm = q_norm is not None
        total_heads = num_heads + 2 * num_kv_heads
        _rope_store_kernel[(num_tokens,)](
            qkv, cos, sin, q_norm if has_norm else cos, k_norm if has_norm else cos, q, k_cache, v_cache, slots,
            k_scale if scaled else cos, v_scale if scaled else cos,
            qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), eps,
            NUM_Q=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, PAGE=page, HAS_QK_NORM=has_norm,
            KV_SCALED=scaled, BLOCK_HEADS=triton.next_power_of_2(total_heads),
            num_warps=rope_warps(total_heads, head_dim),
        )  # fmt: skip
    return q


@rope_store.register_fake
def _(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, slots, num_heads, eps, k_scale=None, v_scale=None):
    return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[-1])


@torch.library.custom_op("fastgrpo::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
    num_tokens, width = gate_up.shape
    out = gate_up.new_empty(num_tokens, width // 2)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(width // 2, SILU_BLOCK))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), width // 2, BLOCK=SILU_BLOCK,
                               num_warps=4)  # fmt: skip
    return out


@silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
