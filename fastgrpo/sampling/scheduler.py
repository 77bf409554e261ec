"""Continuous batching over prompt groups, with chunked prefill and preemption by recompute.

Two kinds of work make a step. Decoding sequences (one new token each) are rows of the persistent decode batch
(batch.py): all of them run every step, and the scheduler's only per-step work for them is the pages for the rows
whose token starts a new page, found and handed out in bulk. Everything else (a prompt's chunks, a preempted
completion's recompute) is host work, scheduled per sequence as before: the running groups', oldest first, then
queued groups are admitted while the token budget, the row limit (`max_num_seqs`, and no more rows than
`max_num_batched_tokens`) and the pool allow. So a step costs the host what changes, not the batch size.

When the decode rows need more pages than are free, the youngest running groups are preempted: their pages are
freed and they go back to the front of the queue, keeping the tokens they have sampled, to be recomputed later.
Host work that finds no page preempts the youngest group with no rows this step, or waits for one to free.

Multi-turn (`multi_turn=True`): a sequence that samples a stop token ends its turn instead of finishing. It leaves
the decode batch and is `parked`, keeping its pages and its place under the row limit, until `resume` gets the
caller's answer: None finishes it; tokens are appended and it becomes host work again, a continuation that feeds the
turn's last token and the appended ones (a chunked prefill from where its cache stops) and samples the next turn's
first token, after which it is a row again. A parked sequence's group can be preempted like any other; its recompute
then waits for its next turn's tokens.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from fastgrpo.sampling.batch import DecodeBatch, Outputs
from fastgrpo.sampling.block_pool import BlockPool, blocks_for
from fastgrpo.sampling.sequence import Group, Sequence


class Targets(NamedTuple):
    """Where a step's R sampled tokens go: output row and column on the device, the columns also on the host."""

    seq_ids: torch.Tensor  # [R] int64
    columns: torch.Tensor  # [R] int64
    host_columns: np.ndarray  # [R] int64


@dataclass(slots=True)
class Step:
    """One forward: the decode batch's first `num_rows` rows (one token each, one sample each), then host work:
    sequences with the number of new tokens each feeds, and how many tokens each samples."""

    num_rows: int = 0
    groups: list[Group] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)  # n for a first fork, 1 for a caught-up recompute, else 0

    def add(self, group: Group, seq: Sequence, chunk: int) -> None:
        completes = seq.num_cached + chunk == seq.num_tokens
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

    @property
    def num_tokens(self) -> int:
        return self.num_rows + sum(self.chunks)


class Scheduler:
    def __init__(
        self,
        groups: list[Group],
        pool: BlockPool,
        batch: DecodeBatch,
        outputs: Outputs,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        multi_turn: bool = False,
        admit: int | None = None,
    ):
        self.pool = pool
        self.batch = batch
        self.outputs = outputs
        self.max_rows = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.groups = groups  # in call order: group.index
        self.n = groups[0].n  # completions per group
        self.waiting: deque[Group] = deque(groups)
        self.running: list[Group] = []  # oldest first
        self.host_groups: list[Group] = []  # the running groups with host work (group.pending), oldest first
        self.num_seqs = 0  # sequences of the running groups still to finish
        self.copies: list[tuple[int, int]] = []  # (src, dst) pages to copy before the next forward
        self.multi_turn = multi_turn
        self.parked: list[Sequence] = []  # turns ended, waiting for `resume`, in the order they ended
        self.pool_ran_dry = False  # the last `schedule` preempted a group (the engine's cue to end parked turns)
        self.num_preemptions = 0
        self.num_recomputed = 0  # positions computed again (after a preemption), prompts and completions
        self.num_continued = 0  # completion positions first computed by host work: continuations after a turn
        # Streamed admission (dynamic sampling): at most `admit_limit` groups ever start (None: all); the caller
        # raises it as finished groups come out of `take_done`, or stops the call with `abandon`.
        self.admit_limit = admit
        self.num_admitted = 0
        self.done_groups: list[Group] = []  # finished since the last take_done, in the order they finished

    def admissible(self, group: Group) -> bool:
        """Whether `group` may start (or, preempted, start again) under the admission limit."""
        return group.admitted or self.admit_limit is None or self.num_admitted < self.admit_limit

    def take_done(self) -> list[Group]:
        done, self.done_groups = self.done_groups, []
        return done

    def abandon(self) -> None:
        """Stop every group that has not finished: pages freed, rows and turns dropped, nothing left to run."""
        for group in self.running:
            self.batch.remove([seq.row for seq in group.children if seq.row is not None])
            for seq in [group.prompt, *group.children]:
                self.pool.free(seq.block_table)
                seq.block_table = []
            self.pool.free(group.fork_spare)
            group.fork_spare = []
        self.running, self.host_groups, self.parked, self.copies = [], [], [], []
        self.waiting.clear()
        self.num_seqs = 0

    @property
    def done(self) -> bool:
        """Nothing runs and nothing may start (the admission limit holds the waiting groups back)."""
        return not self.running and not any(map(self.admissible, self.waiting))

    def schedule(self) -> Step:
        step = Step()
        self.pool_ran_dry = False
        needs = self.batch.page_needs()
        while len(needs) > self.pool.num_free:
            self._preempt(self.running[-1], step)
            needs = self.batch.page_needs()
        self.batch.add_pages(needs, self.pool.allocate(len(needs)))
        step.num_rows = len(self.batch)
        budget = max(0, self.max_num_batched_tokens - step.num_rows)

        i = 0
        while i < len(self.host_groups) and budget:
            group = self.host_groups[i]
            for seq in list(group.pending):
                chunk = min(seq.num_uncached, budget)
                if chunk == 0 or not self._make_room(group, seq, chunk, step, i):
                    break
                step.add(group, seq, chunk)
                budget -= chunk
            if i < len(self.host_groups) and self.host_groups[i] is group:  # else it was preempted: next at i
                i += 1

        while self.waiting and budget:
            group = self.waiting[0]
            if self.running and self.num_seqs + group.width > self.max_rows or not self.admissible(group):
                break
            seq = group.prompt
            chunk = min(seq.num_uncached, budget)
            if not self._reserve(group, seq, chunk):
                break
            self.waiting.popleft()
            if not group.admitted:
                group.admitted = True
                self.num_admitted += 1
            self.running.append(group)
            self.host_groups.append(group)
            self.num_seqs += group.width
            step.add(group, seq, chunk)
            budget -= chunk
        return step

    def _make_room(self, group: Group, seq: Sequence, chunk: int, step: Step, first: int) -> bool:
        """Pages for host work, preempting the youngest groups without rows this step (never one older than `group`,
        at `first` in `host_groups`: a group with no host work has rows); False when `group` itself was preempted,
        or must wait for pages."""
        while not self._reserve(group, seq, chunk):
            victim = next((g for g in reversed(self.host_groups[first:]) if not self._has_rows(g)), None)
            if victim is None:
                return False
            self._preempt(victim, step)
            if victim is group:
                return False
        return True

    @staticmethod
    def _has_rows(group: Group) -> bool:
        return group.forked and group.width > len(group.pending) + group.num_parked

    def _reserve(self, group: Group, seq: Sequence, chunk: int) -> bool:
        """Pages for `chunk` more tokens of `seq`; for the last prompt chunk, also the fork's copies."""
        end = seq.num_cached + chunk
        forks = not group.forked and end == seq.num_tokens and seq.prompt_len % self.pool.block_size
        spare = group.width - 1 if forks and not group.fork_spare else 0
        missing = max(0, blocks_for(end, self.pool.block_size) - len(seq.block_table))
        if missing + spare > self.pool.num_free:
            return False
        seq.block_table += self.pool.allocate(missing)
        group.fork_spare += self.pool.allocate(spare)
        return True

    def _preempt(self, group: Group, step: Step) -> None:
        self.batch.remove([seq.row for seq in group.children if seq.row is not None])
        recompute = [seq for seq in group.children if not seq.finished and seq.num_generated]
        tokens = self.outputs.token_lists([seq.seq_id for seq in recompute], [seq.num_generated for seq in recompute])
        for seq, completion in zip(recompute, tokens, strict=True):
            seq.token_ids = group.prompt.token_ids + completion
        for seq in [group.prompt, *group.children]:
            if not seq.finished:
                self.pool.free(seq.block_table)
                seq.block_table = []
                seq.num_computed = max(seq.num_computed, seq.num_cached)
                seq.num_cached = 0
        self.pool.free(group.fork_spare)
        group.fork_spare = []
        group.forked = False
        group.pending = [group.prompt]
        step.drop(group)
        self.running.remove(group)
        if group in self.host_groups:
            self.host_groups.remove(group)
        self.num_seqs -= group.width
        self.waiting.appendleft(group)
        self.num_preemptions += 1
        self.pool_ran_dry = True

    def sample_targets(self, step: Step) -> Targets:
        """Where the step's sampled tokens go, in sampling order (decode rows, then host work in `step` order).
        A first fork samples column 0 of all n completions."""
        rows = step.num_rows
        seq_ids, columns = self.batch.seq_ids[:rows], self.batch.generated[:rows]
        host_ids, host_columns = [], []
        for group, seq, samples in zip(step.groups, step.seqs, step.num_samples, strict=True):
            if samples and seq is group.prompt:
                host_ids += range(group.index * group.n, group.index * group.n + samples)
                host_columns += [0] * samples
            elif samples:
                host_ids.append(seq.seq_id)
                host_columns.append(seq.num_generated)
        if host_ids:
            host = torch.tensor([host_ids, host_columns]).to(seq_ids.device, non_blocking=True)
            seq_ids, columns = torch.cat([seq_ids, host[0]]), torch.cat([columns, host[1]])
        host_columns = np.concatenate([self.batch.generated_h[:rows], np.asarray(host_columns, dtype=np.int64)])
        return Targets(seq_ids, columns, host_columns)

    def update(self, step: Step, tokens: torch.Tensor, logprobs: torch.Tensor, targets: Targets, finish) -> None:
        """Account the step's computed tokens and hand out the sampled ones, which go to `targets` (from
        sample_targets). `finish(tokens, seq_ids, columns, host_columns)` says which sampled tokens end their sequence,
        and why."""
        rows = step.num_rows
        sampled: list[Sequence] = []  # host work's sampling sequences, in order
        for group, seq, chunk, samples in zip(step.groups, step.seqs, step.chunks, step.num_samples, strict=True):
            start, end = seq.num_cached, seq.num_cached + chunk
            group.prompt_tokens_computed += max(0, min(end, seq.prompt_len) - start)
            recomputed = max(0, min(end, seq.num_computed) - start)
            self.num_recomputed += recomputed
            if seq is not group.prompt:
                self.num_continued += chunk - recomputed
            seq.num_computed = max(seq.num_computed, end)
            seq.num_cached = end
            if seq is group.prompt and seq.num_uncached == 0:
                children = self._fork(group)
                if samples:
                    sampled += children
            elif samples:
                sampled.append(seq)
        assert rows + len(sampled) == tokens.numel(), (rows, len(sampled), tokens.numel())

        device = tokens.device
        self.outputs.write(targets.seq_ids, targets.columns, tokens, logprobs)
        reasons = finish(tokens, *targets)  # {index in tokens: finish reason}
        self.batch.advance(tokens[:rows])
        for seq in sampled:
            seq.num_generated += 1

        leaving = []
        for index, reason in reasons.items():
            seq = self.batch.seqs[index] if index < rows else sampled[index - rows]
            if index < rows:
                leaving.append(index)
            if reason == "stop" and self.multi_turn:
                seq.parked = True
                self.parked.append(seq)
            else:
                self._finish(seq, reason)
        self.batch.remove(leaving)
        joining = [i for i, seq in enumerate(sampled) if not seq.finished and not seq.parked]
        if joining:
            index = torch.tensor(joining).to(device, non_blocking=True) + rows
            self.batch.join([sampled[i] for i in joining], tokens[index])
        for group in dict.fromkeys(step.groups):
            group.pending = [seq for seq in group.pending if seq.row is None and not seq.finished and not seq.parked]
            if not group.pending and group in self.host_groups:
                self.host_groups.remove(group)

    def resume(self, seq: Sequence, completion: list[int], tokens: list[int] | None) -> None:
        """The caller's answer to a parked sequence whose completion so far is `completion`: None finishes it
        ("stop"); tokens are appended and it continues, unless they would take its completion past max_new_tokens
        (then they are dropped) or fill it (then they are kept): either way it finishes with "length"."""
        self.parked.remove(seq)
        seq.parked = False
        if tokens is None:
            self._finish(seq, "stop")
            return
        column, end = seq.num_generated, seq.num_generated + len(tokens)
        max_new_tokens = self.outputs.tokens.shape[1]
        if end > max_new_tokens:
            self._finish(seq, "length")
            return
        self.outputs.append(seq.seq_id, column, tokens)
        seq.appended.append((column, len(tokens)))
        seq.num_generated = end
        if end == max_new_tokens:
            self._finish(seq, "length")
            return
        self.outputs.turn_starts[seq.seq_id] = end
        group = self.groups[seq.seq_id // self.n]
        seq.token_ids = group.prompt.token_ids + completion + tokens
        if group.forked:  # it holds its pages; otherwise its group's fork (after a preemption) makes it host work
            group.pending.append(seq)
            self.host_groups = [g for g in self.running if g.pending]  # oldest first

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.pool.free(seq.block_table)
        seq.block_table = []
        group = self.groups[seq.seq_id // self.n]
        group.num_finished += 1
        if not group.forked and group in self.waiting:  # parked in a preempted group, whose rows were given back
            if group.done:
                self.waiting.remove(group)
                self.done_groups.append(group)
            return
        self.num_seqs -= 1
        if group.done:
            self.done_groups.append(group)
            self.running.remove(group)
            if group in self.host_groups:  # its last parked sequences finished while its prompt recomputed
                self.host_groups.remove(group)
            self.pool.free(group.prompt.block_table + group.fork_spare)
            group.prompt.block_table, group.fork_spare = [], []

    def _fork(self, group: Group) -> list[Sequence]:
        """The prompt is cached: its pages pass to the children (created on the first fork); returns the children
        that will sample now (all n on a first fork, none on a recompute fork: they recompute their tokens first)."""
        prompt = group.prompt
        first = not group.children
        if first:
            group.children = [Sequence(prompt.token_ids, prompt.prompt_len, seq_id=group.index * group.n + j)
                              for j in range(group.n)]  # fmt: skip
        targets = group.active_children()
        tables, copies = self.pool.fork(prompt.block_table, prompt.num_cached, group.fork_spare, len(targets))
        self.copies += copies
        prompt.block_table, group.fork_spare, group.forked = [], [], True
        for child, table in zip(targets, tables, strict=True):
            child.block_table = table
            child.num_cached = prompt.num_cached
            child.num_computed = max(child.num_computed, prompt.num_cached)
        group.pending = [] if first else [seq for seq in targets if not seq.parked]
        return targets if first else []

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies
