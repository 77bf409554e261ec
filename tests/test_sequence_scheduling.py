"""The engine schedules sequences, not only groups (fastgrpo/sampling/scheduler.py): the G completions of a prompt
share its pages, but start, wait and are preempted one by one. So a pool of one prompt's pages and one completion's
(block_pool.least_pages) samples a round of G = 8, and gives the tokens of a pool that holds every group at full
length (sampling is counter-based: the schedule does not change a draw). CPU, tiny seeded models.

What a preemption costs is checked position by position: the positions of the cache a preemption frees (a child's
own, beyond the prompt's pages, which stay; or a prompt's, once no child holds pages) are each computed again
exactly once (GenerateStats.num_recomputed_tokens), and no prompt is computed again unless its own pages were freed
(GenerateStats.prompt_tokens_computed).
"""

import functools
import random

import pytest
import torch
from helpers import assert_close
from sampling_helpers import (
    NO_STOP,
    NUM_WORDS,
    TURN_STOPS,
    assert_each_position_once,
    prompts_for,
    tiny,
    tokens_of,
    tool,
)

from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.sampling.block_pool import group_pages, least_pages, most_pages
from fastgrpo.sampling.scheduler import Scheduler

G = 8
# A restarted completion recomputes its tokens as a prefill, and the logits of its next token come from that
# prefill instead of a decode step: the same positions, summed in another order (~1e-7 apart in fp32).
LOGPROB_ATOL = 1e-5


@functools.cache
def model(family: str):
    return tiny(family)


def least(prompts, n, max_new_tokens, block_size) -> int:
    return max(least_pages(len(p), n, max_new_tokens, block_size) for p in prompts)


def cached_positions(scheduler: Scheduler, group) -> tuple[int, int]:
    """(prompt, completions): the positions of `group` in the cache, each counted once. The prompt's while it holds
    its pages; each child's own beyond them (a child of a group of one takes the prompt's pages over: all of its)."""
    prompt = group.prompt
    shared = prompt.prompt_len if prompt.block_table else 0
    children = 0
    for seq in group.children:
        if seq.block_table:
            cached = seq.num_cached if seq.row is None else int(scheduler.batch.context_h[seq.row])
            children += cached - shared
    return (prompt.num_cached if prompt.block_table else 0), children


@pytest.fixture
def freed(monkeypatch) -> list[tuple[int, int, int]]:
    """(group index, prompt positions, completion positions) that each preemption freed."""
    record = []
    preempt = Scheduler._preempt

    def counted(self, group, step):
        before = cached_positions(self, group)
        preempt(self, group, step)
        after = cached_positions(self, group)
        record.append((group.index, before[0] - after[0], before[1] - after[1]))

    monkeypatch.setattr(Scheduler, "_preempt", counted)
    return record


def assert_same(got, want) -> None:
    assert [[(c.token_ids, c.finish_reason) for c in g] for g in got] == [
        [(c.token_ids, c.finish_reason) for c in g] for g in want]  # fmt: skip
    for g, w in zip(got, want, strict=True):
        for c, d in zip(g, w, strict=True):
            assert_close("logprobs", torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=LOGPROB_ATOL)


def assert_recomputed_what_was_freed(engine: Engine, prompts, freed) -> None:
    """Every freed position is computed again once (a completion's last positions are all computed in the end), and
    a prompt again only as often as its own pages were freed."""
    stats = engine.stats
    assert stats.num_preemptions == len(freed)
    assert stats.num_recomputed_tokens == sum(p + c for _, p, c in freed)
    for i, prompt in enumerate(prompts):
        assert stats.prompt_tokens_computed[i] == len(prompt) + sum(p for g, p, _ in freed if g == i)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["seeded", "greedy"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_pool_of_one_completion_samples_a_round_of_eight(family, temperature, freed):
    """Six prompts across page boundaries, G = 8 completions of 16 tokens each (no stop token: all at full length),
    in a pool of 15 pages, the longest prompt's 10 and one completion's 5, where one group at full length needs 50:
    the tokens and logprobs of a pool that holds all six groups at once."""
    prompts, max_new_tokens = prompts_for(4), 16
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=3, **NO_STOP)
    roomy = Engine(model(family), block_size=4)
    want = roomy.generate(prompts, n=G, params=params)
    assert roomy.stats.num_blocks == sum(most_pages(len(p), G, max_new_tokens, 4) for p in prompts)
    assert roomy.stats.num_preemptions == 0
    freed.clear()

    pool = least(prompts, G, max_new_tokens, 4)
    assert pool == 37 // 4 + 1 + 5 == 15 and most_pages(37, G, max_new_tokens, 4) == 50
    tight = Engine(model(family), block_size=4, num_blocks=pool)
    got = tight.generate(prompts, n=G, params=params)
    assert_same(got, want)
    stats = tight.stats
    assert stats.leaked_blocks == 0 and stats.num_preemptions > 0 and stats.num_recomputed_tokens > 0
    assert_recomputed_what_was_freed(tight, prompts, freed)
    fed_once = sum(map(len, prompts)) + sum(len(c.token_ids) - 1 for g in got for c in g)
    assert stats.num_forward_tokens - stats.num_recomputed_tokens == fed_once


def test_the_prompt_pages_survive_its_completions_preemptions(freed):
    """One prompt, G = 8, the least pool: completions are preempted and start again on the prompt's cached pages,
    recomputing their own tokens only; the prompt is computed once."""
    prompt = prompts_for(4)[-1]  # 37 tokens: 9 full pages and a partial one, which each completion copies
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=1, **NO_STOP)
    want = Engine(model("qwen2"), block_size=4).generate([prompt], n=G, params=params)
    freed.clear()
    engine = Engine(model("qwen2"), block_size=4, num_blocks=least([prompt], G, 24, 4))
    got = engine.generate([prompt], n=G, params=params)
    assert_same(got, want)
    assert engine.stats.num_preemptions > 0 and engine.stats.leaked_blocks == 0
    assert engine.stats.prompt_tokens_computed == (len(prompt),)
    assert all(p == 0 and c > 0 for _, p, c in freed), "a completion's own positions, never the prompt's"
    assert_recomputed_what_was_freed(engine, [prompt], freed)


def test_one_page_fewer_is_refused():
    """least_pages is the engine's least: one page fewer cannot finish a completion next to the prompt's pages. At
    n = 1 there is no copy of the prompt's partial page (its completion takes its pages over)."""
    prompts, params = prompts_for(4), SamplingParams(max_new_tokens=8, seed=0, **NO_STOP)
    for n in (1, G):
        pool = least(prompts, n, 8, 4)
        assert pool == max(group_pages(len(p), 1, 8, 4) + (n > 1 and len(p) % 4 > 0) for p in prompts)
        with pytest.raises(ValueError, match=f"num_blocks={pool - 1} .* cannot hold a prompt and one completion "
                                             f"\\(needs {pool}\\)"):  # fmt: skip
            Engine(model("qwen2"), block_size=4, num_blocks=pool - 1).generate(prompts, n=n, params=params)
        engine = Engine(model("qwen2"), block_size=4, num_blocks=pool)
        engine.generate(prompts, n=n, params=params)
        assert engine.stats.leaked_blocks == 0


def test_turns_in_the_least_pool(freed):
    """Multi-turn (turn_end) with G = 8 in the least pool: parked, continuing and decoding completions are preempted
    one by one and give the tokens of a roomy pool, every position computed once bar what preemptions freed."""
    prompts = prompts_for(4)[1:5]
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=TURN_STOPS, seed=5)
    want = Engine(model("qwen2"), block_size=4).generate(prompts, n=G, params=params, turn_end=tool)
    freed.clear()
    for turn_batch in (1, 10**6):
        engine = Engine(model("qwen2"), block_size=4, num_blocks=least(prompts, G, 30, 4), max_num_batched_tokens=16)
        got = engine.generate(prompts, n=G, params=params, turn_end=tool, turn_batch=turn_batch)
        assert tokens_of(got) == tokens_of(want), turn_batch
        assert engine.stats.num_turns >= 16 and engine.stats.num_preemptions > 0
        assert_each_position_once(engine, prompts, got)
        # A parked completion whose pages were freed and that turn_end then finishes is never computed again.
        assert 0 < engine.stats.num_recomputed_tokens <= sum(p + c for _, p, c in freed)
        freed.clear()


def test_a_group_of_one_finishes_in_the_queue(monkeypatch):
    """n = 1: the completion holds its prompt's pages, so its preemption sends the group back to the queue; when
    turn_end finishes its parked completion there, the group is done: nothing recomputed, no page left. Greedy, so
    the turn's stop token can be picked: the younger group's completion parks at its second token and waits there
    (turn_batch: only when the others are held up) until the older one needs its pages."""
    older, younger = prompts_for(4)[-1], prompts_for(4)[3]
    free = SamplingParams(temperature=0, max_new_tokens=40, **NO_STOP)
    first, second = (g[0].token_ids for g in Engine(model("qwen2"), block_size=4).generate([older, younger], 1, free))
    stop = second[1]
    assert stop not in first, "the older completion runs to max_new_tokens"
    done_waiting, finish = [], Scheduler._finish

    def counted(self, seq, reason):
        group = self.groups[seq.seq_id // self.n]
        done_waiting.append(group in self.waiting and group.num_finished + 1 == group.n)
        finish(self, seq, reason)

    monkeypatch.setattr(Scheduler, "_finish", counted)
    params = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(stop,))
    end = lambda turns: [None] * len(turns)  # noqa: E731
    engine = Engine(model("qwen2"), block_size=4, num_blocks=least([older], 1, 40, 4))
    got = engine.generate([older, younger], n=1, params=params, turn_end=end, turn_batch=10**6)
    assert [g[0].token_ids for g in got] == [first, second[:2]]
    assert done_waiting == [True, False] and engine.stats.num_preemptions == 1  # the younger finishes first, queued
    assert_each_position_once(engine, [older, younger], got)


def test_streamed_groups_in_the_least_pool(freed):
    """admit / group_done with G = 8 in the least pool: every group that finishes has the tokens of a plain call,
    the call stops when group_done says so, and no page is left."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(9, NUM_WORDS + 3, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 30, (8,), generator=g)]  # fmt: skip
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=tuple(range(3, 9)), seed=3)
    plain = Engine(model("qwen2"), block_size=4).generate(prompts, n=G, params=params)
    freed.clear()
    seen = []

    def group_done(index, completions):  # one more start per finished group, until five have finished
        seen.append(index)
        return None if len(seen) == 5 else 1

    engine = Engine(model("qwen2"), block_size=4, num_blocks=least(prompts, G, 24, 4), max_num_batched_tokens=16)
    got = engine.generate(prompts, n=G, params=params, admit=2, group_done=group_done)
    assert {i for i, group in enumerate(got) if group is not None} == set(seen) and len(seen) == 5
    for i in seen:
        assert [c.token_ids for c in got[i]] == [c.token_ids for c in plain[i]]
    assert engine.stats.leaked_blocks == 0 and engine.stats.num_preemptions > 0


def test_random_pools_and_limits_sample_the_same():
    """Pools from the least to the most, row limits below and above G, token budgets down to 1, page sizes from 1 to
    16, stop tokens: the same tokens as a roomy engine, every position once bar recomputes, no page left."""
    rng = random.Random(0)
    for trial in range(4):
        block_size, n, max_new_tokens = rng.choice([1, 2, 4, 16]), rng.choice([1, 3, G]), rng.randint(4, 16)
        prompts = prompts_for(max(block_size, 2), seed=trial)[rng.randint(0, 2) :]
        stops = tuple(rng.sample(range(3, NUM_WORDS + 3), rng.randint(0, 3)))
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_new_tokens=max_new_tokens, seed=trial,
                                stop_token_ids=stops)  # fmt: skip
        want = Engine(model("qwen2"), block_size=block_size).generate(prompts, n=n, params=params)
        low = least(prompts, n, max_new_tokens, block_size)
        high = sum(most_pages(len(p), n, max_new_tokens, block_size) for p in prompts)
        engine = Engine(model("qwen2"), block_size=block_size, num_blocks=rng.randint(low, max(low, high // 3)),
                        max_num_seqs=rng.choice([1, 3, 64]), max_num_batched_tokens=rng.choice([1, 5, 64]))  # fmt: skip
        got = engine.generate(prompts, n=n, params=params)
        assert_same(got, want)
        fed_once = sum(map(len, prompts)) + sum(len(c.token_ids) - 1 for g in got for c in g)
        assert engine.stats.num_forward_tokens - engine.stats.num_recomputed_tokens == fed_once, trial
        assert engine.stats.leaked_blocks == 0
