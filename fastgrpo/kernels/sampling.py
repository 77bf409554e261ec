"""The sampler in two kernels that read the logits once: temperature, top-k, greedy or inverse-CDF draw, and the
token's logprob, from the lm_head's logits in their own dtype.

What it computes is `fastgrpo.sampling.sampler.sample` without top-p, per row (logits x [V], uniform u):

    z = x / temperature  (fp32, correctly rounded; greedy: z = x),  z_v = -inf where z_v < kth / temperature (kth:
    the row's floor for top-k and min-p, sampler.logit_floor),  M = max z,  w_v = exp(z_v - M),  W = sum w
    token = argmax z (first)                              greedy
          = the v with cdf_{v-1} <= u W < cdf_v           sampled (cdf: fp64 running sum of w)
    logprob = fp64(z_token - M) - log W

Kernel 1, one program per (row, tile of BLOCK_V): the tile's max m_t, its first argmax and s_t = sum exp(z - m_t).
Kernel 2, one program per row: M = max m_t, the tile masses S_t = s_t exp(m_t - M) and W = sum S_t (fp64); the draw's
tile is the first whose running mass passes u W, and only that tile is read again, its cdf continuing from the mass
before it. A row of V logits is read once plus one tile, against ~46 bytes per logit for the PyTorch chain (fp32
copy, divide, max, subtract, exp, fp64 cumsum); benchmarks/NOTES.md has the count.

The tile masses round differently from one running sum (s_t exp(m_t - M) against sum exp(z - M): ~1e-7 relative),
so the draw can differ from PyTorch's only when u W falls within ~1e-7 W of a tile boundary's cdf; the draw inside
the tile recomputes w exactly as PyTorch does.
"""

import torch
import triton
import triton.language as tl

BLOCK_V = 2048  # logits per tile: 16 fp32 values per thread at 4 warps
NUM_WARPS = 4


@triton.jit
def _processed(row_ptr, kth_ptr, cols, mask, temperature, SCALED: tl.constexpr, TOP_K: tl.constexpr):
    """The row's logits as `processed_logits` makes them: / temperature (correctly rounded), -inf below the k-th."""
    z = tl.load(row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
    if SCALED:
        z = tl.div_rn(z, temperature)
    if TOP_K:
        kth = tl.load(kth_ptr)
        if SCALED:
            kth = tl.div_rn(kth, temperature)
        z = tl.where(z >= kth, z, -float("inf"))
    return z


@triton.jit
def _tile_stats_kernel(
    Logits,  # [R, V] any float dtype
    TileMax,  # [R, NUM_TILES] fp32
    TileSum,  # [R, NUM_TILES] fp32
    TileArg,  # [R, NUM_TILES] int32
    Kth,  # [R] fp32: each row's k-th largest logit (top-k; unused without TOP_K)
    stride_l,
    V,
    temperature,
    NUM_TILES: tl.constexpr,
    SCALED: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    z = _processed(Logits + row * stride_l, Kth + row, cols, mask, temperature, SCALED, TOP_K)
    m = tl.max(z, axis=0)
    arg = tl.min(tl.where(z == m, cols, V), axis=0)  # the first index of the max, as torch.argmax
    s = tl.sum(tl.where(z > -float("inf"), tl.exp(z - m), 0.0), axis=0)  # a tile all outside the top k sums to 0
    tl.store(TileMax + row * NUM_TILES + tile, m)
    tl.store(TileSum + row * NUM_TILES + tile, s)
    tl.store(TileArg + row * NUM_TILES + tile, arg)


@triton.jit
def _pick_kernel(
    Logits,
    TileMax,
    TileSum,
    TileArg,
    Kth,
    U,  # [R] fp64 uniforms (unused when GREEDY)
    Tokens,  # [R] int64 out
    Logprobs,  # [R] fp32 out
    stride_l,
    V,
    temperature,
    NUM_TILES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SCALED: tl.constexpr,
    TOP_K: tl.constexpr,
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    t_valid = t < NUM_TILES
    m = tl.load(TileMax + row * NUM_TILES + t, mask=t_valid, other=-float("inf"))
    s = tl.load(TileSum + row * NUM_TILES + t, mask=t_valid, other=0.0)
    top = tl.max(m, axis=0)
    mass = s.to(tl.float64) * tl.where(t_valid, tl.exp(m - top), 0.0).to(tl.float64)  # [BLOCK_T]
    total = tl.sum(mass, axis=0)
    if GREEDY:
        first = tl.min(tl.where(m == top, t, NUM_TILES), axis=0)
        token = tl.load(TileArg + row * NUM_TILES + first).to(tl.int64)
        z_token = top
    else:
        target = tl.load(U + row) * total
        passed = tl.cumsum(mass, axis=0)  # mass up to and including each tile
        tile = tl.minimum(tl.sum((passed <= target) & t_valid, axis=0), NUM_TILES - 1)
        before = tl.sum(tl.where(t < tile, mass, 0.0), axis=0)
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = _processed(Logits + row * stride_l, Kth + row, cols, mask, temperature, SCALED, TOP_K)
        w = tl.where(z > -float("inf"), tl.exp(z - top), 0.0)
        cdf = before + tl.cumsum(w.to(tl.float64), axis=0)
        last = tl.minimum(V - tile * BLOCK_V, BLOCK_V) - 1  # the tile's last valid column
        k = tl.minimum(tl.sum((cdf <= target) & mask, axis=0), last)
        token = (tile * BLOCK_V + k).to(tl.int64)
        z_token = tl.sum(tl.where(tl.arange(0, BLOCK_V) == k, z, 0.0), axis=0)
    tl.store(Tokens + row, token)
    tl.store(Logprobs + row, ((z_token - top).to(tl.float64) - tl.log(total)).to(tl.float32))


@torch.library.custom_op("fastgrpo::sample", mutates_args=())
def fused_sample(
    logits: torch.Tensor,  # [R, V], the lm_head's dtype
    temperature: float,  # 0: greedy
    u: torch.Tensor | None,  # [R] fp64 in (0, 1); None when greedy
    kth: torch.Tensor | None = None,  # [R] fp32: each row's floor, for top-k and min-p (sampler.logit_floor)
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R] int64, logprobs [R] fp32
    """A torch custom op (torch.ops.fastgrpo.sample), so that fake tensors trace it and a byte counter sees it."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    greedy = temperature == 0
    assert greedy == (u is None)
    rows, vocab = logits.shape
    num_tiles = triton.cdiv(vocab, BLOCK_V)
    tile_max = logits.new_empty(rows, num_tiles, dtype=torch.float32)
    tile_sum = torch.empty_like(tile_max)
    tile_arg = logits.new_empty(rows, num_tiles, dtype=torch.int32)
    tokens = logits.new_empty(rows, dtype=torch.long)
    logprobs = logits.new_empty(rows, dtype=torch.float32)
    if not rows:
        return tokens, logprobs
    scaled = not greedy and temperature != 1
    top_k = not greedy and kth is not None  # greedy samples the raw logits, as processed_logits does
    if top_k:
        assert kth.shape == (rows,) and kth.dtype == torch.float32
    kth = kth.contiguous() if top_k else tile_max  # topk(...).values[:, -1] is a strided view
    _tile_stats_kernel[(rows, num_tiles)](
        logits, tile_max, tile_sum, tile_arg, kth, logits.stride(0), vocab, float(temperature or 1),
        NUM_TILES=num_tiles, SCALED=scaled, TOP_K=top_k, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
    )  # fmt: skip
    _pick_kernel[(rows,)](
        logits, tile_max, tile_sum, tile_arg, kth, tile_max if greedy else u, tokens, logprobs, logits.stride(0),
        vocab, float(temperature or 1), NUM_TILES=num_tiles, BLOCK_T=max(16, triton.next_power_of_2(num_tiles)),
        SCALED=scaled, TOP_K=top_k, GREEDY=greedy, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
    )  # fmt: skip
    return tokens, logprobs


@fused_sample.register_fake
def _(logits, temperature, u, kth=None):
    return logits.new_empty(logits.shape[0], dtype=torch.long), logits.new_empty(logits.shape[0], dtype=torch.float32)
