"""The attention function the engine registers with transformers, its three backends, and `register_backend`.

During `Engine.generate` the model's attention implementation is switched to ATTENTION_NAME through transformers'
public AttentionInterface. Every attention layer then sees the packed new tokens of all scheduled sequences
(batch 1, T tokens, each with its own position), writes their keys/values into the paged cache and attends over
each sequence's cached context. Everything else in the model (embeddings, norms, rotary, MLP, LoRA) runs unchanged.

An fp8 cache (EngineConfig.kv_cache_dtype="fp8") holds float8_e4m3fn values k / k_scale and v / v_scale, one
power-of-two scale per layer, K or V, and KV head (decode_layers.kv_scales): `store_kv` writes them, and the torch
and triton backends read them with their scales.
"""

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from fastgrpo.kernels.paged_attention import Tiles, attention_tiles, tiles_for
from fastgrpo.kernels.paged_attention import paged_attention as triton_paged_attention

ATTENTION_NAME = "fastgrpo_paged"
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: scaled values are clamped to it (a scale from the weights' bound never needs it)
# The backends that read fp8 pages (with their scales); flash-attn's paged kernels and registered backends do not.
FP8_BACKENDS = ("torch", "triton")


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """What one forward needs to find its keys/values; built complete for each step (build_paged_batch)."""

    kv_cache: torch.Tensor  # [layers, 2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32: cached tokens per sequence, this step's included
    query_starts: torch.Tensor  # [S + 1] int32: where each sequence's new tokens start in the packed batch
    context_starts: torch.Tensor | None  # [S + 1] int32: cumulative context_lens (flash-attn's cu_seqlens_k);
    # None in a decode-only step (one new token per sequence), where no kernel reads it
    max_query_len: int
    max_context_len: int
    backend: str
    tile_seqs: torch.Tensor | None = None  # [num_tiles] int32 (triton)
    tile_starts: torch.Tensor | None = None  # [num_tiles] int32 (triton)
    tiles: Tiles | None = None  # triton
    num_rows: int = 0  # the leading sequences that are decode rows (one new token each)
    kv_scales: torch.Tensor | None = None  # [layers, 2, Hkv] fp32: fp8 caches hold k / scale (None: no scales)


def triton_tiles(query_lens: list[int], group: int, dtype: torch.dtype) -> tuple[Tiles, list[int], list[int]]:
    """The triton backend's tile settings for a step, and each program's tile: (sequence, first new token)."""
    tiles = tiles_for(group, max(query_lens), dtype)
    tile_seqs, tile_starts = attention_tiles(query_lens, tiles.block_m // group)
    return tiles, tile_seqs, tile_starts


def build_paged_batch(
    kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, Hkv, D]
    slots: list[int],  # [T]: cache slot of each new token
    block_tables: list[list[int]],  # [S, max_blocks]
    query_lens: list[int],  # [S]: new tokens per sequence
    context_lens: list[int],  # [S]: cached tokens per sequence, this step's included
    backend: str,
    group: int,  # query heads per KV head
    rows: dict[str, torch.Tensor] | None = None,
    rows_max_context: int = 0,
    query_dtype: torch.dtype | None = None,  # the model's, when the cache's is not (fp8); picks the triton tiles
    kv_scales: torch.Tensor | None = None,  # [layers, 2, Hkv] fp32, for an fp8 cache
) -> PagedBatch:
    """The batch of one eager forward: first the decode rows (`rows`: device tensors of one new token per sequence,
    from DecodeBatch.inputs, whose longest context is `rows_max_context`), then the host lists' sequences; tiles
    planned here when the backend is triton. Only the host lists cost host work per sequence."""
    device = kv_cache.device
    num_rows = 0 if rows is None else rows["slots"].numel()

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    def joined(name, values, dtype):
        host = tensor(values, dtype) if values or rows is None else None
        return rows[name] if host is None else host if rows is None else torch.cat([rows[name], host])

    width = rows["block_tables"].shape[1] if rows is not None else None
    if rows is not None and block_tables and len(block_tables[0]) != width:
        raise ValueError(f"host block tables are {len(block_tables[0])} pages wide, the decode rows' {width}")
    tables = joined("block_tables", block_tables, torch.int32)
    context = joined("context_lens", context_lens, torch.int32)
    row_starts = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
    query_starts, context_starts = row_starts, None  # decode rows only: no kernel reads cumulative contexts
    if query_lens or rows is None:
        query_starts = torch.cat([row_starts, tensor(list(accumulate(query_lens)), torch.int32) + num_rows])
        context_starts = torch.cat([context.new_zeros(1), context.cumsum(0, dtype=torch.int32)])

    tiles, tile_seqs, tile_starts = None, None, None
    max_query_len = max(query_lens, default=1)
    if backend == "triton":  # a decode row is one tile: (its row, token 0)
        tiles = tiles_for(group, max_query_len, query_dtype or kv_cache.dtype)
        seqs, starts = attention_tiles(query_lens, tiles.block_m // group)
        tile_seqs = torch.cat([row_starts[:num_rows], tensor(seqs, torch.int32) + num_rows])
        tile_starts = torch.cat([torch.zeros_like(row_starts[:num_rows]), tensor(starts, torch.int32)])
    return PagedBatch(
        kv_cache=kv_cache,
        slot_mapping=joined("slots", slots, torch.long),
        block_tables=tables,
        context_lens=context,
        query_starts=query_starts,
        context_starts=context_starts,
        max_query_len=max_query_len,
        max_context_len=max(rows_max_context, max(context_lens, default=0)),
        backend=backend,
        tile_seqs=tile_seqs,
        tile_starts=tile_starts,
        tiles=tiles,
        num_rows=num_rows,
        kv_scales=kv_scales,
    )


_current: PagedBatch | None = None


@contextmanager
def paged_batch(batch: PagedBatch):
    global _current
    _current = batch
    try:
        yield
    finally:
        _current = None


def reference_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks]
    context_lens: torch.Tensor,  # [S]
    query_starts: torch.Tensor,  # [S + 1]
    scale: float,
    max_query_len: int | None = None,  # the longest query_lens / context_lens, when the caller knows them
    max_context_len: int | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: fp8 caches only, which hold k / k_scale
    v_scale: torch.Tensor | None = None,  # [Hkv] fp32
) -> torch.Tensor:  # [T, Hq, D]
    """Gather each sequence's pages (whole pages: one copy of block_size x Hkv x D per page) into a padded batch
    and run one masked SDPA call (the CPU path). A decode batch (one new token per sequence) needs no causal mask
    and no query gather: its mask is the context length alone. fp8 pages are gathered as they are (1 byte per
    element), then widened to the query's dtype and multiplied by their scales (exact: powers of two)."""
    block_size = k_cache.shape[1]
    context_lens = context_lens.long()
    num_seqs = block_tables.shape[0]
    max_context = int(context_lens.max()) if max_context_len is None else max_context_len
    num_pages = -(-max_context // block_size)
    pages = block_tables[:, :num_pages].reshape(-1)  # [S * num_pages]
    # index_select on the page dimension: one contiguous copy per page (advanced indexing takes ~2x as long on a CPU)
    gather = lambda cache: cache.index_select(0, pages).view(num_seqs, num_pages * block_size, *cache.shape[2:])
    keys, values = gather(k_cache), gather(v_cache)  # [S, C, Hkv, D], C = num_pages * block_size
    if k_scale is not None:
        keys = keys.to(query.dtype) * k_scale.to(query.dtype)[:, None]
        values = values.to(query.dtype) * v_scale.to(query.dtype)[:, None]
    pos = torch.arange(num_pages * block_size, device=query.device)  # [C]
    if query.shape[0] == num_seqs and (max_query_len == 1 or max_query_len is None and bool(
            (query_starts[1:] - query_starts[:-1] == 1).all())):
        visible = pos < context_lens[:, None]  # [S, C]
        out = F.scaled_dot_product_attention(query[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=visible[:, None, None], scale=scale, enable_gqa=True)
        return out[:, :, 0]  # [S, Hq, D]

    query_lens = (query_starts[1:] - query_starts[:-1]).long()  # [S]
    max_query = int(query_lens.max()) if max_query_len is None else max_query_len
    rows = torch.arange(max_query, device=query.device)  # [Q]
    row_valid = rows < query_lens[:, None]  # [S, Q]
    token = (query_starts[:-1, None].long() + rows).clamp(max=query.shape[0] - 1)
    queries = query[token]  # [S, Q, Hq, D]
    q_pos = (context_lens - query_lens)[:, None] + rows  # [S, Q]
    visible = (pos <= q_pos[:, :, None]) & (pos < context_lens[:, None, None])  # [S, Q, C]

    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=True,
    )  # [S, Hq, Q, D]
    return out.transpose(1, 2)[row_valid]


def _torch_backend(query, k_cache, v_cache, batch: PagedBatch, scale: float, k_scale=None, v_scale=None):
    """A step that mixes decode rows with longer chunks (prompts, continuations after a tool call) runs the rows
    apart: padded to the longest chunk, each row would cost that chunk's length in queries (6.5 ms instead of
    1.5 ms a layer for 32 rows of 384 positions and one 17-token chunk, 8 query and 2 KV heads of 32, 2 CPU
    threads)."""
    rows = batch.num_rows
    if rows == 0 or batch.max_query_len == 1 or rows == batch.block_tables.shape[0]:
        return reference_paged_attention(
            query, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_starts, scale,
            batch.max_query_len, batch.max_context_len, k_scale, v_scale,
        )  # fmt: skip
    decode = reference_paged_attention(
        query[:rows], k_cache, v_cache, batch.block_tables[:rows], batch.context_lens[:rows],
        batch.query_starts[: rows + 1], scale, 1, batch.max_context_len, k_scale, v_scale,
    )  # fmt: skip
    chunks = reference_paged_attention(
        query[rows:], k_cache, v_cache, batch.block_tables[rows:], batch.context_lens[rows:],
        batch.query_starts[rows:] - rows, scale, batch.max_query_len, batch.max_context_len, k_scale, v_scale,
    )  # fmt: skip
    return torch.cat([decode, chunks])


def _triton_backend(query, k_cache, v_cache, batch: PagedBatch, scale: float, k_scale=None, v_scale=None):
    return triton_paged_attention(
        query,
        k_cache,
        v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_starts,
        batch.tile_seqs,
        batch.tile_starts,
        scale,
        batch.tiles,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def _flash_backend(query, k_cache, v_cache, batch: PagedBatch, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    if batch.max_query_len == 1:
        out = flash_attn_with_kvcache(
            query.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=batch.context_lens,
            block_table=batch.block_tables,
            softmax_scale=scale,
            causal=True,
        )
        return out.squeeze(1)
    # Causal with fewer queries than keys aligns the queries to the end of the context (flash-attn >= 2.1).
    return flash_attn_varlen_func(
        query,
        k_cache,
        v_cache,
        cu_seqlens_q=batch.query_starts,
        cu_seqlens_k=batch.context_starts,
        max_seqlen_q=batch.max_query_len,
        max_seqlen_k=batch.max_context_len,
        softmax_scale=scale,
        causal=True,
        block_table=batch.block_tables,
    )


BACKENDS: dict[str, Callable] = {"torch": _torch_backend, "triton": _triton_backend, "flash": _flash_backend}
BUILT_IN = tuple(BACKENDS)
# The backends with which the engine runs its Triton kernels (decode layers, sampler): where Triton runs.
TRITON_BACKENDS = {"triton", "flash"}


def register_backend(name: str, forward: Callable, *, triton: bool = False) -> None:
    """Adds (or replaces) the attention backend `EngineConfig(attention=name)` selects; the built-in ones stay.
    forward(query [T, Hq, D], k_cache, v_cache [num_blocks, block_size, Hkv, D], batch: PagedBatch, scale) -> [T, Hq, D]
    attends each new token over its sequence's cached context (the step's keys/values are in the cache). `triton`:
    the engine runs its Triton decode layers and sampler with it, as with "triton" and "flash"."""
    if name in ("auto", *BUILT_IN):
        raise ValueError(f"attention backend {name!r} is built in; register another name")
    BACKENDS[name] = forward
    if triton:
        TRITON_BACKENDS.add(name)
    else:
        TRITON_BACKENDS.discard(name)


def layer_kv(batch: PagedBatch, layer: int):
    """(k_cache, v_cache [num_blocks, block_size, Hkv, D], k_scale, v_scale [Hkv] or None) of one layer."""
    k_cache, v_cache = batch.kv_cache[layer].unbind(0)
    k_scale, v_scale = (None, None) if batch.kv_scales is None else batch.kv_scales[layer].unbind(0)
    return k_cache, v_cache, k_scale, v_scale


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] -> float8_e4m3fn x / scale, clamped to +-448 (scale [Hkv] fp32, powers of two: exact division;
    then one round to nearest even, as the GPU's cvt.rn.satfinite does)."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def store_kv(k_cache, v_cache, slots, key, value, k_scale=None, v_scale=None) -> None:
    """Write the new tokens' key/value [T, Hkv, D] into their slots [T]: rounded to the cache's dtype, or quantized
    with the layer's scales into an fp8 cache."""
    if k_scale is not None:
        key, value = quantize_kv(key, k_scale), quantize_kv(value, v_scale)
    k_cache.flatten(0, 1)[slots] = key.to(k_cache.dtype)
    v_cache.flatten(0, 1)[slots] = value.to(v_cache.dtype)


def attend(query, k_cache, v_cache, batch: PagedBatch, scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """[T, Hq, D]: the step's attention through its backend; fp8 caches pass their scales (torch and triton)."""
    if k_scale is None:
        return BACKENDS[batch.backend](query, k_cache, v_cache, batch, scale)
    return BACKENDS[batch.backend](query, k_cache, v_cache, batch, scale, k_scale, v_scale)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention signature: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None)."""
    batch = _current
    if batch is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' only runs inside fastgrpo.sampling.Engine.generate")
    if query.shape[0] != 1:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' expects the packed batch of 1, got {query.shape[0]}")
    k_cache, v_cache, k_scale, v_scale = layer_kv(batch, module.layer_idx)  # [num_blocks, block_size, Hkv, D]
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    q = q if k_scale is not None else q.to(k_cache.dtype)  # (an fp8 cache's queries stay in the model's dtype)
    store_kv(k_cache, v_cache, batch.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1), k_scale, v_scale)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = attend(q, k_cache, v_cache, batch, scale, k_scale, v_scale)  # [T, Hq, D]
    return out.to(query.dtype).unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
