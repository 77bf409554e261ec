"""Engine.generate's streamed admission (dynamic sampling): `admit` starts at most that many prompt groups, in call
order; `group_done` hears of each finished group and grants more starts or stops the call. Checked against plain
calls: the same tokens for every group that finishes, whatever the schedule (pool size, admission order), no page
left behind, and a stopped call's unfinished groups None."""

import pytest
import torch
from sampling_helpers import NUM_WORDS, tiny

from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.sampling.scheduler import Scheduler

STOPS = tuple(range(3, 9))  # peaked tiny models: completions of 1 to ~30 tokens


@pytest.fixture(scope="module")
def model():
    return tiny("qwen2")


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(9, NUM_WORDS + 3, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 30, (num,), generator=g)]


def tokens(groups) -> list:
    return [None if group is None else [c.token_ids for c in group] for group in groups]


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=STOPS, seed=3)


def test_admit_alone_starts_that_many_groups(model):
    batch = prompts(6)
    want = tokens(Engine(model, block_size=4).generate(batch, n=3, params=PARAMS))
    engine = Engine(model, block_size=4)
    got = tokens(engine.generate(batch, n=3, params=PARAMS, admit=2))
    assert got == want[:2] + [None] * 4
    assert engine.stats.num_groups_finished == 2 and engine.stats.leaked_blocks == 0


@pytest.mark.parametrize("num_blocks", [None, 30], ids=["roomy", "preempting"])
def test_each_finished_group_grants_one_start_until_enough_are_kept(model, num_blocks, monkeypatch):
    """The trainer's use: start P groups; a finished group that is 'flat' (here: its n completions' lengths all
    have one parity) grants one more start; stop once P groups that are not flat have finished. Every group that
    finishes has the tokens of a plain call; the ones that did not finish are None; no page leaks."""
    batch, n, wanted = prompts(12, seed=1), 3, 3
    plain = tokens(Engine(model, block_size=4).generate(batch, n=n, params=PARAMS))
    flat = [len({len(c) % 2 for c in group}) == 1 for group in plain]
    assert 0 < sum(flat) < len(flat) - wanted, "the prompts need a mix of flat and informative groups"
    preemptions = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, g, s: preemptions.append(1) or preempt(self, g, s))

    seen, kept = [], []

    def group_done(index, completions):
        seen.append(index)
        if len({len(c.token_ids) % 2 for c in completions}) == 1:
            return 1
        kept.append(index)
        return None if len(kept) == wanted else 0

    engine = Engine(model, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16)
    got = tokens(engine.generate(batch, n=n, params=PARAMS, admit=wanted, group_done=group_done))
    assert len(kept) == wanted
    for index, group in enumerate(got):
        assert group is None or group == plain[index]
    assert {i for i, group in enumerate(got) if group is not None} == set(seen)
    started = wanted + sum(flat[i] for i in seen)
    assert max(seen) < started  # never more starts than granted
    assert engine.stats.leaked_blocks == 0
    if num_blocks is not None:
        assert preemptions, "the small pool preempts"


def test_stopping_at_the_first_group(model):
    batch = prompts(5, seed=2)
    engine = Engine(model, block_size=4)
    got = engine.generate(batch, n=2, params=PARAMS, group_done=lambda index, completions: None)
    assert sum(group is not None for group in got) == 1
    assert engine.stats.leaked_blocks == 0


def test_bad_answers_and_arguments(model):
    batch = prompts(3)
    with pytest.raises(ValueError, match="group_done's answer"):
        Engine(model, block_size=4).generate(batch, n=2, params=PARAMS, admit=1, group_done=lambda i, c: -1)
    with pytest.raises(ValueError, match="admit"):
        Engine(model, block_size=4).generate(batch, n=2, params=PARAMS, admit=-1)
    with pytest.raises(TypeError, match="group_done"):
        Engine(model, block_size=4).generate(batch, n=2, params=PARAMS, group_done=3)
