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
from dataclasses import dataclass, replace
from itertools import accumulate

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from fastgrpo.kernels.paged_attention import Tiles, attention_tiles, tiles_for
from fastgrpo.kernels.paged_attention import paged_attention as triton_paged_attention
from fastgrpo.sampling.kv_cache import KVCache

ATTENTION_NAME = "fastgrpo_paged"
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: scaled values are clamped to it (a scale from the weights' bound never needs it)
# The backends that read fp8 pages (with their scales); flash-attn's paged kernels and registered backends do not.
FP8_BACKENDS = ("torch", "triton")


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """What one forward needs to find its keys/values; built complete for each step (build_paged_batch)."""

    kv_cache: KVCache  # per layer, its key and value pages [num_blocks + 1, block_size, Hkv, D]
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token, pool 0
    block_tables: torch.Tensor  # [S, max_blocks] int32, pool 0 (the logical pages)
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
    pool_slots: torch.Tensor | None = None  # [pools, T] int64: every pool's slots (None: one pool)
    pool_tables: torch.Tensor | None = None  # [pools, S, max_blocks] int32

    def for_pool(self, pool: int) -> "PagedBatch":
        """The batch as seen by the layers of page pool `pool` (pages.PagePool): its slots and block tables."""
        if pool == 0:
            return self
        return replace(self, slot_mapping=self.pool_slots[pool], block_tables=self.pool_tables[pool])


def triton_tiles(query_lens: list[int], group: int, dtype: torch.dtype,
                 head_dim: int = 128) -> tuple[Tiles, list[int], list[int]]:
    """The triton backend's tile settings for a step, and each program's tile: (sequence, first new token)."""
    tiles = tiles_for(group, max(query_lens), dtype, head_dim)
    tile_seqs, tile_starts = attention_tiles(query_lens, tiles.block_m // group)
    return tiles, tile_seqs, tile_starts


def build_paged_batch(
    kv_cache: KVCache | torch.Tensor,  # or one [layers, 2, num_blocks, block_size, Hkv, D] tensor (one pool)
    slots: list,  # [pools][T]: cache slot of each new token in each page pool ([T] with one pool)
    block_tables: list,  # [pools][S][max_blocks] ([S][max_blocks] with one pool)
    query_lens: list[int],  # [S]: new tokens per sequence
    context_lens: list[int],  # [S]: cached tokens per sequence, this step's included
    backend: str,
    group: int,  # query heads per KV head
    rows: dict[str, torch.Tensor] | None = None,
    rows_max_context: int = 0,
    query_dtype: torch.dtype | None = None,  # the model's, when the cache's is not (fp8); picks the triton tiles
    kv_scales: torch.Tensor | None = None,  # [layers, 2, Hkv] fp32, for an fp8 cache
    head_dim: int = 128,  # the widest layer's (one tile setting serves every layer)
) -> PagedBatch:
    """The batch of one eager forward: first the decode rows (`rows`: device tensors of one new token per sequence,
    from DecodeBatch.inputs, whose longest context is `rows_max_context`), then the host lists' sequences; tiles
    planned here when the backend is triton. Only the host lists cost host work per sequence."""
    if isinstance(kv_cache, torch.Tensor):  # one pool: lists and rows without the pool dimension
        kv_cache, slots, block_tables = KVCache.from_tensor(kv_cache), [slots], [block_tables]
        if rows is not None and rows["slots"].dim() == 1:
            rows = dict(rows, slots=rows["slots"][None], block_tables=rows["block_tables"][None])
    device = kv_cache.device
    num_pools = len(kv_cache.pool_pages)
    if not context_lens:  # no host sequences: empty per-pool lists
        slots, block_tables = [[] for _ in range(num_pools)], [[] for _ in range(num_pools)]
    num_rows = 0 if rows is None else rows["slots"].shape[1]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    def joined(name, values, dtype, dim=0):
        host = tensor(values, dtype) if len(context_lens) or rows is None else None
        return rows[name] if host is None else host if rows is None else torch.cat([rows[name], host], dim)

    width = rows["block_tables"].shape[2] if rows is not None else None
    if rows is not None and block_tables[0] and len(block_tables[0][0]) != width:
        raise ValueError(f"host block tables are {len(block_tables[0][0])} pages wide, the decode rows' {width}")
    all_tables = joined("block_tables", block_tables, torch.int32, 1)  # [pools, S, width]
    all_slots = joined("slots", slots, torch.long, 1)  # [pools, T]
    if all_tables.dim() == 2:  # no sequences at all
        all_tables = all_tables.view(num_pools, 0, 0)
    context = joined("context_lens", context_lens, torch.int32)
    row_starts = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
    query_starts, context_starts = row_starts, None  # decode rows only: no kernel reads cumulative contexts
    if query_lens or rows is None:
        query_starts = torch.cat([row_starts, tensor(list(accumulate(query_lens)), torch.int32) + num_rows])
        context_starts = torch.cat([context.new_zeros(1), context.cumsum(0, dtype=torch.int32)])

    tiles, tile_seqs, tile_starts = None, None, None
    max_query_len = max(query_lens, default=1)
    if backend == "triton":  # a decode row is one tile: (its row, token 0)
        tiles = tiles_for(group, max_query_len, query_dtype or kv_cache.dtype, head_dim)
        seqs, starts = attention_tiles(query_lens, tiles.block_m // group)
        tile_seqs = torch.cat([row_starts[:num_rows], tensor(seqs, torch.int32) + num_rows])
        tile_starts = torch.cat([torch.zeros_like(row_starts[:num_rows]), tensor(starts, torch.int32)])
    return PagedBatch(
        kv_cache=kv_cache,
        slot_mapping=all_slots[0],
        block_tables=all_tables[0],
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
        pool_slots=all_slots if num_pools > 1 else None,
        pool_tables=all_tables if num_pools > 1 else None,
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


@dataclass(frozen=True, slots=True)
class Variant:
    """How a layer's attention differs from plain causal softmax attention (layers.AttentionLayer; None: it does not).

        scores_j = softcap * tanh(q . k_j * scale / softcap)          (softcap)
        visible: j <= p and j > p - window                           (window; p: the query's position)
        out = sum_j exp(scores_j) v_j / (exp(sink_h) + sum_j exp(scores_j))   (sinks [Hq] fp32)
    """

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [Hq]

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None


PLAIN = Variant()


def reference_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    block_tables: torch.Tensor,  # [S, max_blocks]
    context_lens: torch.Tensor,  # [S]
    query_starts: torch.Tensor,  # [S + 1]
    scale: float,
    max_query_len: int | None = None,  # the longest query_lens / context_lens, when the caller knows them
    max_context_len: int | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv] fp32: fp8 caches only, which hold k / k_scale
    v_scale: torch.Tensor | None = None,  # [Hkv] fp32
    variant: Variant = PLAIN,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Gather each sequence's pages (whole pages: one copy of block_size x Hkv x D per page) into a padded batch
    and run one masked SDPA call (the CPU path). A decode batch (one new token per sequence) needs no causal mask
    and no query gather: its mask is the context length alone. fp8 pages are gathered as they are (1 byte per
    element), then widened to the query's dtype and multiplied by their scales (exact: powers of two). A sliding
    window gathers from the first page any query of the batch reads; softcaps and sinks run the softmax written out
    (as transformers' eager attention does), in the query's dtype."""
    block_size = k_cache.shape[1]
    context_lens = context_lens.long()
    num_seqs = block_tables.shape[0]
    max_context = int(context_lens.max()) if max_context_len is None else max_context_len
    num_pages = -(-max_context // block_size)
    decode = query.shape[0] == num_seqs and (max_query_len == 1 or max_query_len is None and bool(
        (query_starts[1:] - query_starts[:-1] == 1).all()))
    first_page = 0
    if variant.window is not None:  # pages every query of the batch has left behind are not gathered
        query_lens = (query_starts[1:] - query_starts[:-1]).long()
        first_page = max(0, int((context_lens - query_lens).min()) - variant.window + 1) // block_size
    pages = block_tables[:, first_page:num_pages].reshape(-1)  # [S * pages]
    width = num_pages - first_page
    # index_select on the page dimension: one contiguous copy per page (advanced indexing takes ~2x as long on a CPU)
    gather = lambda cache: cache.index_select(0, pages).view(num_seqs, width * block_size, *cache.shape[2:])
    keys, values = gather(k_cache), gather(v_cache)  # [S, C, Hkv, D], C = pages * block_size
    if k_scale is not None:
        keys = keys.to(query.dtype) * k_scale.to(query.dtype)[:, None]
        values = values.to(query.dtype) * v_scale.to(query.dtype)[:, None]
    pos = first_page * block_size + torch.arange(width * block_size, device=query.device)  # [C]
    if decode:
        q_pos = (context_lens - 1)[:, None]  # [S, 1]
        visible = (pos <= q_pos)[:, None]  # [S, 1, C]
        queries = query[:, None]  # [S, 1, Hq, D]
    else:
        query_lens = (query_starts[1:] - query_starts[:-1]).long()  # [S]
        max_query = int(query_lens.max()) if max_query_len is None else max_query_len
        rows = torch.arange(max_query, device=query.device)  # [Q]
        row_valid = rows < query_lens[:, None]  # [S, Q]
        token = (query_starts[:-1, None].long() + rows).clamp(max=query.shape[0] - 1)
        queries = query[token]  # [S, Q, Hq, D]
        q_pos = (context_lens - query_lens)[:, None] + rows  # [S, Q]
        visible = (pos <= q_pos[:, :, None]) & (pos < context_lens[:, None, None])  # [S, Q, C]
    if variant.window is not None:
        visible = visible & (pos > q_pos[:, :, None] - variant.window)
    if variant.softcap is None and variant.sinks is None:
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=visible[:, None], scale=scale, enable_gqa=True)  # [S, Hq, Q, Dv]
    else:
        out = _written_out(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), visible[:, None],
                           scale, variant)  # fmt: skip
    out = out.transpose(1, 2)  # [S, Q, Hq, Dv]
    return out[:, 0] if decode else out[row_valid]


def _written_out(query, key, value, visible, scale: float, variant: Variant) -> torch.Tensor:
    """query [S, Hq, Q, D], key/value [S, Hkv, C, D], visible [S, 1, Q, C] -> [S, Hq, Q, Dv]: the softmax with a
    softcap and/or sinks, in the query's dtype, as transformers' eager attention computes it."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query @ key.transpose(-1, -2) * scale  # [S, Hq, Q, C]
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if variant.sinks is not None:
        sinks = variant.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sinks], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
    # gpt-oss's eager attention takes the softmax with sinks in the model's dtype, Gemma 2's in fp32.
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype if variant.sinks is not None else torch.float32)
    if variant.sinks is not None:
        probs = probs[..., :-1]
    return (probs.to(value.dtype) @ value).nan_to_num_(0.0)  # rows with nothing visible (padding) give 0


def _torch_backend(query, k_cache, v_cache, batch: PagedBatch, scale: float, k_scale=None, v_scale=None,
                   variant: Variant = PLAIN):
    """A step that mixes decode rows with longer chunks (prompts, continuations after a tool call) runs the rows
    apart: padded to the longest chunk, each row would cost that chunk's length in queries (6.5 ms instead of
    1.5 ms a layer for 32 rows of 384 positions and one 17-token chunk, 8 query and 2 KV heads of 32, 2 CPU
    threads)."""
    rows = batch.num_rows
    if rows == 0 or batch.max_query_len == 1 or rows == batch.block_tables.shape[0]:
        return reference_paged_attention(
            query, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_starts, scale,
            batch.max_query_len, batch.max_context_len, k_scale, v_scale, variant,
        )  # fmt: skip
    decode = reference_paged_attention(
        query[:rows], k_cache, v_cache, batch.block_tables[:rows], batch.context_lens[:rows],
        batch.query_starts[: rows + 1], scale, 1, batch.max_context_len, k_scale, v_scale, variant,
    )  # fmt: skip
    chunks = reference_paged_attention(
        query[rows:], k_cache, v_cache, batch.block_tables[rows:], batch.context_lens[rows:],
        batch.query_starts[rows:] - rows, scale, batch.max_query_len, batch.max_context_len, k_scale, v_scale,
        variant,
    )  # fmt: skip
    return torch.cat([decode, chunks])


def _triton_backend(query, k_cache, v_cache, batch: PagedBatch, scale: float, k_scale=None, v_scale=None,
                    variant: Variant = PLAIN):
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
        window=variant.window,
        softcap=variant.softcap,
        sinks=variant.sinks,
    )


def _flash_backend(query, k_cache, v_cache, batch: PagedBatch, scale: float, variant: Variant = PLAIN):
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    extra = {}  # (only what a layer needs: flash-attn's defaults otherwise)
    if variant.window is not None:  # flash-attn's window (left, right): window - 1 earlier positions and its own
        extra["window_size"] = (variant.window - 1, 0)
    if variant.softcap is not None:
        extra["softcap"] = variant.softcap
    if batch.max_query_len == 1:
        out = flash_attn_with_kvcache(
            query.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=batch.context_lens,
            block_table=batch.block_tables,
            softmax_scale=scale,
            causal=True,
            **extra,
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
        **extra,
    )


BACKENDS: dict[str, Callable] = {"torch": _torch_backend, "triton": _triton_backend, "flash": _flash_backend}
BUILT_IN = tuple(BACKENDS)
# The backends with which the engine runs its Triton kernels (decode layers, sampler): where Triton runs.
TRITON_BACKENDS = {"triton", "flash"}
# What each backend computes beyond plain causal attention (layers.LayerModel.features): a model that needs more is
# never given it. flash-attn has no sinks and one head dim for keys and values; the Triton kernel one head dim.
FEATURES: dict[str, frozenset[str]] = {
    "torch": frozenset({"window", "softcap", "sinks", "value_dim"}),
    "triton": frozenset({"window", "softcap", "sinks"}),
    "flash": frozenset({"window", "softcap"}),
}


def register_backend(name: str, forward: Callable, *, triton: bool = False, features: tuple[str, ...] = ()) -> None:
    """Adds (or replaces) the attention backend `EngineConfig(attention=name)` selects; the built-in ones stay.
    forward(query [T, Hq, D], k_cache, v_cache [num_blocks, block_size, Hkv, D], batch: PagedBatch, scale) -> [T, Hq, D]
    attends each new token over its sequence's cached context (the step's keys/values are in the cache). `triton`:
    the engine runs its Triton decode layers and sampler with it, as with "triton" and "flash". `features`: which of
    "window", "softcap", "sinks", "value_dim" it computes (each then comes as `variant=Variant(...)`); the engine
    refuses it for a model that needs another."""
    if name in ("auto", *BUILT_IN):
        raise ValueError(f"attention backend {name!r} is built in; register another name")
    unknown = set(features) - FEATURES["torch"]
    if unknown:
        raise ValueError(f"features {sorted(unknown)} are not among {sorted(FEATURES['torch'])}")
    BACKENDS[name] = forward
    FEATURES[name] = frozenset(features)
    if triton:
        TRITON_BACKENDS.add(name)
    else:
        TRITON_BACKENDS.discard(name)


def layer_kv(batch: PagedBatch, layer: int):
    """(k_cache, v_cache [num_blocks, block_size, Hkv, D], k_scale, v_scale [Hkv] or None) of one layer."""
    k_cache, v_cache = batch.kv_cache.layer(layer)
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


def attend(query, k_cache, v_cache, batch: PagedBatch, scale: float, k_scale=None, v_scale=None,
           variant: Variant = PLAIN) -> torch.Tensor:
    """[T, Hq, Dv]: the step's attention through its backend; fp8 caches pass their scales (torch and triton), and
    a layer that is not plain its Variant."""
    args = () if k_scale is None else (k_scale, v_scale)
    if variant.plain:
        return BACKENDS[batch.backend](query, k_cache, v_cache, batch, scale, *args)
    return BACKENDS[batch.backend](query, k_cache, v_cache, batch, scale, *args, variant=variant)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers attention signature: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, Dv], None).
    Each layer is the one the engine's probe saw (layers.probe): its window, softcap and sinks are what the model
    passes now, checked against the probe's, so a model that changed since is never sampled differently."""
    batch = _current
    if batch is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' only runs inside fastgrpo.sampling.Engine.generate")
    if query.shape[0] != 1:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' expects the packed batch of 1, got {query.shape[0]}")
    layer_model = batch.kv_cache.layer_model
    slot = layer_model.slot_of.get(id(module))
    if slot is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}': a layer the engine's probe did not see was called")
    layer = layer_model.layers[slot]
    if sliding_window != layer.window or bool(softcap) != layer.softcap or (s_aux is not None) != layer.sinks:
        raise RuntimeError(f"attention layer {slot} now passes sliding_window={sliding_window}, softcap={softcap}, "
                           f"sinks={s_aux is not None}, which the engine did not plan its pages for")
    k_cache, v_cache, k_scale, v_scale = layer_kv(batch, slot)  # [num_blocks, block_size, Hkv, D]
    view = batch.for_pool(layer_model.pool_of(slot))
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    q = q if k_scale is not None else q.to(k_cache.dtype)  # (an fp8 cache's queries stay in the model's dtype)
    if layer.owns_pages:
        store_kv(k_cache, v_cache, view.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1), k_scale,
                 v_scale)  # fmt: skip
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    variant = Variant(sliding_window, softcap or None, None if s_aux is None else s_aux.float())
    out = attend(q, k_cache, v_cache, view, scale, k_scale, v_scale, variant=variant)  # [T, Hq, Dv]
    return out.to(query.dtype).unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
