"""The Triton paged attention kernel (interpreter, fp32) and the torch reference backend vs float64 dense attention.

Ground truth is written independently of both: each sequence's keys/values are read page by page in Python and
attended with an explicit causal softmax in float64 (tests/paged_attention_helpers.py).
"""

import pytest
import torch
from helpers import assert_no_worse
from paged_attention_helpers import batches, dense_attention, make_cache, run_case

from fastgrpo.kernels.paged_attention import Tiles, attention_tiles, tiles_for
from fastgrpo.sampling.attention import reference_paged_attention


@pytest.mark.parametrize("batch", list(batches(16)))
@pytest.mark.parametrize("group", [1, 6, 7])
def test_triton_matches_reference(batch, group):
    truth, ref64, ref32, fast = run_case(batch, group, block_size=16, head_dim=32, share_prefix=False, tiles=None)
    assert_no_worse(f"reference[{batch}]", ref64, ref64, truth, torch.float64)
    assert_no_worse(f"triton[{batch}]", fast, ref32, truth, torch.float32)


@pytest.mark.parametrize("batch", ["decode_block", "mixed"])
def test_shared_prefix_pages(batch):
    """Forked sequences read the same physical pages for their common prefix."""
    truth, _, ref32, fast = run_case(batch, 6, block_size=8, head_dim=32, share_prefix=True, tiles=None)
    assert_no_worse(f"triton[{batch}]", fast, ref32, truth, torch.float32)


@pytest.mark.parametrize("tiles", [Tiles(64, 64, 8, 2), Tiles(32, 16, 4, 2), Tiles(16, 32, 4, 1)])
@pytest.mark.parametrize("block_size,head_dim", [(5, 24), (16, 16), (32, 64)])
def test_tiles_pages_and_head_dims(tiles, block_size, head_dim):
    """KV tiles straddle pages of any size (5 is not a power of two); head_dim 24 is padded to 32; 64-row tiles
    hold several tokens of a group of 7."""
    truth, _, ref32, fast = run_case("mixed", 7, block_size, head_dim, share_prefix=True, tiles=tiles, seed=3)
    assert_no_worse("triton", fast, ref32, truth, torch.float32)


def test_tiles_cover_every_query_token():
    tile_seqs, tile_starts = attention_tiles([1, 5, 9], 4)
    assert tile_seqs == [0, 1, 1, 2, 2, 2] and tile_starts == [0, 0, 4, 0, 4, 8]


def test_flash_backend_arguments(monkeypatch):
    """The flash-attn backend's arguments, checked on CPU against a stand-in with flash-attn's documented paged
    semantics: varlen takes cumulative query and context lengths (causal aligned to the context's end);
    with_kvcache takes [S, 1, H, D] queries and the cached lengths."""
    import sys
    import types

    from fastgrpo.sampling.attention import PagedBatch, _flash_backend

    def tables_of(block_table, lens, block_size):
        return [block_table[i, : -(-n // block_size)].tolist() for i, n in enumerate(lens)]

    def varlen(q, k_cache, v_cache, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
               block_table):
        assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == block_table.dtype == torch.int32
        q_lens, k_lens = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
        assert max_seqlen_q == max(q_lens) and max_seqlen_k == max(k_lens)
        seqs = list(zip(k_lens, q_lens, strict=True))
        return dense_attention(q, k_cache, v_cache, tables_of(block_table, k_lens, k_cache.shape[1]), seqs,
                               softmax_scale).to(q.dtype)

    def with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal):
        assert causal and q.shape[1] == 1 and cache_seqlens.dtype == torch.int32
        lens = cache_seqlens.tolist()
        out = dense_attention(q[:, 0], k_cache, v_cache, tables_of(block_table, lens, k_cache.shape[1]),
                              [(n, 1) for n in lens], softmax_scale)
        return out.to(q.dtype)[:, None]

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen,
                                                                        flash_attn_with_kvcache=with_kvcache))
    as_i32 = lambda values: torch.tensor(values, dtype=torch.int32)
    cumulative = lambda values: as_i32([0, *torch.tensor(values).cumsum(0).tolist()])
    for batch in ("mixed", "decode_block"):  # varlen, then with_kvcache
        seqs = batches(16)[batch]
        tables, block_tables, k, v = make_cache(seqs, 2, 32, 16, True, seed=5)
        q_lens, ctx = [q for _, q in seqs], [c for c, _ in seqs]
        q = torch.randn(sum(q_lens), 12, 32, dtype=torch.float64)
        paged = PagedBatch(kv_cache=torch.stack([k, v])[None], slot_mapping=torch.zeros(0, dtype=torch.long),
                           block_tables=block_tables, context_lens=as_i32(ctx), query_starts=cumulative(q_lens),
                           context_starts=cumulative(ctx), max_query_len=max(q_lens), max_context_len=max(ctx),
                           backend="flash")
        got = _flash_backend(q, k, v, paged, 0.2)
        want = reference_paged_attention(q, k, v, block_tables, as_i32(ctx), cumulative(q_lens), 0.2)
        assert torch.allclose(got, want, atol=1e-12), batch


def test_decode_reads_each_kv_page_once_per_kv_head(monkeypatch):
    """A decode step launches one program per (sequence, KV head), each stepping through its context once, so the
    K/V bytes read are those of the cached tokens (rounded up to BLOCK_N) per KV head, not per query head;
    tests/test_aot.py checks that a program's PTX copies one K and one V tile per step."""
    from fastgrpo.kernels import paged_attention as module

    grids = []
    kernel = module._paged_attention_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, "_paged_attention_kernel", Recorder())
    group, head_dim, block_size = 6, 32, 16
    truth, _, _, fast = run_case("decode_block", group, block_size, head_dim, share_prefix=False, tiles=None)
    torch.testing.assert_close(fast.double(), truth, rtol=0, atol=1e-5)
    contexts = [c for c, _ in batches(block_size)["decode_block"]]
    (grid,) = grids
    assert grid == (len(contexts), 2)  # sequences x KV heads (2 in run_case), not x query heads (12)
    assert tiles_for(group, 1, torch.bfloat16).block_m >= group  # a decode program holds the whole group
