"""Reference-counted KV pages. The pool only does bookkeeping; the engine owns the cache tensor."""

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def group_pages(prompt_length: int, n: int, max_new_tokens: int, block_size: int) -> int:
    """The most pages a prompt group holds: its prompt's full pages, shared, and for each of its n completions the
    prompt's partial page and max_new_tokens (the least pool that can sample it)."""
    return prompt_length // block_size + n * blocks_for(prompt_length % block_size + max_new_tokens, block_size)


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

    def fork(self, table: list[int], num_tokens: int, spare: list[int], n: int) -> tuple[list[list[int]], list]:
        """Tables for n children of a sequence of `num_tokens` cached tokens in `table`.

        Full pages are shared. A partial last page belongs to the first child; every other child gets one page
        from `spare` (reserved beforehand) and a (src, dst) copy to make. The parent's references pass to the
        children: the caller drops `table` without freeing it.
        """
        full = num_tokens // self.block_size
        shared, tail = table[:full], table[full:]
        assert len(tail) <= 1 and len(spare) == (n - 1) * len(tail), (len(tail), len(spare), n)
        tables, copies = [], []
        for child in range(n):
            own = shared if child == 0 else self.share(shared)
            if tail and child > 0:
                copies.append((tail[0], spare[child - 1]))
                own = own + [spare[child - 1]]
            elif tail:
                own = own + tail
            tables.append(list(own))
        return tables, copies
