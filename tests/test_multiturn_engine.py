"""Multi-turn generation (`Engine.generate(..., turn_end=...)`) on tiny random models (CPU, fp32): the engine's
continuation of each sequence after its tool result equals TRL's re-prefill loop token for token, computes every
prompt and every earlier turn once, and survives preemption mid-conversation unchanged.

The reference (`reprefill`) is TRL 1.16's `_tool_call_loop` written out over the engine's plain `generate`: after
each turn, the sequences whose turn ended get their tool tokens, and prompt + completion so far (earlier turns, tool
tokens) is generated from again as a new prompt, one completion each. For seeded sampling, sequence j of prompt i
draws the k-th token after its prompt with the uniform of (seed, stream i * G + j, column k); a fresh `generate` on a
longer prompt counts its columns from 0, so the reference passes `group_ids=[i * G + j]` (n = 1: the same stream) and
`first_columns=[tokens after the original prompt]` (the same columns): then the draws, hence the tokens, must match
exactly.
"""

import os
import random
import time
from dataclasses import replace

import pytest
import torch
from helpers import assert_close, word_tokenizer
from sampling_helpers import (
    NUM_WORDS,
    TURN_STOPS,
    assert_each_position_once,
    prompts_for,
    reprefill,
    tiny,
    tokens_of,
    tool,
)

from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.sampling.block_pool import group_pages
from fastgrpo.sampling.scheduler import Scheduler


@pytest.fixture(scope="module")
def model():
    return tiny("qwen2")


def logged(turn_end, log: list):
    """turn_end, recording (turn, answer) pairs."""

    def wrapped(turns):
        answers = turn_end(turns)
        log.extend(zip(turns, answers, strict=True))
        return answers

    return wrapped


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_turns_match_the_reprefill_loop(model, block_size):
    prompts = prompts_for(block_size)
    params = SamplingParams(temperature=0, max_new_tokens=48, stop_token_ids=TURN_STOPS)
    log = []
    engine = Engine(model, block_size=block_size)
    got = engine.generate(prompts, n=2, params=params, turn_end=logged(tool, log))
    want = reprefill(Engine(model, block_size=block_size), prompts, 2, params, tool)
    assert tokens_of(got) == tokens_of(want)
    stats = engine.stats
    assert stats.num_turns == len(log) >= 8 and stats.num_preemptions == 0 and stats.num_recomputed_tokens == 0
    assert max(t.turn for t, _ in log) >= 2, "several turns"
    assert {a is None for _, a in log} == {True, False}, "some sequences finished, others continued"
    # Each prompt once per group; each continued turn's last token and its tool tokens once, as a continuation.
    assert stats.prompt_tokens_computed == tuple(map(len, prompts))
    continued = [a for t, a in log if a is not None and len(a) < t.room]
    assert stats.num_continuation_tokens == sum(1 + len(a) for a in continued)
    assert_each_position_once(engine, prompts, got)


@pytest.mark.parametrize("top_k", [0, 9])
def test_sampled_turns_match_the_reprefill_loop(model, top_k):
    prompts = prompts_for(4)
    params = SamplingParams(temperature=1.0, top_k=top_k, max_new_tokens=40, stop_token_ids=TURN_STOPS, seed=7)
    engine = Engine(model, block_size=4)
    got = engine.generate(prompts, n=3, params=params, turn_end=tool)
    want = reprefill(Engine(model, block_size=4), prompts, 3, params, tool)
    assert tokens_of(got) == tokens_of(want)
    assert len({tuple(c.token_ids) for c in got[-1]}) > 1, "siblings diverged"
    assert engine.stats.num_turns >= 12
    for g, w in zip(got, want, strict=True):
        for c, r in zip(g, w, strict=True):
            # 1e-4: the same logits from a decode step vs a prefill of the same tokens round differently.
            assert_close("logprobs", torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-4)
            assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.tool_mask, strict=True) if not m)
    assert_each_position_once(engine, prompts, got)


def test_first_columns_continue_a_completion(model):
    """generate on prompt + the first k tokens of a completion, with its stream and first_columns=[k], samples the
    rest of that completion: the counters the reference relies on."""
    prompts = prompts_for(4)[2:5]
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, stop_token_ids=())
    full = Engine(model, block_size=4).generate(prompts, n=2, params=params)
    k = 7
    rest = Engine(model, block_size=4).generate(
        [p + full[i][1].token_ids[:k] for i, p in enumerate(prompts)], n=1,
        params=replace(params, max_new_tokens=20 - k), group_ids=[2 * i + 1 for i in range(3)], first_columns=[k] * 3)
    assert [r[0].token_ids for r in rest] == [f[1].token_ids[k:] for f in full]


def test_turn_batch_changes_the_calls_not_the_tokens(model):
    prompts = prompts_for(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=TURN_STOPS, seed=11)
    runs, calls = [], []
    for turn_batch in (1, 5, 10**6):
        engine = Engine(model, block_size=4)
        runs.append(tokens_of(engine.generate(prompts, n=3, params=params, turn_end=tool, turn_batch=turn_batch)))
        calls.append(engine.stats.num_turn_end_calls)
    assert runs[0] == runs[1] == runs[2]
    assert calls[0] > calls[1] > calls[2], calls  # 10**6: only when nothing else can run (turn-synchronous)


def test_tool_tokens_past_max_new_tokens_are_rolled_back(model):
    prompts = [prompts_for(4)[i] for i in (2, 3, 4, 5, 0)]
    params = SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=TURN_STOPS)
    first = Engine(model, block_size=4).generate(prompts, n=1, params=params)
    assert all(g[0].finish_reason == "stop" for g in first)
    assert len(first[4][0].token_ids) == 30, "its turn ends at the last column: no room for any tool token"

    def overflow(turns):  # prompt 0: one token too many; prompt 1: exactly the room left; the others continue
        return [[5] * (t.room + 1) if t.prompt_index == 0 else [6] * t.room if t.prompt_index == 1
                else None if t.turn else [7, 8] for t in turns]  # fmt: skip

    engine = Engine(model, block_size=4)
    got = engine.generate(prompts, n=1, params=params, turn_end=overflow)
    assert tokens_of(got) == tokens_of(reprefill(Engine(model, block_size=4), prompts, 1, params, overflow))
    rolled, filled = got[0][0], got[1][0]
    assert rolled.token_ids == first[0][0].token_ids and rolled.finish_reason == "length"
    assert rolled.tool_mask == [1] * len(rolled.token_ids)
    room = 30 - len(first[1][0].token_ids)
    assert filled.token_ids == first[1][0].token_ids + [6] * room and filled.finish_reason == "length"
    assert filled.tool_mask == [1] * len(first[1][0].token_ids) + [0] * room and len(filled.token_ids) == 30
    assert (got[4][0].token_ids, got[4][0].finish_reason) == (first[4][0].token_ids, "length")
    assert got[2][0].tool_mask.count(0) == 2 and got[2][0].finish_reason in ("stop", "length")
    assert_each_position_once(engine, prompts, got)


def test_preemption_mid_conversation_changes_nothing(model, monkeypatch):
    """A pool of one prompt group's pages preempts groups whose sequences are parked, continuing or decoding; their
    recompute feeds prompt + every token so far (tool tokens included) and the output does not change."""
    prompts = prompts_for(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=TURN_STOPS, seed=5)
    want = Engine(model, block_size=4).generate(prompts, n=3, params=params, turn_end=tool)
    assert tokens_of(want) == tokens_of(reprefill(Engine(model, block_size=4), prompts, 3, params, tool))
    victims, preempt = [], Scheduler._preempt

    def counted(self, group, step):
        victims.append(group.num_parked)
        preempt(self, group, step)

    monkeypatch.setattr(Scheduler, "_preempt", counted)
    for turn_batch in (1, 3, 10**6):
        engine = Engine(model, block_size=4, num_blocks=43, max_num_batched_tokens=16)  # one group needs <= 42
        got = engine.generate(prompts, n=3, params=params, turn_end=tool, turn_batch=turn_batch)
        assert tokens_of(got) == tokens_of(want)
        assert engine.stats.num_preemptions > 0 and engine.stats.num_recomputed_tokens > 0
        assert_each_position_once(engine, prompts, got)
    assert any(victims), "a group with parked sequences was preempted"


def test_random_schedules_give_the_same_turns(model):
    """Page sizes, pools down to one group's pages, row and token limits down to 1, and turn_batch drawn at random:
    the same tokens and masks as a roomy engine, every position computed once bar recomputes, no page leaked."""
    rng = random.Random(0)
    for trial in range(5):
        block_size, n, max_new_tokens = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3]), rng.choice([10, 20])
        prompts = prompts_for(max(block_size, 2), seed=trial)[1:5]
        params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=TURN_STOPS, seed=trial)
        want = Engine(model, block_size=block_size).generate(prompts, n=n, params=params, turn_end=tool)
        least = max(group_pages(len(p), n, max_new_tokens, block_size) for p in prompts)
        engine = Engine(model, block_size=block_size, num_blocks=least + rng.choice([0, 1, 3]),
                        max_num_seqs=rng.choice([1, 2, 64]), max_num_batched_tokens=rng.choice([1, 4, 64]))
        got = engine.generate(prompts, n=n, params=params, turn_end=tool, turn_batch=rng.choice([1, 2, 10**6]))
        assert tokens_of(got) == tokens_of(want), (trial, engine.config)
        assert_each_position_once(engine, prompts, got)


def test_stop_strings_end_turns_within_the_turn(model):
    """A stop string is looked for in the current turn only, as the reference (whose earlier turns are prompt)
    does: "w2 w" ends in a character every token holds, so the window of every new token reaches back."""
    tokenizer = word_tokenizer(NUM_WORDS)
    prompts = prompts_for(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop=("w2 w", "w7"), stop_token_ids=(), seed=2)

    def short(turns):  # answers of 0 or 1 token: the window of the next turn's first token spans the last turn
        return [None if t.turn >= 3 else [9] * (t.completion_index % 2) for t in turns]

    engine = Engine(model, tokenizer=tokenizer, block_size=4)
    got = engine.generate(prompts, n=2, params=params, turn_end=short)
    want = reprefill(Engine(model, tokenizer=tokenizer, block_size=4), prompts, 2, params, short)
    assert tokens_of(got) == tokens_of(want)
    assert engine.stats.num_turns >= 8


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run of the Triton backend")
@pytest.mark.slow  # the Triton interpreter
def test_triton_backend_turns_match_the_torch_backend(model):
    """Continuations mixed with decode rows and chunked (max_num_batched_tokens) through the Triton attention
    kernel, decode layers and sampler: the torch backend's tokens."""
    prompts = prompts_for(4)[2:5]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=TURN_STOPS, seed=1)
    want = Engine(model, block_size=4).generate(prompts, n=2, params=params, turn_end=tool)
    engine = Engine(model, block_size=4, attention="triton", max_num_batched_tokens=12)
    got = engine.generate(prompts, n=2, params=params, turn_end=tool)
    assert tokens_of(got) == tokens_of(want)
    assert engine.stats.num_continuation_tokens > 0
    assert_each_position_once(engine, prompts, got)


def test_without_turn_end_nothing_changes(model):
    prompts = prompts_for(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=TURN_STOPS, seed=0)
    engine = Engine(model, block_size=4)
    outputs = engine.generate(prompts, n=2, params=params)
    assert all(c.tool_mask == [1] * len(c.token_ids) for g in outputs for c in g)
    assert {c.finish_reason for g in outputs for c in g} == {"stop", "length"}
    assert engine.stats.num_turns == engine.stats.num_turn_end_calls == engine.stats.num_appended_tokens == 0
    assert_each_position_once(engine, prompts, outputs)


@pytest.mark.parametrize("answer,error,match", [
    (lambda turns: [None], ValueError, "one answer per turn"),
    (lambda turns: None, ValueError, "one answer per turn"),
    (lambda turns: [3] * len(turns), TypeError, "list of token ids or None"),
    (lambda turns: [[NUM_WORDS + 3]] * len(turns), ValueError, r"not a token id in \[0, 128\)"),
])  # fmt: skip
def test_bad_turn_end_answers(model, answer, error, match):
    params = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=TURN_STOPS)
    with pytest.raises(error, match=match):
        Engine(model, block_size=4).generate(prompts_for(4)[:3], n=2, params=params, turn_end=answer)
    with pytest.raises(TypeError, match="turn_end"):
        Engine(model).generate([[3]], params=params, turn_end=5)
    with pytest.raises(ValueError, match="turn_batch"):
        Engine(model).generate([[3]], params=params, turn_end=tool, turn_batch=0)
    with pytest.raises(ValueError, match="first_columns"):
        Engine(model).generate([[3]], params=params, first_columns=[1, 2])


class Counted:
    """An engine whose `generate` calls add up the tokens they computed and their steps."""

    def __init__(self, engine: Engine):
        self.engine, self.forward_tokens, self.steps, self.calls = engine, 0, 0, 0

    def generate(self, *args, **kwargs):
        outputs = self.engine.generate(*args, **kwargs)
        self.forward_tokens += self.engine.stats.num_forward_tokens
        self.steps += self.engine.stats.num_steps
        self.calls += 1
        return outputs


@pytest.mark.slow
def test_benchmark_continuation_vs_reprefill():
    """3-turn rollouts, 8 prompts of 128 tokens x G = 4, turns of ~32 sampled tokens (geometric: 128 stop ids of a
    near-uniform 4096-token model), 16-token tool results: the engine's continuation vs TRL's re-prefill loop, the
    same tokens; tokens computed, and the median wall and CPU (process) time of 3 rounds that run the methods in
    turn after a warm-up (other jobs on a shared CPU slow all methods of a round alike). Run with -s for the table:

        pytest tests/test_multiturn_engine.py -m slow -k benchmark -s
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastgrpo.bench import SHAPES

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPES["tiny"], max_position_embeddings=1024)).eval()
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (8, 128), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=256, stop_token_ids=tuple(range(3, 3 + vocab // 32)),
                            seed=0)  # fmt: skip

    def tools(turns):  # 16 tokens after turns 0 and 1; turn 2 ends the rollout
        return [None if t.turn == 2 else [3 + (sum(t.token_ids) * 31 + k) % (vocab - 3) for k in range(16)]
                for t in turns]  # fmt: skip

    methods = {
        "continuation": lambda engine: engine.generate(prompts, n=4, params=params, turn_end=tools),
        "continuation, turn-synchronous": lambda engine: engine.generate(prompts, n=4, params=params, turn_end=tools,
                                                                         turn_batch=10**6),
        "re-prefill (TRL)": lambda engine: reprefill(engine, prompts, 4, params, tools),
    }  # fmt: skip
    for run in methods.values():
        run(Counted(Engine(model)))  # warm-up
    results = {name: [] for name in methods}  # name -> [(outputs, engine, wall s, cpu s)]
    for _ in range(3):
        for name, run in methods.items():
            engine = Counted(Engine(model))
            wall, cpu = time.perf_counter(), time.process_time()
            outputs = run(engine)
            results[name].append((tokens_of(outputs), engine, time.perf_counter() - wall, time.process_time() - cpu))
    rows = {name: (runs[0][0], runs[0][1], sorted(r[2] for r in runs)[1], sorted(r[3] for r in runs)[1])
            for name, runs in results.items()}  # fmt: skip
    assert len({str(row[0]) for row in rows.values()}) == 1, "every method samples the same tokens"
    completions = [c for group in rows["continuation"][0] for c in group]
    sampled = sum(sum(mask) for _, mask, _ in completions)
    print(f"\n{len(completions)} rollouts, {sampled} sampled tokens, {torch.get_num_threads()} threads, "
          f"{SHAPES['tiny']}")
    base = rows["continuation"]
    print(f"{'method':32} {'computed':>9} {'steps':>6} {'calls':>6} {'wall s':>7} {'cpu s':>7} {'x computed':>11} "
          f"{'x wall':>7} {'x cpu':>7}")  # fmt: skip
    for name, (_, engine, wall, cpu) in rows.items():
        print(f"{name:32} {engine.forward_tokens:9d} {engine.steps:6d} {engine.calls:6d} {wall:7.2f} {cpu:7.2f} "
              f"{engine.forward_tokens / base[1].forward_tokens:11.2f} {wall / base[2]:7.2f} {cpu / base[3]:7.2f}")
    assert rows["re-prefill (TRL)"][1].forward_tokens > base[1].forward_tokens
