"""Shared helpers of the paged attention tests: scattered KV pages, a float64 dense ground truth written independently
of the kernels (page by page in Python, explicit causal softmax), the test batches, and one case run through the
float64 truth, the torch reference and the Triton kernel."""

import torch

from fastgrpo.kernels.paged_attention import attention_tiles, paged_attention, tiles_for
from fastgrpo.sampling.attention import reference_paged_attention


def make_cache(seqs, num_kv_heads, head_dim, block_size, share_prefix, seed):
    """seqs: [(context_len, query_len)]. Pages are scattered at random; with share_prefix, every sequence's full
    pages of the first sequence's context are the first sequence's own pages (as after a fork)."""
    g = torch.Generator().manual_seed(seed)
    shared = seqs[0][0] // block_size if share_prefix else 0
    needs = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(needs) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for i, need in enumerate(needs):
        own = [] if i == 0 else tables[0][: min(shared, need)]
        while len(own) < need:
            own.append(order.pop())
        tables.append(own)
    width = max(needs)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    return tables, block_tables, k_cache, v_cache


def dense_attention(query, k_cache, v_cache, tables, seqs, scale):
    """float64 [T, Hq, D]: sequence by sequence, page by page, explicit causal softmax."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out, t = torch.zeros_like(query, dtype=torch.float64), 0
    for (ctx, q_len), table in zip(seqs, tables, strict=True):
        keys = torch.stack([k_cache[table[p // block_size], p % block_size] for p in range(ctx)])  # [ctx, Hkv, D]
        values = torch.stack([v_cache[table[p // block_size], p % block_size] for p in range(ctx)])
        for i in range(q_len):
            pos = ctx - q_len + i
            for h in range(query.shape[1]):
                scores = keys[: pos + 1, h // group] @ query[t + i, h].double() * scale  # [pos + 1]
                out[t + i, h] = scores.softmax(0) @ values[: pos + 1, h // group]
        t += q_len
    return out


# (context_len, query_len) per sequence; block size B. Decode rows have query_len 1.
def batches(B):
    return {
        "decode_1": [(1, 1)],
        "decode_block": [(B, 1), (B + 1, 1), (2 * B + 3, 1)],
        "decode_long": [(150, 1), (3, 1)],
        "prefill": [(1, 1), (B, B), (B + 1, B + 1), (90, 90)],
        "chunked_prefill": [(B + 7, 7), (3 * B, B + 1)],
        "mixed": [(40, 1), (B + 1, B + 1), (2 * B + 2, 5), (1, 1), (70, 1)],
    }


def run_case(batch, group, block_size, head_dim, share_prefix, tiles, seed=0, device="cpu", dtype=torch.float32):
    """float64 dense truth, the torch reference in float64 and in `dtype`, the Triton kernel in `dtype`."""
    seqs = batches(block_size)[batch]
    num_kv_heads = 2
    tables, block_tables, k64, v64 = make_cache(seqs, num_kv_heads, head_dim, block_size, share_prefix, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q_lens = [q for _, q in seqs]
    q64 = torch.randn(sum(q_lens), group * num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    q64, k64, v64 = (t.to(dtype).double() for t in (q64, k64, v64))  # truth of the rounded inputs
    context_lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    query_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5

    truth = dense_attention(q64, k64, v64, tables, seqs, scale)
    ref64 = reference_paged_attention(q64, k64, v64, block_tables, context_lens, query_starts, scale)
    q, k, v, block_tables, context_lens, query_starts = (
        t.to(device, dtype if t.is_floating_point() else t.dtype)
        for t in (q64, k64, v64, block_tables, context_lens, query_starts))
    ref = reference_paged_attention(q, k, v, block_tables, context_lens, query_starts, scale)
    tiles = tiles or tiles_for(group, max(q_lens), dtype)
    tile_seqs, tile_starts = attention_tiles(q_lens, tiles.block_m // group)
    as_i32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)
    fast = paged_attention(q, k, v, block_tables, context_lens, query_starts, as_i32(tile_seqs), as_i32(tile_starts),
                           scale, tiles)
    return truth, ref64, ref.cpu(), fast.cpu()
