"""Fused linear log-probabilities and entropy, straight from hidden states and the lm_head weight.

For each selected token row n (hidden x_n [H], target y_n), lm_head weight W [V, H], optional bias b [V] and
temperature T:

    z_n      = (x_n @ W.T + b) / T                    # [V], fp32 accumulation, never written to memory
    lse_n    = logsumexp(z_n)
    logp_n   = z_n[y_n] - lse_n
    entropy_n = lse_n - sum_v softmax(z_n)_v * z_nv

Plain-PyTorch equivalent (which materializes the [N, V] logits this file never writes):

    z = (hidden.reshape(-1, H)[index].double() @ weight.double().T + bias) / T
    logp = z.log_softmax(-1).gather(-1, ids[:, None])[:, 0];  entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)

Backward, for upstream gradients g_n (on logp) and h_n (on entropy), with p = softmax(z_n), Ez = sum_v p_v z_v:

    dz   = g_n (onehot(y_n) - p) - h_n p (log p + H)   # dH/dz = -p (log p + H) = -p (z - Ez)
    dX   = (dz / T) @ W,   dW = (dz / T).T @ X,   db = sum_n dz / T

Only the selected tokens (the valid ones) are read, so masked tokens cost nothing and get zero gradient.
The backward reduces dX and dW with fp32 atomics (one [BLOCK_N, BLOCK_V] logit tile at a time, like Cut
Cross-Entropy), so it is not bitwise deterministic on a GPU; `fastgrpo.loss` routes to the chunked PyTorch path when
`torch.use_deterministic_algorithms(True)` is set.
"""

import torch
import triton
import triton.language as tl

# A row's running max starts finite so that `s * (m_old - m_new)` never evaluates 0 * inf on the first tile.
_NEG_BIG = tl.constexpr(-1.0e30)
# Tiles (BLOCK_N, BLOCK_V, BLOCK_H, num_warps, num_stages) by input element size: the largest that build without
# register spills for both sm_90 and sm_80 (ptxas -v, triton 3.9; tests/test_aot.py checks them):
#   bf16/fp16 fwd 128x64x32: 215 registers (128x128x64 spills 244 B on sm_90, 532 B on sm_80);
#   bf16/fp16 bwd 64x64x64: 254 registers (64x128x64 spills 260 B on sm_90);
#   fp32 ("ieee" products on the FMA units) needs narrower tiles: fwd 128x64x32 spills 28 B on sm_90, and the
#   dX-only bwd at 64x64x32 spills 32 B on sm_80 (64x32x32: 128-156 registers).
# Tuned further on a GPU.
_FWD_TILES = {2: (128, 64, 32, 8, 3), 4: (64, 64, 32, 8, 3)}
_BWD_TILES = {2: (64, 64, 64, 8, 2), 4: (64, 32, 32, 8, 2)}
# fp32 dW accumulators are allocated per vocab slice of at most this many bytes (the 7B head's fp32 dW is 2.2 GB).
_DW_SLICE_BYTES = 256 * 2**20


@triton.jit
def _token_tile(Offs, Ids, pid_n, N, BLOCK_N: tl.constexpr):
    """A tile of BLOCK_N selected tokens: positions, validity, hidden-vector offsets, target ids (-1 past the end)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_x = tl.load(Offs + offs_n, mask=n_mask, other=0).to(tl.int64)
    ids = tl.load(Ids + offs_n, mask=n_mask, other=-1).to(tl.int64)
    return offs_n, n_mask, offs_x, ids


@triton.jit
def _logit_tile(
    X, W, B, offs_x, n_mask, offs_v, v_mask, H, stride_w, inv_t,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """z[BLOCK_N, BLOCK_V] = (x @ W[offs_v].T + b) / T in fp32 for the token vectors starting at X + offs_x;
    vocab columns past the end are -inf."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    x_ptrs = X + offs_x[:, None]  # [BLOCK_N, 1]
    w_ptrs = W + offs_v[None, :].to(tl.int64) * stride_w  # [1, BLOCK_V]
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        x = tl.load(x_ptrs + offs_h[None, :], mask=n_mask[:, None] & h_mask[None, :], other=0.0)  # [BN, BH]
        w = tl.load(w_ptrs + offs_h[:, None], mask=h_mask[:, None] & v_mask[None, :], other=0.0)  # [BH, BV]
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + offs_v, mask=v_mask, other=0.0).to(tl.float32)[None, :]
    z = acc * inv_t
    return tl.where(v_mask[None, :], z, float("-inf"))


@triton.jit
def _logprob_fwd_kernel(
    X, W, B, Offs, Ids,  # X: token n's hidden vector starts at X + Offs[n] (int64 [N]); W [V, H], B [V], Ids [N]
    Mpart, Spart, Apart, Zpart,  # [SPLITS, N] fp32 partials of one vocab split each
    N, V, H, stride_w, inv_t, v_per_split,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    inv_t = tl.cast(inv_t, tl.float32)
    offs_n, n_mask, offs_x, ids = _token_tile(Offs, Ids, pid_n, N, BLOCK_N)

    # Running statistics relative to the running max m: s = sum exp(z - m), a = sum exp(z - m) (z - m).
    m = tl.full((BLOCK_N,), _NEG_BIG, dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    z_target = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_begin = pid_s * v_per_split
    v_end = tl.minimum(v_begin + v_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < v_end
        z = _logit_tile(X, W, B, offs_x, n_mask, offs_v, v_mask, H, stride_w, inv_t,
                        HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION)
        # -- online logsumexp, carrying the entropy's sum p*z along --
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        zc = z - m_new[:, None]
        p = tl.exp(zc)  # 0 on the -inf tail
        a = alpha * (a + s * (m - m_new)) + tl.sum(p * tl.where(v_mask[None, :], zc, 0.0), axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        m = m_new
        # -- the target's logit lives in exactly one tile of one split --
        z_target += tl.sum(tl.where(offs_v[None, :] == ids[:, None], z, 0.0), axis=1)

    out = pid_s * N + offs_n
    tl.store(Mpart + out, m, mask=n_mask)
    tl.store(Spart + out, s, mask=n_mask)
    tl.store(Apart + out, a, mask=n_mask)
    tl.store(Zpart + out, z_target, mask=n_mask)


@triton.jit
def _logprob_combine_kernel(
    Mpart, Spart, Apart, Zpart, Logp, Ent, Lse, N,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Merge the vocab splits: lse = m + log s, logp = z_y - lse, entropy = log s - a / s."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    m = tl.full((BLOCK,), _NEG_BIG, dtype=tl.float32)
    for k in range(SPLITS):
        m = tl.maximum(m, tl.load(Mpart + k * N + offs, mask=mask, other=_NEG_BIG))
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    a = tl.zeros((BLOCK,), dtype=tl.float32)
    z_target = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(SPLITS):
        m_k = tl.load(Mpart + k * N + offs, mask=mask, other=_NEG_BIG)
        s_k = tl.load(Spart + k * N + offs, mask=mask, other=0.0)
        a_k = tl.load(Apart + k * N + offs, mask=mask, other=0.0)
        scale = tl.exp(m_k - m)
        s += scale * s_k
        a += scale * (a_k + s_k * (m_k - m))
        z_target += tl.load(Zpart + k * N + offs, mask=mask, other=0.0)
    s = tl.where(mask, s, 1.0)
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(Lse + offs, lse, mask=mask)
    tl.store(Logp + offs, z_target - lse, mask=mask)
    tl.store(Ent + offs, log_s - a / s, mask=mask)


@triton.jit
def _logprob_bwd_kernel(
    X, W, B, Offs, Ids, Lse, Ent, GradLogp, GradEnt,  # inputs as in the forward; Lse/Ent/Grad* are [N] fp32
    DX, DW, DB,  # DX [N, H] fp32 (one row per selected token), DW [v_end - v_begin, H] fp32, DB [v_end - v_begin] fp32
    N, V, H, stride_w, stride_dx, stride_dw, inv_t, v_begin, v_end,
    HAS_BIAS: tl.constexpr, HAS_GRAD_ENT: tl.constexpr, COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    inv_t = tl.cast(inv_t, tl.float32)
    offs_n, n_mask, offs_x, ids = _token_tile(Offs, Ids, pid_n, N, BLOCK_N)
    offs_v = v_begin + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < v_end

    # -- recompute the logit tile and its softmax --
    z = _logit_tile(X, W, B, offs_x, n_mask, offs_v, v_mask, H, stride_w, inv_t,
                    HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION)
    lse = tl.load(Lse + offs_n, mask=n_mask, other=0.0)
    log_p = z - lse[:, None]  # [BN, BV], -inf on the vocab tail
    p = tl.exp(log_p)
    g = tl.load(GradLogp + offs_n, mask=n_mask, other=0.0)

    # -- dz = g (onehot - p) - h p (z - Ez), then through the temperature --
    dz = tl.where(offs_v[None, :] == ids[:, None], g[:, None], 0.0) - g[:, None] * p
    if HAS_GRAD_ENT:
        h = tl.load(GradEnt + offs_n, mask=n_mask, other=0.0)
        ent = tl.load(Ent + offs_n, mask=n_mask, other=0.0)
        # z - E_p[z] = log p + H, without the cancellation of two large terms
        dz -= h[:, None] * p * tl.where(v_mask[None, :], log_p + ent[:, None], 0.0)
    dz = dz * inv_t
    if HAS_BIAS:
        tl.atomic_add(DB + (offs_v - v_begin), tl.sum(dz, axis=0), mask=v_mask)
    dz = dz.to(W.dtype.element_ty)  # tensor-core operand in the input dtype, as autograd on bf16 logits would use

    # -- dX[n] += dz @ W[v], dW[v] += dz.T @ X[n], one H tile at a time (a frozen lm_head skips dW) --
    x_ptrs = X + offs_x[:, None]
    w_ptrs = W + offs_v[:, None].to(tl.int64) * stride_w
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        if COMPUTE_DX:
            w = tl.load(w_ptrs + offs_h[None, :], mask=v_mask[:, None] & h_mask[None, :], other=0.0)  # [BV, BH]
            dx = tl.dot(dz, w, input_precision=DOT_PRECISION)  # [BN, BH]
            dx_ptrs = DX + offs_n[:, None].to(tl.int64) * stride_dx + offs_h[None, :]
            tl.atomic_add(dx_ptrs, dx, mask=n_mask[:, None] & h_mask[None, :])
        if COMPUTE_DW:
            x = tl.load(x_ptrs + offs_h[None, :], mask=n_mask[:, None] & h_mask[None, :], other=0.0)  # [BN, BH]
            dw = tl.dot(tl.trans(dz), x, input_precision=DOT_PRECISION)  # [BV, BH]
            dw_ptrs = DW + (offs_v - v_begin)[:, None].to(tl.int64) * stride_dw + offs_h[None, :]
            tl.atomic_add(dw_ptrs, dw, mask=v_mask[:, None] & h_mask[None, :])


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (tf32 would add ~1e-3 relative error to the logits); bf16/fp16 ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits still exercise the combine step


def _vocab_splits(n_blocks: int, V: int, device: torch.device, block_v: int) -> int:
    """Split the vocab so that short batches still fill every SM twice; each split keeps >= 8 vocab tiles."""
    max_splits = max(1, triton.cdiv(V, 8 * block_v))
    return max(1, min(max_splits, triton.cdiv(2 * _num_sms(device), n_blocks)))


def logprob_forward(x, weight, bias, offsets, ids, temperature: float, splits: int | None = None):
    """Score N token vectors of x (token n's vector starts at element offsets[n], int64) against weight [V, H].

    bias [V] or None, ids [N]. Returns (logp [N], entropy [N], lse [N]), all fp32.
    """
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and offsets.dtype == torch.int64
    assert offsets.numel() == ids.numel() and x.dtype == weight.dtype
    N, (V, H) = offsets.numel(), weight.shape
    logp, ent, lse = (torch.empty(N, device=x.device, dtype=torch.float32) for _ in range(3))
    if N == 0:
        return logp, ent, lse
    block_n, block_v, block_h, warps, stages = _FWD_TILES[x.element_size()]
    n_blocks = triton.cdiv(N, block_n)
    splits = splits or _vocab_splits(n_blocks, V, x.device, block_v)
    v_per_split = triton.cdiv(triton.cdiv(V, splits), block_v) * block_v
    splits = triton.cdiv(V, v_per_split)  # no empty split
    parts = torch.empty(4, splits, N, device=x.device, dtype=torch.float32)
    _logprob_fwd_kernel[(n_blocks, splits)](
        x, weight, bias, offsets, ids, parts[0], parts[1], parts[2], parts[3],
        N, V, H, weight.stride(0), 1.0 / temperature, v_per_split,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=warps, num_stages=stages,
    )
    block = 1024
    _logprob_combine_kernel[(triton.cdiv(N, block),)](
        parts[0], parts[1], parts[2], parts[3], logp, ent, lse, N, SPLITS=splits, BLOCK=block,
    )
    return logp, ent, lse


def logprob_backward(x, weight, bias, offsets, ids, lse, ent, grad_logp, grad_ent, temperature: float,
                     need_dx: bool = True, need_dw: bool = True):
    """Gradients of sum(grad_logp * logp + grad_ent * entropy) w.r.t. the N scored vectors, weight and bias.

    Returns (dx [N, H] fp32 or None, d_weight [V, H] in weight's dtype or None, d_bias [V] in bias's dtype or None);
    dx / d_weight are None (and cost nothing) when not needed.
    """
    N, (V, H) = offsets.numel(), weight.shape
    dx = torch.zeros(N, H, device=x.device, dtype=torch.float32) if need_dx else None
    d_weight = torch.zeros_like(weight) if need_dw else None
    d_bias = None if bias is None else torch.zeros(V, device=x.device, dtype=torch.float32)
    block_n, block_v, block_h, warps, stages = _BWD_TILES[x.element_size()]
    # bf16/fp16 weights accumulate dW in an fp32 buffer one vocab slice at a time, then round once.
    in_place = not need_dw or weight.dtype == torch.float32
    slice_rows = V if in_place else max(block_v, _DW_SLICE_BYTES // (4 * H) // block_v * block_v)
    dw_acc = None if in_place or N == 0 else torch.empty(min(slice_rows, V), H, device=x.device, dtype=torch.float32)
    for v_begin in range(0, V if N else 0, slice_rows):
        v_end = min(v_begin + slice_rows, V)
        dw = d_weight[v_begin:v_end] if in_place and need_dw else None
        if not in_place:
            dw = dw_acc[: v_end - v_begin].zero_()
        grid = (triton.cdiv(N, block_n), triton.cdiv(v_end - v_begin, block_v))
        _logprob_bwd_kernel[grid](
            x, weight, bias, offsets, ids, lse, ent, grad_logp, grad_ent,
            dx, dw, None if bias is None else d_bias[v_begin:v_end],
            N, V, H, weight.stride(0), H, H, 1.0 / temperature, v_begin, v_end,
            HAS_BIAS=bias is not None, HAS_GRAD_ENT=grad_ent is not None, COMPUTE_DX=need_dx, COMPUTE_DW=need_dw,
            BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, DOT_PRECISION=_dot_precision(x.dtype),
            num_warps=warps, num_stages=stages,
        )
        if not in_place:
            d_weight[v_begin:v_end].copy_(dw)
    return dx, d_weight, None if bias is None else d_bias.to(bias.dtype)


class LinearLogprobFunction(torch.autograd.Function):
    """(x [..., H], weight [V, H], bias [V] | None, index [N], offsets [N], ids [N], temperature)
    -> (logp [N], entropy [N]) for the tokens x.reshape(-1, H)[index], whose vectors start at `offsets`.

    Gradients flow to x (only the indexed tokens), weight and bias.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, index, offsets, ids, temperature):
        logp, ent, lse = logprob_forward(x, weight, bias, offsets, ids, temperature)
        ctx.save_for_backward(x, weight, bias, index, offsets, ids, lse, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        x, weight, bias, index, offsets, ids, lse, ent = ctx.saved_tensors
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.contiguous().float()
        grad_ent = None if grad_ent is None else grad_ent.contiguous().float()
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx_tokens, d_weight, d_bias = logprob_backward(
            x, weight, bias, offsets, ids, lse, ent, grad_logp, grad_ent, ctx.temperature, need_dx, need_dw
        )
        dx = None
        if need_dx:
            H = x.shape[-1]
            dx = x.new_zeros(x.numel() // H, H).index_copy_(0, index, dx_tokens.to(x.dtype)).view(x.shape)
        return dx, d_weight, d_bias, None, None, None, None
