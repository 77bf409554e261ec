"""The persistent decode batch and the output buffers: what the engine keeps on the device between steps.

Every sequence that feeds exactly one token a step (its last sampled one) is a row of the decode batch. A step's
inputs for all rows are a handful of tensor ops on the device, whatever the batch size: the token each row feeds is
the one it sampled last step (never read back to the host), its position is its context length, and its KV slot
comes from its row of the block table. The host touches a row only when something changes: the row joins (a
completion starts, a recompute or a continuation catches up), leaves (it finished, ended its turn or was preempted)
or crosses into a new page. Host mirrors (numpy) of the context lengths and page counts let the scheduler find page
crossings without a device read.

Sampled tokens and their logprobs go straight into per-sequence output buffers ([sequences, max_new_tokens]); the
host reads them once, when the call ends (and for a preempted completion's recompute, an ended turn, or a
stop-string check).
"""

from collections.abc import Callable

import numpy as np
import torch

from fastgrpo.sampling.sampler import uniforms
from fastgrpo.sampling.sequence import Sequence


class DecodeBatch:
    def __init__(self, capacity: int, max_pages: int, block_size: int, device: torch.device,
                 tables: Callable[[list[int]], list[list[int]]] | None = None):
        """`tables`: a table of logical pages as each pool's table (pages.PagePool.tables; default: one pool)."""
        self.block_size = block_size
        self.tables = tables or (lambda logical: [logical])
        self.seqs: list[Sequence] = []  # row -> sequence; rows [0, len(self)) are live
        num_pools = len(self.tables([]))
        self.block_tables = torch.zeros(num_pools, capacity, max_pages, dtype=torch.int32, device=device)
        self.context = torch.zeros(capacity, dtype=torch.long, device=device)  # cached tokens before the step
        self.last = torch.zeros(capacity, dtype=torch.long, device=device)  # the token each row feeds next
        self.seq_ids = torch.zeros(capacity, dtype=torch.long, device=device)  # output-buffer row
        self.generated = torch.zeros(capacity, dtype=torch.long, device=device)  # completion tokens so far
        self.state_slots = torch.zeros(capacity, dtype=torch.long, device=device)  # recurrent state slot (state.py)
        self._tensors = (self.context, self.last, self.seq_ids, self.generated, self.state_slots)
        self.context_h = np.zeros(capacity, dtype=np.int64)  # host mirrors
        self.pages_h = np.zeros(capacity, dtype=np.int64)
        self.generated_h = np.zeros(capacity, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.seqs)

    def join(self, seqs: list[Sequence], last_tokens: torch.Tensor) -> None:
        """Append `seqs` (each with one uncached token, `last_tokens` [k] on the device) as rows."""
        start, end = len(self.seqs), len(self.seqs) + len(seqs)
        width = self.block_tables.shape[2]
        tables = [[t + [0] * (width - len(t)) for t in self.tables(seq.block_table)] for seq in seqs]  # [k][pools]
        device = self.context.device
        tables = torch.tensor(tables, dtype=torch.int32).transpose(0, 1)  # [pools, k, width]
        self.block_tables[:, start:end] = tables.to(device, non_blocking=True)
        context = [seq.num_cached for seq in seqs]
        generated = [seq.num_generated for seq in seqs]
        rows = torch.tensor([context, [seq.seq_id for seq in seqs], generated, [seq.state_slot for seq in seqs]],
                            dtype=torch.long)
        (self.context[start:end], self.seq_ids[start:end], self.generated[start:end],
         self.state_slots[start:end]) = rows.to(device, non_blocking=True)
        self.last[start:end] = last_tokens
        self.context_h[start:end] = context
        self.pages_h[start:end] = [len(seq.block_table) for seq in seqs]
        self.generated_h[start:end] = generated
        for row, seq in enumerate(seqs, start):
            seq.row = row
        self.seqs += seqs

    def page_needs(self) -> np.ndarray:
        """Rows whose token this step starts a page they do not have yet."""
        size = len(self.seqs)
        return np.flatnonzero(self.context_h[:size] >= self.pages_h[:size] * self.block_size)

    def add_pages(self, rows: np.ndarray, pages: list[int]) -> None:
        if not len(rows):
            return
        device = self.context.device
        index = torch.from_numpy(rows).to(device, non_blocking=True)
        column = torch.from_numpy(self.pages_h[rows]).to(device, non_blocking=True)
        pool_pages = torch.tensor(self.tables(pages), dtype=torch.int32).to(device, non_blocking=True)  # [pools, k]
        self.block_tables[:, index, column] = pool_pages
        self.pages_h[rows] += 1
        for row, page in zip(rows.tolist(), pages, strict=True):
            self.seqs[row].block_table.append(page)

    def inputs(self) -> dict[str, torch.Tensor]:
        """The rows' part of the step: input_ids, positions [S] int64, slots [pools, S] int64, context_lens [S]
        int32, block_tables [pools, S, max_pages] int32, all computed on the device."""
        size = len(self.seqs)
        positions = self.context[:size]
        tables = self.block_tables[:, :size]
        index = (positions // self.block_size)[None, :, None].expand(tables.shape[0], size, 1)
        pages = tables.gather(2, index)[..., 0]  # [pools, S]
        return dict(input_ids=self.last[:size], positions=positions,
                    slots=pages.long() * self.block_size + positions % self.block_size,
                    context_lens=(positions + 1).int(), block_tables=tables)

    def max_context(self) -> int:
        """The longest context of this step's rows (their new token included); 0 without rows."""
        size = len(self.seqs)
        return int(self.context_h[:size].max()) + 1 if size else 0

    def advance(self, tokens: torch.Tensor) -> None:
        """Each row fed its token and sampled `tokens` [S], the one it feeds next."""
        size = len(self.seqs)
        self.last[:size] = tokens
        self.context[:size] += 1
        self.generated[:size] += 1
        self.context_h[:size] += 1
        self.generated_h[:size] += 1

    def remove(self, rows: list[int]) -> None:
        """Rows leave (their sequences get their counters back); the last rows move into the holes."""
        if not rows:
            return
        size, gone = len(self.seqs), set(rows)
        kept = size - len(gone)
        for row in gone:
            seq = self.seqs[row]
            seq.num_cached, seq.num_generated = int(self.context_h[row]), int(self.generated_h[row])
            seq.row = None
        holes = sorted(row for row in gone if row < kept)
        movers = [row for row in range(kept, size) if row not in gone]  # as many as the holes
        if holes:
            device = self.context.device
            dst, src = (torch.tensor(rows_).to(device, non_blocking=True) for rows_ in (holes, movers))
            for tensor in self._tensors:
                tensor[dst] = tensor[src]
            self.block_tables[:, dst] = self.block_tables[:, src]
            for mirror in (self.context_h, self.pages_h, self.generated_h):
                mirror[holes] = mirror[movers]
            for hole, mover in zip(holes, movers, strict=True):
                self.seqs[hole] = self.seqs[mover]
                self.seqs[hole].row = hole
        del self.seqs[kept:]


class Outputs:
    """Sampled tokens and their logprobs per completion, [num_seqs, max_new_tokens] on the device, and the uniform
    random number each token will be drawn with (sampler.uniforms of the seed, completion and column; None for
    greedy decoding): 20 bytes per token the call may sample, fewer than the returned Python lists take. Tokens a
    multi-turn caller appends go to the same rows (logprob 0); `turn_starts` (host) is the column where each
    completion's current turn began."""

    def __init__(self, num_seqs: int, max_new_tokens: int, device: torch.device, seed: int | None,
                 streams: torch.Tensor | None = None, first_columns: torch.Tensor | None = None):
        """`streams` [num_seqs]: the random stream of each output row (default: the row itself); `first_columns`
        [num_seqs]: the counter of each row's column 0 (default 0)."""
        self.tokens = torch.zeros(num_seqs, max_new_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(num_seqs, max_new_tokens, dtype=torch.float32, device=device)
        self.turn_starts = np.zeros(num_seqs, dtype=np.int64)
        streams = torch.arange(num_seqs, device=device) if streams is None else streams.to(device)
        columns = torch.arange(max_new_tokens, device=device)
        if first_columns is not None:
            columns = first_columns.to(device)[:, None] + columns  # [num_seqs, max_new_tokens]
        self.uniforms = None if seed is None else uniforms(seed, streams[:, None], columns)

    def write(self, seq_ids: torch.Tensor, columns: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor):
        self.tokens[seq_ids, columns] = tokens
        self.logprobs[seq_ids, columns] = logprobs.float()

    def append(self, seq_id: int, column: int, tokens: list[int]) -> None:
        """A caller's tokens at columns column.. of row seq_id, with logprob 0 (they were not sampled)."""
        end = column + len(tokens)
        self.tokens[seq_id, column:end] = torch.tensor(tokens, dtype=torch.long).to(self.tokens.device)
        self.logprobs[seq_id, column:end] = 0.0

    def token_lists(self, seq_ids: list[int], lengths: list[int]) -> list[list[int]]:
        return self._lists(self.tokens, seq_ids, lengths)

    def logprob_lists(self, seq_ids: list[int], lengths: list[int]) -> list[list[float]]:
        return self._lists(self.logprobs, seq_ids, lengths)

    @staticmethod
    def _lists(buffer: torch.Tensor, seq_ids: list[int], lengths: list[int]) -> list[list]:
        """The first lengths[i] entries of row seq_ids[i], from one read of the rows up to the longest (a gather of
        the valid entries by boolean mask, or a read per row, is several times slower on a CPU)."""
        if not seq_ids:
            return []
        rows = buffer[torch.tensor(seq_ids, device=buffer.device), : max(lengths)].tolist()
        return [row[:length] for row, length in zip(rows, lengths, strict=True)]
