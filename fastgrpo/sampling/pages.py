"""The KV pages of one `generate` call: a logical pool, and a smaller pool per sliding window.

Every sequence holds a table of logical pages (block_pool.BlockPool), one per `block_size` positions: the scheduler
counts, shares, copies and frees these, as it always has. Full-attention layers store their keys and values in the
logical pages themselves. Sliding-window layers (Gemma 2/3/4's local layers, gpt-oss's even layers, Mistral) only
ever read the last `window` positions, so each window size gets a pool of its own (a `WindowPages`): a logical page
has a window page while some holder's window still reaches it, and goes back to that pool when the last one's window
has moved past it. A sequence at position c reads positions (c - window, c], so it holds at most
ceil((window - 1) / block_size) + 1 window pages, whatever its length.

A logical page maps to at most one window page per window, so sharing a logical page (a prompt's pages, forked to
its G completions) shares its window pages too, and a copy of the prompt's partial page copies both. Each holder
keeps references on the window pages of its live range only, `seq.window_from[g]` up to the end of its table;
`trim` moves that start forward as the sequence advances.

Allocation takes the same count from every pool (a new logical page is in every window at first), so the scheduler's
page arithmetic is unchanged: `num_free` is the least any pool has free.

A model with recurrent layers (state.py) keeps a state slot per sequence beside its pages: taken with a prompt's
first pages, copied or taken over by a child that starts, and freed with the pages (`release`).
"""

import numpy as np

from fastgrpo.sampling.block_pool import BlockPool, blocks_for
from fastgrpo.sampling.sequence import Sequence
from fastgrpo.sampling.state import StateSlots

NO_PAGE = -1


def first_live_page(num_cached: int, window: int, block_size: int) -> int:
    """The first page a sequence with `num_cached` tokens cached still reads: its next token, at position
    num_cached, attends to the positions num_cached - window + 1 .. num_cached."""
    return max(0, num_cached - window + 1) // block_size


def window_pool_pages(window: int, block_size: int, logical_pages: int, sequence_pages: int, seats: int,
                      max_num_batched_tokens: int) -> int:
    """Pages of a window's pool, beside a logical pool of `logical_pages`, for a call whose longest sequence takes
    `sequence_pages` logical pages and that runs at most `seats` sequences at once. A sequence holds at most
    ceil((window - 1) / block_size) + 2 window pages (a window that straddles pages, and the page its next token
    starts); a step's prefill adds ceil(max_num_batched_tokens / block_size). The pool holds a window for as many
    sequences as the logical pool holds at full length (at least two: a prompt being prefilled and a completion),
    never more than a window for every seat (and one more, a prompt being forked), never more than the logical pool
    (a logical page has at most one page in each window pool). Sequences shorter than the window hold as many pages
    in both pools; while many are, the window pool can be the one that runs dry, and the scheduler then preempts as it
    does for the logical pool."""
    per_seq = blocks_for(window - 1, block_size) + 2
    prefill = blocks_for(max_num_batched_tokens, block_size)
    full_length = max(2, -(-logical_pages // max(sequence_pages, 1))) * per_seq + prefill
    every_seat = (seats + 1) * per_seq + prefill
    return min(logical_pages, every_seat, full_length)


class WindowPages:
    """The pages of one window size: a BlockPool, and which window page each logical page has (or NO_PAGE)."""

    def __init__(self, window: int, num_blocks: int, block_size: int, num_logical: int):
        self.window = window
        self.pool = BlockPool(num_blocks, block_size)
        self.page_of = np.full(num_logical, NO_PAGE, dtype=np.int64)  # logical page -> window page

    def first_live(self, num_cached: int) -> int:
        return first_live_page(num_cached, self.window, self.pool.block_size)

    def drop(self, logical: list[int]) -> None:
        """One holder's references on the window pages of these logical pages go."""
        for page in logical:
            own = int(self.page_of[page])
            self.pool.free([own])
            if self.pool.ref_counts[own] == 0:
                self.page_of[page] = NO_PAGE


class PagePool(BlockPool):
    """The logical pool (BlockPool's bookkeeping, the pages of full-attention layers) and one WindowPages per
    sliding window. With no windows it is a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, windows: dict[int, int] | None = None,
                 state_slots: int = 0):
        """`windows`: {window: pages of its pool}; `state_slots`: recurrent state slots (0: the model keeps none)."""
        super().__init__(num_blocks, block_size)
        self.windows = [WindowPages(w, pages, block_size, num_blocks) for w, pages in (windows or {}).items()]
        self.states = StateSlots(state_slots) if state_slots else None

    def take_state(self, seq: Sequence) -> None:
        """A prompt that starts takes a state slot (it starts from no state)."""
        if self.states is not None:
            seq.state_slot = self.states.allocate()

    def start_state(self, prompt: Sequence, child: Sequence, take_over: bool) -> tuple[int, int] | None:
        """A child starts from its prompt's state: it takes the prompt's slot over, or a slot of its own; returns the
        (src, dst) copy to make before the next forward, if any."""
        if self.states is None:
            return None
        if take_over:
            child.state_slot, prompt.state_slot = prompt.state_slot, -1
            return None
        child.state_slot = self.states.allocate()
        return prompt.state_slot, child.state_slot

    @property
    def num_free(self) -> int:
        return min([len(self.free_ids), *(w.pool.num_free for w in self.windows)])

    @property
    def num_leaked(self) -> int:
        """Pages and state slots still referenced, all pools (0 once every sequence has released its pages)."""
        slots = 0 if self.states is None else self.states.num_slots - self.states.num_free
        return (self.num_blocks - len(self.free_ids) + sum(w.pool.num_blocks - w.pool.num_free for w in self.windows)
                + slots)

    def allocate(self, count: int) -> list[int]:
        ids = super().allocate(count)
        for window in self.windows:
            window.page_of[ids] = window.pool.allocate(count)
        return ids

    def share_prefix(self, holder: Sequence, count: int) -> tuple[list[int], list[int]]:
        """A new holder's share of `holder`'s first `count` pages: (logical ids, window starts). The new holder reads
        what `holder` reads (they have the same tokens cached), so it takes references on the same live window pages."""
        ids = self.share(holder.block_table[:count])
        starts = self.window_starts(holder)
        for window, start in zip(self.windows, starts, strict=True):
            window.pool.share([int(window.page_of[page]) for page in ids[start:]])
        return ids, starts

    def window_starts(self, seq: Sequence) -> list[int]:
        return list(seq.window_from) or [0] * len(self.windows)

    def release(self, seq: Sequence) -> None:
        """All of `seq`'s pages go: its logical pages, and its references on its live window pages."""
        for window, start in zip(self.windows, self.window_starts(seq), strict=True):
            window.drop(seq.block_table[start:])
        self.free(seq.block_table)
        seq.block_table = []
        seq.window_from = []
        if seq.state_slot >= 0:
            self.states.free(seq.state_slot)
            seq.state_slot = -1

    def trim(self, seq: Sequence, num_cached: int) -> None:
        """`seq` has `num_cached` tokens cached: its references on window pages it will never read again go."""
        if not self.windows:
            return
        starts = self.window_starts(seq)
        for g, window in enumerate(self.windows):
            live = min(window.first_live(num_cached), len(seq.block_table))
            if live > starts[g]:
                window.drop(seq.block_table[starts[g] : live])
                starts[g] = live
        seq.window_from = starts

    def trim_rows(self, seqs: list[Sequence], cached: np.ndarray) -> None:
        """Decode rows `seqs` now have `cached` [rows] tokens cached, one more than before: trim the rows whose window
        start moved (at most one page each)."""
        for window in self.windows:
            moved = cached - window.window + 1
            for row in np.flatnonzero((moved > 0) & (moved % self.block_size == 0)).tolist():
                self.trim(seqs[row], int(cached[row]))

    def tables(self, logical: list[int]) -> list[list[int]]:
        """A table of logical pages as each pool's table: the logical ids, then per window its pages (a page no
        longer in the window reads the scratch page, past the pool's last: attention never reads it)."""
        out = [logical]
        for window in self.windows:
            pages = window.page_of[logical] if logical else np.zeros(0, dtype=np.int64)
            out.append(np.where(pages == NO_PAGE, window.pool.num_blocks, pages).tolist())
        return out

    def copy_pairs(self, src: int, dst: int) -> list[tuple[int, int]]:
        """(src, dst) per pool of a copy of logical page src into dst (a prompt's partial page, which is live)."""
        return [(src, dst)] + [(int(w.page_of[src]), int(w.page_of[dst])) for w in self.windows]
