"""CUDA graphs of the decode forward (one new token per sequence), one per padded batch size, captured on first use.

A decode step of a small model is dominated by kernel launches (hundreds per forward); replaying a graph makes it
one launch. Inputs are copied into static buffers; padding rows write their K/V into a scratch page that no
sequence owns and attend over it alone.
"""

import warnings
from collections.abc import Callable

import torch

from fastgrpo.kernels.paged_attention import Tiles
from fastgrpo.sampling.attention import PagedBatch
from fastgrpo.sampling.kv_cache import KVCache


def graph_sizes(max_batch: int) -> list[int]:
    return sorted({*(s for s in (1, 2, 4, 8, *range(16, max_batch, 16)) if s < max_batch), max_batch})


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor],  # (ids [S], positions [S], batch)
        kv_cache: KVCache,  # each pool's last page is scratch
        max_batch: int,
        max_blocks_per_seq: int,
        backend: str,
        tiles: Tiles | None,
    ):
        device = kv_cache.device
        self.forward, self.kv_cache, self.backend, self.tiles = forward, kv_cache, backend, tiles
        num_pools = len(kv_cache.pool_pages)
        # [pools, 1]: each pool's scratch page (past its last) and its first slot
        self.scratch_block = torch.tensor(kv_cache.pool_pages, dtype=torch.int32, device=device)[:, None]
        self.scratch_slot = self.scratch_block.long() * kv_cache.block_size
        self.sizes = graph_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.zeros(num_pools, max_batch, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(num_pools, max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_starts = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.tile_seqs = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.tile_starts = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.failed = False

    def __call__(
        self,
        input_ids: torch.Tensor,  # [S] int64
        positions: torch.Tensor,  # [S] int64
        slots: torch.Tensor,  # [pools, S] int64
        block_tables: torch.Tensor,  # [pools, S, w] int32, w <= max_blocks_per_seq
        context_lens: torch.Tensor,  # [S] int32
    ) -> torch.Tensor | None:  # [S, V] logits; None when capture failed (run the step eagerly)
        num_seqs = input_ids.numel()
        size = next(s for s in self.sizes if s >= num_seqs)
        self.input_ids[:num_seqs] = input_ids
        self.positions[:num_seqs] = positions
        self.slots[:, :num_seqs] = slots
        self.slots[:, num_seqs:size] = self.scratch_slot
        self.block_tables[:, :size] = self.scratch_block[:, :, None]
        self.block_tables[:, :num_seqs, : block_tables.shape[2]] = block_tables
        self.context_lens[:num_seqs] = context_lens
        self.context_lens[num_seqs:size] = 1
        if size not in self.graphs:
            try:
                self._capture(size)
            except RuntimeError as error:  # a model whose forward cannot be captured: decode eagerly instead
                warnings.warn(f"CUDA graph capture failed ({error}); decoding without CUDA graphs", stacklevel=3)
                self.failed = True
                return None
        self.graphs[size].replay()
        return self.logits[size][:num_seqs]

    def _capture(self, size: int) -> None:
        pools = self.slots.shape[0]
        batch = PagedBatch(
            kv_cache=self.kv_cache,
            slot_mapping=self.slots[0, :size],
            block_tables=self.block_tables[0, :size],
            context_lens=self.context_lens[:size],
            query_starts=self.query_starts[: size + 1],
            context_starts=self.query_starts[: size + 1],  # unused by decode kernels
            max_query_len=1,
            max_context_len=self.block_tables.shape[2] * self.kv_cache.block_size,
            backend=self.backend,
            tile_seqs=self.tile_seqs[:size],
            tile_starts=self.tile_starts[:size],
            tiles=self.tiles,
            pool_slots=self.slots[:, :size] if pools > 1 else None,
            pool_tables=self.block_tables[:, :size] if pools > 1 else None,
        )

        def forward() -> torch.Tensor:
            return self.forward(self.input_ids[:size], self.positions[:size], batch)

        # Warm up on a side stream (kernel compilation, lazy workspaces), as torch.cuda.graphs asks.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[size] = forward()
        self.pool = graph.pool()
        self.graphs[size] = graph
