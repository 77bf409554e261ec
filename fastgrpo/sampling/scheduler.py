"""Continuous batching over prompt groups, with chunked prefill and preemption by recompute.

Each step: the running groups, oldest first, get their next tokens (one per decoding sequence; chunks for a prompt
or a recompute), then queued groups are admitted while the token budget, `max_num_seqs` and the pool allow.
When a running sequence needs a page and none is free, the youngest running group is preempted: its pages are
freed and it goes back to the front of the queue, keeping the tokens it has sampled, to be recomputed later.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fastgrpo.sampling.block_pool import BlockPool, blocks_for
from fastgrpo.sampling.sequence import Group, Sequence


@dataclass(slots=True)
class Step:
    """One forward: sequences with the number of new tokens each feeds, and how many tokens each samples."""

    groups: list[Group] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)  # n for a first fork, 1 for a decoding sequence, else 0

    def add(self, group: Group, seq: Sequence, chunk: int) -> None:
        completes = seq.num_cached + chunk == len(seq.token_ids)
        if not completes:
            samples = 0
        elif group.forked:
            samples = 1
        else:
            samples = 0 if group.children else group.n
        self.groups.append(group)
        self.seqs.append(seq)
        self.chunks.append(chunk)
        self.num_samples.append(samples)

    def drop(self, group: Group) -> None:
        keep = [i for i, g in enumerate(self.groups) if g is not group]
        for name in ("groups", "seqs", "chunks", "num_samples"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])


class Scheduler:
    def __init__(
        self,
        groups: list[Group],
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        finish_reason: Callable[[Sequence], str | None],
    ):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.finish_reason = finish_reason
        self.waiting: deque[Group] = deque(groups)
        self.running: list[Group] = []
        self.copies: list[tuple[int, int]] = []  # (src, dst) pages to copy before the next forward
        self.num_preemptions = 0

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Step:
        step = Step()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget:
            group = self.running[i]
            for seq in group.active():
                chunk = min(seq.num_uncached, budget)
                if chunk == 0:
                    break
                while not self._reserve(group, seq, chunk):
                    victim = self.running[-1]
                    self._preempt(victim, step)
                    if victim is group:
                        break
                if group not in self.running:
                    break
                step.add(group, seq, chunk)
                budget -= chunk
            i += 1

        num_seqs = sum(group.width for group in self.running)
        while self.waiting and budget:
            group = self.waiting[0]
            if self.running and num_seqs + group.width > self.max_num_seqs:
                break
            seq = group.prompt
            chunk = min(seq.num_uncached, budget)
            if not self._reserve(group, seq, chunk):
                break
            self.waiting.popleft()
            self.running.append(group)
            step.add(group, seq, chunk)
            budget -= chunk
            num_seqs += group.width
        return step

    def _reserve(self, group: Group, seq: Sequence, chunk: int) -> bool:
        """Pages for `chunk` more tokens of `seq`; for the last prompt chunk, also the fork's copies."""
        end = seq.num_cached + chunk
        forks = not group.forked and end == len(seq.token_ids) and seq.prompt_len % self.pool.block_size
        spare = group.width - 1 if forks and not group.fork_spare else 0
        missing = max(0, blocks_for(end, self.pool.block_size) - len(seq.block_table))
        if missing + spare > self.pool.num_free:
            return False
        seq.block_table += self.pool.allocate(missing)
        group.fork_spare += self.pool.allocate(spare)
        return True

    def _preempt(self, group: Group, step: Step) -> None:
        for seq in [group.prompt, *group.children]:
            if not seq.finished:
                self.pool.free(seq.block_table)
                seq.block_table = []
                seq.num_cached = 0
        self.pool.free(group.fork_spare)
        group.fork_spare = []
        group.forked = False
        step.drop(group)
        self.running.remove(group)
        self.waiting.appendleft(group)
        self.num_preemptions += 1

    def update(self, step: Step, tokens: list[int], logprobs: list[float]) -> None:
        """Account the step's computed tokens and hand out the sampled ones (in `step` order)."""
        k = 0
        for group, seq, chunk, samples in zip(step.groups, step.seqs, step.chunks, step.num_samples, strict=True):
            start = seq.num_cached
            group.prompt_tokens_computed += max(0, min(start + chunk, seq.prompt_len) - start)
            seq.num_cached += chunk
            if seq is group.prompt and seq.num_uncached == 0:
                self._fork(group, tokens[k : k + samples], logprobs[k : k + samples])
            elif samples:
                self._append(seq, tokens[k], logprobs[k])
            k += samples
        assert k == len(tokens), (k, len(tokens))
        finished = [group for group in self.running if group.done]
        for group in finished:
            self.running.remove(group)

    def _fork(self, group: Group, tokens: list[int], logprobs: list[float]) -> None:
        prompt = group.prompt
        if not group.children:
            group.children = [Sequence(list(prompt.token_ids), prompt.prompt_len) for _ in range(group.n)]
        targets = group.active_children()
        tables, copies = self.pool.fork(prompt.block_table, prompt.num_cached, group.fork_spare, len(targets))
        self.copies += copies
        prompt.block_table, group.fork_spare, group.forked = [], [], True
        for child, table in zip(targets, tables, strict=True):
            child.block_table = table
            child.num_cached = prompt.num_cached
        for child, token, logprob in zip(targets, tokens, logprobs, strict=False):  # no tokens on a recompute fork
            self._append(child, token, logprob)

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.finish_reason = self.finish_reason(seq)
        if seq.finished:
            self.pool.free(seq.block_table)
            seq.block_table = []

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies
