"""Paged attention over a block KV cache, for prefill, decode and mixed batches in one launch.

Math, per query token t of sequence s (absolute position p_t), query head h, its KV head g = h // GROUP:

    scores_j = (q_{t,h} . k_{j,g}) * scale            for cached positions j <= p_t   (causal)
    out_{t,h} = sum_j softmax(scores)_j v_{j,g}        (fp32 softmax, online over KV tiles)

Keys/values live in pages: cache[block, offset, kv_head, dim] with block = block_table[s, j // BLOCK_SIZE].
The plain-PyTorch equivalent is `fastgrpo.sampling.attention.reference_paged_attention`.

fp8 pages (kv_cache_dtype="fp8") hold e4m3 values k_j / k_scale_g and v_j / v_scale_g, one power-of-two scale per KV
head (fastgrpo.sampling.decode_layers.kv_scales). A tile is widened to the query's dtype on load (exactly: every e4m3
value is a bf16 value) and the scales fold into the softmax scale and the output, which is exact for powers of two:

    scores_j = (q . k8_j) * (scale * k_scale_g);   out = v_scale_g * sum_j softmax(scores)_j v8_j

Variants (fastgrpo.sampling.attention.Variant), each a constexpr flag so a plain model's kernel is unchanged:
  - WINDOW > 0 (sliding window): only positions j > p_t - WINDOW are visible, and the KV loop starts at the tile
    of the first position its first token sees: tiles wholly outside the window are neither loaded nor computed.
  - SOFTCAP: scores_j = softcap * tanh(scores_j / softcap) (Gemma 2), before the mask.
  - SINKS: a per-query-head logit s_h joins the denominator: out = sum_j e^{scores_j} v_j / (e^{s_h} + sum_j
    e^{scores_j}) (gpt-oss); folded in once after the KV loop.

One program handles one KV head and a tile of BLOCK_M rows, where a row is (query token, query head of the
group): GQA heads that share a KV head share every K/V load, and decode (one token per sequence) still fills a
tensor-core tile once GROUP * tokens >= 16.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# tl.dot needs M, N, K >= 16.
MIN_DOT = 16


class Tiles(NamedTuple):
    block_m: int  # rows (query token x head of the group) per program
    block_n: int  # KV positions per inner step; independent of the page size (a tile may straddle pages)
    num_warps: int
    num_stages: int


def tiles_for(group: int, max_query_len: int, dtype: torch.dtype, head_dim: int = 128) -> Tiles:
    """Tile settings; each one builds without register spills for sm_90 and sm_80 at head_dim 128 (tests/aot.py).

    Decode (one query token per sequence) takes the smallest tile that holds a GQA group: 16 x 64 with 4 warps,
    96/117 registers (sm_90/sm_80) in bf16. Prefill takes 64 query rows per K/V load: 64 x 64 with 4 warps spills
    on sm_80 (255 registers), with 8 warps it needs 140/172. fp32 ("ieee" products) takes 16 x 32 with 8 warps and
    one stage at every head dim: 48-198 registers (16 x 64 with 4 warps spills with gpt-oss's sinks and at 256+).
    `dtype` is the queries' (the model's): over fp8 pages, widened to it on load, the bf16 tiles need 148 (decode)
    and 127 (prefill) registers on sm_90, without spills.

    Wider heads keep the query rows and shorten the K/V tiles: head_dim 256 (Gemma 2/3) decodes 16 x 32 with 4 warps
    (123/156 registers, 42 KB shared) and prefills 64 x 32 with 8 (183/189, 98/70 KB); head_dim 512 (Gemma 4's global
    layers) 16 x 32 with 8 warps (113/111, 83 KB) and 32 x 32 with 8 (144/182, 100 KB). 64 x 64 at 512 spills and
    needs 320 KB of shared memory, more than an H100 has (228 KB).
    """
    smallest = max(MIN_DOT, triton.next_power_of_2(group))
    if dtype == torch.float32:  # ("ieee" products on the FMA units: 32-position tiles over 8 warps)
        return Tiles(smallest, 32, 8, 1)
    if head_dim > 128:  # Gemma's 256 and Gemma 4's global 512: shorter K/V tiles (and 8 warps at 512 or prefill)
        wide = head_dim > 256
        if max_query_len == 1:
            return Tiles(smallest, 32, 8 if wide else 4, 2)
        return Tiles(max(32 if wide else 64, smallest), 32, 8, 2)
    if max_query_len == 1:
        return Tiles(smallest, 64, 4, 2)
    return Tiles(max(64, smallest), 64, 8, 2)


LOG2E = tl.constexpr(1.4426950408889634)  # scores are exponentiated with exp2


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D] new tokens of all sequences, packed
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    out_ptr,  # [T, Hq, D]
    block_tables_ptr,  # [S, max_blocks] int32
    context_lens_ptr,  # [S] int32: cached tokens incl. this step's
    query_starts_ptr,  # [S + 1] int32: offsets of each sequence's new tokens in q
    tile_seqs_ptr,  # [num_tiles] int32: sequence of each tile
    tile_starts_ptr,  # [num_tiles] int32: first query token of each tile, within its sequence
    k_scale_ptr,  # [Hkv] fp32: fp8 pages hold k / k_scale (unused without KV_SCALED)
    v_scale_ptr,  # [Hkv] fp32
    sinks_ptr,  # [Hq] fp32 sink logits (unused without SINKS)
    scale,  # fp32 softmax scale
    softcap,  # fp32 cap on scores (unused without SOFTCAP)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_SCALED: tl.constexpr,
    WINDOW: tl.constexpr,  # 0: no sliding window
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seqs_ptr + tile)
    tile_start = tl.load(tile_starts_ptr + tile)
    q_start = tl.load(query_starts_ptr + seq)
    q_len = tl.load(query_starts_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    TOKENS: tl.constexpr = BLOCK_M // GROUP

    # -- rows: (query token, head of the group) --
    rows = tl.arange(0, BLOCK_M)
    token = tile_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < TOKENS * GROUP) & (token < q_len)
    q_pos = context_len - q_len + token  # absolute position of each row's token
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    q_offsets = (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    qk_scale = tl.cast(scale, tl.float32)
    if not SOFTCAP:  # (with a cap, scores are capped in natural units and then taken to log2 units)
        qk_scale = qk_scale * LOG2E
    if KV_SCALED:  # powers of two: folding them in here equals scaling every key and value (bar underflow)
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    # Finite start so fully masked rows (padding) give p = 0 instead of exp2(-inf + inf) = nan.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Causal: this tile never looks past its last token's position.
    kv_end = context_len - q_len + tl.minimum(tile_start + TOKENS, q_len)
    kv_first = 0
    if WINDOW > 0:  # the tile's first token sees positions from its own position - WINDOW + 1 on
        kv_first = tl.maximum(context_len - q_len + tile_start - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for kv_start in range(kv_first, kv_end, BLOCK_N):
        kv_pos = kv_start + tl.arange(0, BLOCK_N)
        kv_valid = kv_pos < kv_end
        block = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        in_block = kv_pos % BLOCK_SIZE
        kv_mask = kv_valid[:, None] & d_valid[None, :]
        k_offsets = block[:, None] * stride_kb + in_block[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + k_offsets, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]

        # -- scores, in log2 units --
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1); then log2 units
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)) * LOG2E
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        if WINDOW > 0:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, -float("inf"))

        # -- online softmax --
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_offsets = block[:, None] * stride_vb + in_block[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        v = tl.load(v_cache_ptr + v_offsets, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINKS:  # the sink joins the denominator only: rescale to the larger of the running max and the sink
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * LOG2E  # [BLOCK_M]
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    if KV_SCALED:
        acc = acc * v_scale
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offsets = (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def attention_tiles(query_lens: list[int], tokens_per_tile: int) -> tuple[list[int], list[int]]:
    """Split each sequence's new tokens into tiles of `tokens_per_tile`: (sequence, first token) per tile."""
    tile_seqs, tile_starts = [], []
    for seq, q_len in enumerate(query_lens):
        for start in range(0, q_len, tokens_per_tile):
            tile_seqs.append(seq)
            tile_starts.append(start)
    return tile_seqs, tile_starts


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32
    query_starts: torch.Tensor,  # [S + 1] int32
    tile_seqs: torch.Tensor,  # [num_tiles] int32, from attention_tiles
    tile_starts: torch.Tensor,  # [num_tiles] int32
    scale: float,
    tiles: Tiles,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: fp8 caches only, which hold k / k_scale
    v_scale: torch.Tensor | None = None,  # [Hkv] fp32
    window: int | None = None,  # sliding window: the last `window` positions, the token's own included
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] fp32
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached keys/values (which include them). The caches
    are in the query's dtype, or float8_e4m3fn with their per-KV-head scales (powers of two); a sliding window,
    softcap and sinks as the module's docstring says."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    assert tiles.block_m >= group and tiles.block_m & (tiles.block_m - 1) == 0, (tiles, group)
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    scaled = k_cache.dtype == torch.float8_e4m3fn
    same_dtype = k_cache.dtype == query.dtype and k_scale is None
    assert same_dtype or (scaled and query.dtype != torch.float8_e4m3fn), (query.dtype, k_cache.dtype)
    if scaled:
        for s in (k_scale, v_scale):
            assert s is not None and s.dtype == torch.float32 and s.shape == (num_kv_heads,) and s.is_contiguous()
    assert block_tables.dtype == context_lens.dtype == query_starts.dtype == torch.int32
    assert query_starts.numel() == context_lens.numel() + 1 == block_tables.shape[0] + 1
    assert tile_seqs.shape == tile_starts.shape
    assert window is None or window >= 1, window
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.shape == (num_heads,) and sinks.is_contiguous()
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    grid = (tile_seqs.numel(), num_kv_heads)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        query_starts,
        tile_seqs,
        tile_starts,
        k_scale if scaled else context_lens,  # (a placeholder pointer when unused)
        v_scale if scaled else context_lens,
        sinks if sinks is not None else context_lens,
        scale,
        float(softcap or 0.0),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        # fp32 models get fp32 products (tf32 would cost ~1e-3 relative error).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_SCALED=scaled,
        WINDOW=window or 0,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
