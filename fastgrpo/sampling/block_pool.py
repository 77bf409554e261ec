"""Reference-counted KV pages. The pool only does bookkeeping; the engine owns the cache tensor."""

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def group_pages(prompt_length: int, n: int, max_new_tokens: int, block_size: int) -> int:
    """Pages of n completions at full length that share their prompt's full pages: each holds its own copy of the
    prompt's partial page, then max_new_tokens."""
    return prompt_length // block_size + n * blocks_for(prompt_length % block_size + max_new_tokens, block_size)


def _keeps_partial_page(prompt_length: int, n: int, block_size: int) -> bool:
    """Whether the prompt keeps a partial page of its own while its completions run: they copy it, unless there is
    one completion only, which takes the prompt's pages over (scheduler.py)."""
    return n > 1 and prompt_length % block_size > 0


def least_pages(prompt_length: int, n: int, max_new_tokens: int, block_size: int) -> int:
    """The least pool that samples a group: the prompt's pages and one completion's. The scheduler runs, waits and
    preempts completions one by one, so the group's n completions can run one after another."""
    return group_pages(prompt_length, 1, max_new_tokens, block_size) + _keeps_partial_page(prompt_length, n, block_size)


def most_pages(prompt_length: int, n: int, max_new_tokens: int, block_size: int) -> int:
    """The most pages a group holds: the prompt's pages and all n completions' at full length (a larger pool never
    runs out)."""
    return group_pages(prompt_length, n, max_new_tokens, block_size) + _keeps_partial_page(prompt_length, n, block_size)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, count: int) -> list[int]:
        assert count <= self.num_free, (count, self.num_free)
        ids = [self.free_ids.popleft() for _ in range(count)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def share(self, ids: list[int]) -> list[int]:
        for i in ids:
            assert self.ref_counts[i] > 0, i
            self.ref_counts[i] += 1
        return list(ids)

    def free(self, ids: list[int]) -> None:
        for i in ids:
            assert self.ref_counts[i] > 0, i
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)
