"""Continuous batching of sequences, with chunked prefill and preemption by recompute.

Two kinds of work make a step. Decoding sequences (one new token each) are rows of the persistent decode batch
(batch.py): all of them run every step, and the scheduler's only per-step work for them is the pages for the rows
whose token starts a new page, found and handed out in bulk. Everything else is host work, scheduled per sequence:
a prompt's chunks, a completion's start, a preempted completion's recompute, a continuation after a turn.

Sequences, not groups, run, wait and are preempted. A prompt is prefilled once; when its last token is cached the
group forks: its n first tokens are sampled from the prompt's logits, and its n completions (children) wait to
start. The prompt keeps its pages while the group runs. A child starts when there is a page and a place under the
row limit (`max_num_seqs`, and no more rows than `max_num_batched_tokens`): it shares the prompt's full pages and
copies its partial last page (at n = 1 the child takes the prompt's pages over), then joins the decode batch, its
first token its input. So a pool of the prompt's pages and one completion's runs a group of any size, its children
one after another (`block_pool.least_pages`).

Order: the running groups in the order they started (oldest first), and in a group its prompt, then its children
by index. Host work goes oldest first; work that finds no room stops the host work of everything younger, then
queued groups are admitted while the token budget, the row limit and the pool allow. Where the running groups may
outgrow the pool at full length (`reserved`), a group is admitted only with room for its prompt and its children's
first pages, after the pages the groups before it are about to take: otherwise their children would preempt it at
once. (Keeping a page free per decode row as well, for starts and admissions, recomputed 27-33% fewer tokens but
took 12-16% more steps, and a decode step costs about the same whatever its rows: 64 prompts x 8 completions of 64
tokens, pools of 60 to 400 pages of 16 tokens, tiny Qwen2 on a CPU.)

Preemption by recompute goes youngest first, one sequence at a time: a group gives up its parked children that hold
pages (idle until their next turn), then its other children, the last first, and only once none holds pages, its
prompt.
  - When the decode rows need more pages than are free, the youngest group's next victim is preempted; the
    youngest group with a parked child that holds pages first (its pages are idle until the turn's answer).
  - Host work that finds no room waits while anything else runs in the step. When nothing else would, it preempts
    the youngest holders younger than itself: the oldest work always goes on.
  - A preempted child keeps its sampled tokens and goes back to its group's pending work: it starts again on the
    prompt's pages, which are still cached, and recomputes its own tokens only.
  - A preempted prompt frees the group's last pages: the group goes back to the front of the queue and prefills its
    prompt again, then its unfinished children start again. So does a group of one whose child, holding the
    prompt's pages, is preempted.

Hybrid models (recurrent layers: state.py) keep a state slot per sequence beside its pages, taken, copied and freed
with them (pages.PagePool); `max_groups` caps the groups running at once, so that a slot per row and one per running
group's prompt always suffice.

Multi-turn (`multi_turn=True`): a sequence that samples a stop token ends its turn instead of finishing. It leaves
the decode batch and is `parked`, keeping its pages and its place under the row limit, until `resume` gets the
caller's answer: None finishes it; tokens are appended and it becomes host work again, a continuation that feeds the
turn's last token and the appended ones (a chunked prefill from where its cache stops) and samples the next turn's
first token, after which it is a row again. A parked child can be preempted like any other; it then starts again
(recomputing its tokens) once its next turn's tokens are given.
"""

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from fastgrpo.sampling.batch import DecodeBatch, Outputs
from fastgrpo.sampling.block_pool import blocks_for, most_pages
from fastgrpo.sampling.pages import PagePool
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
    num_samples: list[int] = field(default_factory=list)  # n for a group's first fork, 1 for a child caught up

    def add(self, group: Group, seq: Sequence, chunk: int) -> None:
        assert len(seq.token_ids) >= seq.num_cached + chunk, (len(seq.token_ids), seq.num_cached, chunk)
        if seq.num_cached + chunk < seq.num_tokens:
            samples = 0
        elif seq is group.prompt:
            samples = 0 if group.children else group.n
        else:
            samples = 1
        self.groups.append(group)
        self.seqs.append(seq)
        self.chunks.append(chunk)
        self.num_samples.append(samples)

    @property
    def num_tokens(self) -> int:
        return self.num_rows + sum(self.chunks)


class Scheduler:
    def __init__(
        self,
        groups: list[Group],
        pool: PagePool,
        batch: DecodeBatch,
        outputs: Outputs,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        multi_turn: bool = False,
        admit: int | None = None,
        max_groups: int | None = None,
    ):
        self.pool = pool
        self.batch = batch
        self.outputs = outputs
        self.max_rows = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.groups = groups  # in call order: group.index
        self.n = groups[0].n  # completions per group
        self.waiting: deque[Group] = deque(groups)
        self.running: list[Group] = []  # the groups holding pages, oldest first
        self.host_groups: list[Group] = []  # the running groups with host work (group.pending), oldest first
        self.num_seqs = 0  # places under the row limit: prompts being prefilled, children holding pages
        self.reserved = 0  # the most pages the running groups may hold (_reserve): over the pool, they may run dry
        self.copies: list[list[tuple[int, int]]] = []  # per copy, (src, dst) in each pool, before the next forward
        self.state_copies: list[tuple[int, int]] = []  # (src, dst) state slots, before the next forward
        # Groups that may hold pages at once (None: as the pool allows): a model with recurrent state has a slot per
        # row and one per running group's prompt (pages.PagePool.take_state).
        self.max_groups = max_groups
        self.multi_turn = multi_turn
        self.parked: list[Sequence] = []  # turns ended, waiting for `resume`, in the order they ended
        self.pool_ran_dry = False  # the last `schedule` preempted (the engine's cue to end parked turns)
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
                self.pool.release(seq)
        self.running, self.host_groups, self.parked, self.copies, self.state_copies = [], [], [], [], []
        self.waiting.clear()
        self.num_seqs = self.reserved = 0

    @property
    def done(self) -> bool:
        """Nothing runs and nothing may start (the admission limit holds the waiting groups back)."""
        return not self.running and not any(map(self.admissible, self.waiting))

    # -- a step --

    def schedule(self) -> Step:
        step = Step()
        self.pool_ran_dry = False
        needs = self.batch.page_needs()
        while len(needs) > self.pool.num_free:
            self._preempt(self._idle_group() or self.running[-1], step)
            needs = self.batch.page_needs()
        self.batch.add_pages(needs, self.pool.allocate(len(needs)))
        budget = max(0, self.max_num_batched_tokens - len(self.batch))
        starting: list[Sequence] = []  # children that start as decode rows (their first token is their input)
        budget, blocked = self._host_work(step, budget, starting)
        if not blocked:
            self._admit(step, budget)
        if starting:
            where = torch.tensor([[seq.seq_id for seq in starting], [seq.num_generated - 1 for seq in starting]])
            where = where.to(self.outputs.tokens.device, non_blocking=True)
            self.batch.join(starting, self.outputs.tokens[where[0], where[1]])
        step.num_rows = len(self.batch)
        return step

    def _idle_group(self) -> Group | None:
        """The youngest group with a parked child that holds pages: idle pages, which the rows take first."""
        idle = {self.groups[seq.seq_id // self.n] for seq in self.parked if seq.block_table}
        return next((group for group in reversed(self.running) if group in idle), None)

    def _host_work(self, step: Step, budget: int, starting: list[Sequence]) -> tuple[int, bool]:
        """The running groups' host work, oldest first, into `step` (children that start as rows into `starting`);
        returns the budget left and whether work found no room (then nothing younger may take any)."""
        i = 0
        while i < len(self.host_groups) and budget:
            group = self.host_groups[i]
            for seq in list(group.pending):
                if seq is not group.prompt and not group.forked:
                    break  # the children wait for the prompt's pages
                if seq.block_table or seq is group.prompt:
                    chunk = min(seq.num_uncached, budget)
                    pages = blocks_for(seq.num_cached + chunk, self.pool.block_size) - len(seq.block_table)
                    if not self._room(group, seq, pages, False, step, starting):
                        return budget, True
                    seq.block_table += self.pool.allocate(pages)
                else:  # a child (re)starts; one whose first token is its only uncached one joins the batch
                    row = seq.num_generated == 1 and seq.num_computed <= seq.prompt_len
                    chunk = 1 if row else min(seq.num_generated, budget)
                    pages = self._start_pages(group, seq.prompt_len + chunk)
                    if not self._room(group, seq, pages, True, step, starting):
                        return budget, True
                    self._start(group, seq, seq.prompt_len + chunk)
                    if row:
                        starting.append(seq)
                        group.pending.remove(seq)
                        budget -= 1
                        if not budget:
                            break
                        continue
                step.add(group, seq, chunk)
                budget -= chunk
                if not budget:
                    break
            if group.pending:
                i += 1
            else:
                del self.host_groups[i]
        return budget, False

    def _admit(self, step: Step, budget: int) -> None:
        """Queued groups, in order, while the budget, the row limit and the pool allow. Where the running groups may
        outgrow the pool, a group is admitted only with room for the pages about to be taken: the running groups'
        prompts still to prefill and children still to start, then its own prompt and a page for each of its
        children. Otherwise the children of the groups before it would preempt it at once, and its prompt be
        prefilled again."""
        soon = None
        while self.waiting and budget and self.num_seqs < self.max_rows:
            group = self.waiting[0]
            if not self.admissible(group) or self.max_groups is not None and len(self.running) >= self.max_groups:
                break
            seq = group.prompt
            chunk = min(seq.num_uncached, budget)
            pages = blocks_for(chunk, self.pool.block_size)
            if pages > self.pool.num_free:
                break
            starts = blocks_for(seq.num_tokens, self.pool.block_size) - pages + group.width
            if self.running and self.reserved + self._reserve(group) > self.pool.num_blocks:
                if soon is None:
                    soon = sum(map(self._soon, self.host_groups))
                if pages + starts + soon > self.pool.num_free:
                    break
            if soon is not None:
                soon += starts
            seq.block_table = self.pool.allocate(pages)
            self.pool.take_state(seq)
            self.waiting.popleft()
            if not group.admitted:
                group.admitted = True
                self.num_admitted += 1
            self.running.append(group)
            self.host_groups.append(group)
            self.num_seqs += 1
            self.reserved += self._reserve(group)
            step.add(group, seq, chunk)
            budget -= chunk

    def _soon(self, group: Group) -> int:
        """Pages a running group with host work is about to take: the rest of its prompt and a page per child to
        start (one per child, on a first fork)."""
        prompt, block_size = group.prompt, self.pool.block_size
        if not group.forked:
            return blocks_for(prompt.num_tokens, block_size) - len(prompt.block_table) + group.width
        return sum(not seq.block_table for seq in group.pending)

    def _reserve(self, group: Group) -> int:
        """The most pages a running group may hold: its prompt's and its unfinished children's at full length."""
        max_new_tokens = self.outputs.tokens.shape[1]
        return most_pages(group.prompt.prompt_len, group.width, max_new_tokens, self.pool.block_size)

    def _room(self, group: Group, seq: Sequence, pages: int, place: bool, step: Step, starting: list[Sequence]) -> bool:
        """Whether there are `pages` free pages for work of `seq` (of `group`), and with `place` a place under the
        row limit. If not, and the step has nothing else to run, the youngest holders younger than `seq` are preempted
        until there are: the oldest work always goes on."""
        if pages <= self.pool.num_free and not (place and self.num_seqs >= self.max_rows):
            return True
        if len(self.batch) or starting or step.seqs:
            return False  # the step runs without it; it waits for what the others free
        return self._make_room(group, seq, pages, place, step)

    def _make_room(self, group: Group, seq: Sequence, pages: int, place: bool, step: Step) -> bool:
        """`pages` free pages for work of `seq` (of `group`), and with `place` a place under the row limit, preempting
        the youngest holders younger than `seq` (none is a decode row: the step has none); False when none is
        left to preempt."""
        while pages > self.pool.num_free or place and self.num_seqs >= self.max_rows:
            victim = self._victim(group, seq, pages > self.pool.num_free)
            if victim is None:
                return False
            self._preempt(victim, step)
        return True

    def _victim(self, group: Group, seq: Sequence, for_pages: bool) -> Group | None:
        """The youngest group whose next victim (`_next_victim`) is younger than `seq` (of `group`); unless
        `for_pages`, one whose next victim has a place (a cached prompt has none)."""
        for other in reversed(self.running):
            holder = self._next_victim(other)
            if other is group and holder.seq_id <= seq.seq_id:
                return None
            if for_pages or holder is not other.prompt or not other.forked:
                return other
        return None

    @staticmethod
    def _next_victim(group: Group) -> Sequence:
        """What a preemption of `group` frees: its last parked child that holds pages (idle until its next turn, and
        never computed again if that is its last), else its last child that holds pages, else its prompt."""
        holders = [seq for seq in reversed(group.children) if seq.block_table]
        return next((seq for seq in holders if seq.parked), holders[0] if holders else group.prompt)

    def _start_pages(self, group: Group, end: int) -> int:
        """New pages a child of `group` takes to start with `end` tokens cached."""
        prompt, block_size = group.prompt, self.pool.block_size
        kept = len(prompt.block_table) if group.n == 1 else prompt.prompt_len // block_size
        return blocks_for(end, block_size) - kept

    def _start(self, group: Group, seq: Sequence, end: int) -> None:
        """`seq` takes pages for its first `end` tokens: the prompt's full pages, shared, and a copy of its partial
        page; or, the only child of a group of one, the prompt's pages themselves."""
        prompt, block_size = group.prompt, self.pool.block_size
        full = prompt.prompt_len // block_size
        if group.n == 1:
            table, starts = prompt.block_table, prompt.window_from
            prompt.block_table, prompt.window_from = [], []
        else:
            table, starts = self.pool.share_prefix(prompt, full)
        own = self.pool.allocate(blocks_for(end, block_size) - len(table))
        if group.n > 1 and len(prompt.block_table) > full:
            self.copies.append(self.pool.copy_pairs(prompt.block_table[full], own[0]))
        copy = self.pool.start_state(prompt, seq, take_over=group.n == 1)
        if copy is not None:
            self.state_copies.append(copy)
        seq.block_table, seq.window_from = table + own, starts
        seq.num_cached = prompt.prompt_len
        seq.num_computed = max(seq.num_computed, prompt.prompt_len)
        self.num_seqs += 1

    def _preempt(self, group: Group, step: Step) -> None:
        """Free the group's next victim: a child that holds pages, which goes back to the group's pending work (to
        start again on the prompt's pages, recomputing its own tokens), or when none does, its prompt (the group goes
        back to the queue). Only before the step has host work."""
        seq = self._next_victim(group)
        assert not step.seqs
        self.num_preemptions += 1
        self.pool_ran_dry = True
        self.pool.release(seq)
        if seq is group.prompt:
            self._requeue(group)
            return
        if seq.row is not None:
            self.batch.remove([seq.row])
            seq.token_ids = group.prompt.token_ids + self.outputs.token_lists([seq.seq_id], [seq.num_generated])[0]
            self._queue(group, seq)
        seq.num_computed = max(seq.num_computed, seq.num_cached)
        seq.num_cached = 0
        self.num_seqs -= 1
        if group.n == 1:  # it held the prompt's pages
            self._requeue(group)

    def _requeue(self, group: Group) -> None:
        """The group holds no pages: back to the front of the queue, to prefill its prompt again."""
        prompt = group.prompt
        if group.forked:
            group.pending.insert(0, prompt)
        else:
            self.num_seqs -= 1  # the prompt, being prefilled, held a place
        prompt.num_computed = max(prompt.num_computed, prompt.num_cached)
        prompt.num_cached = 0
        group.forked = False
        self.reserved -= self._reserve(group)
        self.running.remove(group)
        if group in self.host_groups:
            self.host_groups.remove(group)
        self.waiting.appendleft(group)

    def _queue(self, group: Group, seq: Sequence) -> None:
        """`seq` has host work: into its group's pending work, in seq_id order."""
        bisect.insort(group.pending, seq, key=lambda s: s.seq_id)
        if group in self.running and group not in self.host_groups:
            self.host_groups = [g for g in self.running if g.pending]  # oldest first

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
            self.pool.trim(seq, end)
            if seq is group.prompt and seq.num_uncached == 0:
                self._fork(group)
                if samples:
                    sampled += group.children
            elif samples:
                sampled.append(seq)
        assert rows + len(sampled) == tokens.numel(), (rows, len(sampled), tokens.numel())

        device = tokens.device
        self.outputs.write(targets.seq_ids, targets.columns, tokens, logprobs)
        reasons = finish(tokens, *targets)  # {index in tokens: finish reason}
        self.batch.advance(tokens[:rows])
        self.pool.trim_rows(self.batch.seqs[:rows], self.batch.context_h[:rows])
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
        joining = []
        for i, seq in enumerate(sampled):
            if seq.finished or seq.parked:
                continue
            if seq.block_table:  # caught up: a row from now on
                joining.append(i)
            else:  # a first fork's child: it starts when it gets a page
                self.groups[seq.seq_id // self.n].pending.append(seq)
        if joining:
            index = torch.tensor(joining).to(device, non_blocking=True) + rows
            self.batch.join([sampled[i] for i in joining], tokens[index])
        for group in dict.fromkeys(step.groups):
            group.pending = [seq for seq in group.pending if seq.row is None and not seq.finished and not seq.parked
                             and not (seq is group.prompt and group.forked)]  # fmt: skip
            if not group.pending and group in self.host_groups:
                self.host_groups.remove(group)

    def _fork(self, group: Group) -> None:
        """The prompt is cached: it gives its place up (its children take theirs as they start), and on the first fork
        the children are created, each to sample its first token from the prompt's logits."""
        prompt = group.prompt
        if not group.children:
            group.children = [Sequence(prompt.token_ids, prompt.prompt_len, seq_id=group.index * group.n + j)
                              for j in range(group.n)]  # fmt: skip
        group.forked = True
        self.num_seqs -= 1

    # -- turns and finishing --

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
        self._queue(group, seq)  # a continuation where it holds its pages, else a start

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.block_table:
            self.num_seqs -= 1
        self.pool.release(seq)
        group = self.groups[seq.seq_id // self.n]
        if not group.forked and group in self.waiting:  # parked in a group preempted whole
            group.num_finished += 1
            if group.done:
                self.waiting.remove(group)
                self.done_groups.append(group)
            return
        self.reserved -= self._reserve(group)
        group.num_finished += 1
        if not group.done:
            self.reserved += self._reserve(group)
            return
        self.done_groups.append(group)
        self.running.remove(group)
        if group in self.host_groups:  # its last parked sequences finished while its prompt recomputed
            self.host_groups.remove(group)
        if not group.forked:
            self.num_seqs -= 1  # the prompt, being prefilled, held a place
        self.pool.release(group.prompt)

    def take_copies(self) -> list[list[tuple[int, int]]]:
        copies, self.copies = self.copies, []
        return copies

    def take_state_copies(self) -> list[tuple[int, int]]:
        copies, self.state_copies = self.state_copies, []
        return copies
