"""Row passes over a chunk of fp32 logits Z [C, V] (computed by cuBLAS): the row statistics, then the logit gradient.

Per row c (logits z [V], target y), optionally soft-capped first (Gemma-2's final_logit_softcapping, cap k):

    zc       = k tanh(z / k)   if softcap else z
    m = max_v zc_v,   s = sum_v exp(zc_v - m),   t = sum_v exp(zc_v - m) (zc_v - m)
    lse      = m + log s
    logp     = zc_y - lse
    entropy  = -sum_v p_v log p_v = lse - sum_v p_v zc_v = log s - t / s     (p = exp(zc - lse); t <= 0, so the
                                                                              two terms never cancel)

and for L = sum_c g_c logp_c + h_c entropy_c, with d logp / dzc = onehot(y) - p, d entropy / dzc = -p (log p + H):

    out_cv   = scale dL/dz_cv = scale [g onehot(y) - p (g + h (zc - lse + entropy))] (1 - tanh(z / k)^2 if softcap)

Plain-PyTorch equivalent (float64 is the tests' ground truth):

    zc = k * torch.tanh(z / k) if softcap else z;  lsm = zc.log_softmax(-1)
    lse = zc.logsumexp(-1);  logp = lsm.gather(-1, ids[:, None])[:, 0];  entropy = -(lsm.exp() * lsm).sum(-1)
    out = scale * torch.autograd.grad((g * logp + h * entropy).sum(), z)[0]

-- online statistics --
The state (m, s, t) of a set of values rescales to any new reference M >= m: exp(x - M) = exp(x - m) exp(m - M)
and (x - M) = (x - m) + (m - M), so

    s' = exp(m - M) s,    t' = exp(m - M) (t + s (m - M)).

A program's tile is [BLOCK_V // 4, 4]: each lane (one thread's 16-byte vector of 4 consecutive logits) keeps the
state of its own values of the row. Per tile, with x the lane's 4 new logits and M = max(m, max x):

    s = exp(m - M) s + sum exp(x - M),    t = exp(m - M) (t + s (m - M)) + sum exp(x - M) (x - M),    m = M

1.25 exponentials per logit, the reductions inside a thread, no barriers in the loop; at the row's end the lanes
merge with the same rescaling.

Rows are independent, one program per row, streamed in BLOCK_V tiles: full tiles unmasked (16-byte accesses when
the row stride is a multiple of 16 elements, as every real vocabulary's is), then one masked tail tile. No atomics;
the results are bitwise deterministic. A row of 151936 fp32 logits is 600 KB; chunks of C >= 1k rows give every SM
several rows, which is why the vocab is not split across programs (a chunk of fewer rows than ~2x the SM count
would leave SMs idle).

Bytes moved per row (C rows, plus O(C) scalars): `logit_row_stats` reads 4V; `logit_row_grad` reads 4V and writes
4V (fp32 out, in place or not) or 2V (bf16/fp16 out). Their time is those bytes over the HBM bandwidth.

ids outside [0, V) (padding such as -100) read no logit: their logp is the constant 0 (as cross_entropy's
ignore_index gives a loss of 0), so g contributes no gradient there; entropy and its gradient are computed as usual.
"""

import torch
import triton
import triton.language as tl

# A lane's running max starts finite so that the first tile's rescaling `alpha * (t + s * (m - M))` is 0 * finite,
# not 0 * inf = NaN.
_NEG_BIG = tl.constexpr(-1.0e30)
# tanh in core Triton: the interpreter cannot run libdevice (extern_elementwise), and the tests run on it. An odd
# polynomial below |x| = 0.625 (a least-squares/Lawson fit of (tanh x - x) / x^3 in x^2, in float64; fp32 Horner
# evaluation <= 0.79 ulp), 1 - 2 / (exp(2|x|) + 1) above it (<= 1.8 ulp; no cancellation, the result is > 0.55).
_TANH_SWITCH = tl.constexpr(0.625)
_T3, _T5, _T7 = tl.constexpr(-0.33333292603492737), tl.constexpr(0.13331733644008636), tl.constexpr(-0.0537621714174)
_T9, _T11 = tl.constexpr(0.020708123221993446), tl.constexpr(-0.0057786451652646065)
# A stats lane holds one 16-byte vector of logits per tile; its 4 values reduce inside the thread.
_VEC = 4
# (BLOCK_V, num_warps): 16 logits per thread per tile, four 16-byte loads (ld.global.v4 in the PTX; bf16 out: two
# 16-byte stores, no layout conversion inside the loop; the tail tile's store converts through shared memory).
# A streaming kernel needs bytes in flight, and registers bound them: Little's law wants ~25 KB per SM on an H100
# (3.35 TB/s x ~1 us loaded latency / 132 SMs), more on an H200. ptxas -v (triton 3.9, softcap and h on, no spills;
# tests/test_aot.py checks), registers sm_90 / sm_80:
#   4096 x 8 warps:  stats 64 / 64, grad fp32 out 48 / 64, grad bf16 out 64 / 64: 4-5 rows per SM, 64-80 KB of loads
#   2048 x 8 warps:  34-37 registers: 6 rows per SM, 48 KB;   8192 x 8 warps: 101-128 registers: 2 rows, 64 KB.
# num_stages changes nothing (no cp.async in the PTX at 3 stages: Triton does not pipeline these loads).
# Not yet timed on a GPU.
STATS_TILE = (4096, 8)
GRAD_TILE = {torch.float32: (4096, 8), torch.bfloat16: (4096, 8), torch.float16: (4096, 8)}


@triton.jit
def _softcap(z, softcap, inv_softcap):
    """(softcap * tanh(z / softcap), tanh(z / softcap)), tanh as described at _TANH_SWITCH."""
    x = z * inv_softcap
    a = tl.abs(x)
    a2 = a * a
    small = a + a * a2 * (_T3 + a2 * (_T5 + a2 * (_T7 + a2 * (_T9 + a2 * _T11))))
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)  # exp overflows to inf past |x| ~ 44: 1 - 0
    th = tl.where(a < _TANH_SWITCH, small, big)
    th = tl.where(x < 0.0, -th, th)
    return softcap * th, th


@triton.jit
def _load_logits(ptrs, mask, softcap, inv_softcap, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """A tile of (capped) logits and tanh(z / softcap) (without a cap: z, unused); masked lanes hold finite junk."""
    if MASKED:
        z = tl.load(ptrs, mask=mask, other=0.0)
    else:
        z = tl.load(ptrs)
    th = z  # a compiled function cannot return None in a tuple
    if HAS_SOFTCAP:
        z, th = _softcap(z, softcap, inv_softcap)
    return z, th


@triton.jit
def _online_update(z, m, s, t, MASKED: tl.constexpr):
    """Fold a [LANES, 4] tile into the lanes' running (m, s, t) [LANES] (module docstring)."""
    m_new = tl.maximum(m, tl.max(z, axis=1))  # masked lanes keep their m: max(m, -inf)
    alpha = tl.exp(m - m_new)
    d = z - m_new[:, None]
    p = tl.exp(d)
    if MASKED:
        d = tl.where(p > 0.0, d, 0.0)  # masked logits: p = 0 and d = -inf, 0 * -inf would be NaN
    t = alpha * (t + s * (m - m_new)) + tl.sum(p * d, axis=1)
    s = alpha * s + tl.sum(p, axis=1)
    return m_new, s, t


@triton.jit
def _logit_row_stats_kernel(
    Z, Ids,  # Z [C, V] fp32 (unit stride on V), Ids [C] int64
    Out,  # [3, C] fp32: lse, logp, entropy
    C, V, stride_z, softcap,
    HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    softcap = tl.cast(softcap, tl.float32)  # Python floats can arrive as fp64
    inv_softcap = 1.0 / softcap
    lanes = tl.arange(0, BLOCK_V // VEC)
    offs = lanes[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [LANES, VEC]: VEC consecutive logits per lane

    # -- per-lane online statistics over the full tiles, then the masked tail --
    m = tl.full((BLOCK_V // VEC,), _NEG_BIG, dtype=tl.float32)
    s = tl.zeros((BLOCK_V // VEC,), dtype=tl.float32)
    t = tl.zeros((BLOCK_V // VEC,), dtype=tl.float32)
    v_full = V - V % BLOCK_V
    for v0 in range(0, v_full, BLOCK_V):
        z, _ = _load_logits(z_row + v0 + offs, None, softcap, inv_softcap, HAS_SOFTCAP, False)
        m, s, t = _online_update(z, m, s, t, False)
    if v_full < V:
        mask = v_full + offs < V
        z, _ = _load_logits(z_row + v_full + offs, mask, softcap, inv_softcap, HAS_SOFTCAP, True)
        m, s, t = _online_update(tl.where(mask, z, float("-inf")), m, s, t, True)

    # -- merge the lanes: rescale each to the row max (lanes that saw nothing have s = t = 0) --
    m_row = tl.max(m, axis=0)
    w = tl.exp(m - m_row)
    s_row = tl.sum(w * s, axis=0)
    t_row = tl.sum(w * (t + s * (m - m_row)), axis=0)
    log_s = tl.log(s_row)
    lse = m_row + log_s

    # -- the target's logit: one scalar load --
    y = tl.load(Ids + row)
    hit = (y >= 0) & (y < V)
    z_y = tl.load(z_row + y, mask=hit, other=0.0)
    if HAS_SOFTCAP:
        z_y, _ = _softcap(z_y, softcap, inv_softcap)
    tl.store(Out + row, lse)
    tl.store(Out + C + row, tl.where(hit, z_y - lse, 0.0))
    tl.store(Out + 2 * C + row, log_s - t_row / s_row)


@triton.jit
def _grad_tile(z, th, offs_v, y, lse, ent, g, h, HAS_H: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """scale dL/dz on one tile; g and h arrive already multiplied by scale."""
    log_p = z - lse
    p = tl.exp(log_p)
    if HAS_H:
        dz = tl.where(offs_v == y, g, 0.0) - p * (g + h * (log_p + ent))  # log p + H = z - E_p[z], no cancellation
    else:
        dz = tl.where(offs_v == y, g, 0.0) - p * g
    if HAS_SOFTCAP:
        dz = dz * (1.0 - th * th)
    return dz


@triton.jit
def _logit_row_grad_kernel(
    Z, Ids, Lse, Ent, G, Hgrad,  # Z [C, V] fp32 (unit stride on V); Ids [C] int64; Lse, Ent, G, Hgrad [C] fp32
    Out,  # [C, V] fp32 / bf16 / fp16 (unit stride on V); may be Z itself
    V, stride_z, stride_out, scale, softcap,
    HAS_H: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    out_row = Out + row * stride_out
    softcap = tl.cast(softcap, tl.float32)
    inv_softcap = 1.0 / softcap
    scale = tl.cast(scale, tl.float32)
    y = tl.load(Ids + row)
    lse = tl.load(Lse + row)
    g = tl.where((y >= 0) & (y < V), tl.load(G + row) * scale, 0.0)  # an ignored id's logp is the constant 0
    ent = 0.0
    h = 0.0
    if HAS_H:
        ent = tl.load(Ent + row)
        h = tl.load(Hgrad + row) * scale
    offs = tl.arange(0, BLOCK_V)

    # -- each tile is read before it is written: Out may alias Z --
    v_full = V - V % BLOCK_V
    for v0 in range(0, v_full, BLOCK_V):
        z, th = _load_logits(z_row + v0 + offs, None, softcap, inv_softcap, HAS_SOFTCAP, False)
        dz = _grad_tile(z, th, v0 + offs, y, lse, ent, g, h, HAS_H, HAS_SOFTCAP)
        tl.store(out_row + v0 + offs, dz.to(Out.dtype.element_ty))
    if v_full < V:
        mask = v_full + offs < V
        z, th = _load_logits(z_row + v_full + offs, mask, softcap, inv_softcap, HAS_SOFTCAP, True)
        dz = _grad_tile(z, th, v_full + offs, y, lse, ent, g, h, HAS_H, HAS_SOFTCAP)
        tl.store(out_row + v_full + offs, dz.to(Out.dtype.element_ty), mask=mask)


def _check_rows(z, ids):
    assert z.dim() == 2 and z.dtype == torch.float32, f"z must be [C, V] float32, got {z.dtype} {tuple(z.shape)}"
    C, V = z.shape
    assert 1 <= V < 2**31, f"z must have 1 <= V < 2**31 columns, got {V}"
    assert z.stride(1) == 1, f"z must have unit stride on V, got strides {z.stride()}"
    assert z.stride(0) >= V or C <= 1, f"z's rows must not overlap, got strides {z.stride()} for V = {V}"
    _check_vector("ids", ids, C, torch.int64, z.device)
    return C, V


def _check_vector(name, x, C, dtype, device):
    assert isinstance(x, torch.Tensor) and x.dtype == dtype and x.shape == (C,), (
        f"{name} must be a [{C}] {dtype} tensor, got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    assert x.is_contiguous(), f"{name} must be contiguous"
    assert x.device == device, f"{name} is on {x.device}, z on {device}"


def _check_softcap(softcap):
    assert softcap is None or (isinstance(softcap, (int, float)) and softcap > 0), (
        f"softcap must be None or a positive float, got {softcap!r}")


def _memory_span(x):
    """[first, last] byte addresses of a strided tensor with non-negative strides."""
    last = x.data_ptr() + sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True)) * x.element_size()
    return x.data_ptr(), last + x.element_size() - 1


def logit_row_stats(z, ids, *, softcap=None):
    """Row statistics of fp32 logits z [C, V] (unit stride on V) with targets ids [C] int64.

    Returns (lse [C], logp [C], entropy [C]), fp32, of the logits soft-capped by `softcap` (None: not capped).
    """
    C, V = _check_rows(z, ids)
    _check_softcap(softcap)
    stats = torch.empty(3, C, device=z.device, dtype=torch.float32)  # lse, logp, entropy
    if C > 0:
        block_v, warps = STATS_TILE
        _logit_row_stats_kernel[(C,)](
            z, ids, stats, C, V, z.stride(0), 1.0 if softcap is None else float(softcap),
            HAS_SOFTCAP=softcap is not None, BLOCK_V=block_v, VEC=_VEC, num_warps=warps,
        )
    lse, logp, entropy = stats.unbind(0)
    return lse, logp, entropy


def logit_row_grad(z, ids, lse, entropy, g, h, *, scale=1.0, softcap=None, out):
    """Write out[c, v] = scale * d(sum_c g_c logp_c + h_c entropy_c) / dz_cv and return out.

    z [C, V] fp32 and ids [C] int64 as for `logit_row_stats`, whose lse and entropy [C] fp32 this takes with the
    upstream gradients g, h [C] fp32 (h None: no entropy term; entropy is then unused and may be None). out [C, V]
    fp32 / bf16 / fp16 with unit stride on V; it may be z itself (fp32, in place), but no other overlap.
    """
    C, V = _check_rows(z, ids)
    _check_softcap(softcap)
    assert isinstance(scale, (int, float)), f"scale must be a Python float, got {type(scale)}"
    for name, x in (("lse", lse), ("g", g)) + ((("entropy", entropy), ("h", h)) if h is not None else ()):
        _check_vector(name, x, C, torch.float32, z.device)
    assert isinstance(out, torch.Tensor) and out.shape == z.shape, (
        f"out must be a [{C}, {V}] tensor, got {tuple(getattr(out, 'shape', ()))}")
    assert out.dtype in GRAD_TILE, f"out must be float32, bfloat16 or float16, got {out.dtype}"
    assert out.device == z.device, f"out is on {out.device}, z on {z.device}"
    assert out.stride(1) == 1 and (out.stride(0) >= V or C <= 1), (
        f"out must have unit stride on V and non-overlapping rows, got strides {out.stride()}")
    if C == 0:
        return out
    (z_first, z_last), (o_first, o_last) = _memory_span(z), _memory_span(out)
    if o_first <= z_last and z_first <= o_last:  # in place is the only overlap the row loop is safe for
        assert out.data_ptr() == z.data_ptr() and out.stride() == z.stride() and out.dtype == z.dtype, (
            "out overlaps z: it must be z itself (same storage offset, strides and float32 dtype) or disjoint")
    block_v, warps = GRAD_TILE[out.dtype]
    _logit_row_grad_kernel[(C,)](
        z, ids, lse, entropy, g, h, out, V, z.stride(0), out.stride(0), float(scale),
        1.0 if softcap is None else float(softcap),
        HAS_H=h is not None, HAS_SOFTCAP=softcap is not None, BLOCK_V=block_v, num_warps=warps,
    )
    return out
