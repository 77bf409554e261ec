"""Multi-turn generation (agents): the turns the engine hands a `turn_end` callback, and how it applies the answers.

An agent's rollout alternates turns of sampled text with tool results. With `Engine.generate(..., turn_end=f)`, a
sequence ends its turn when it samples a stop token or completes a stop string (`SamplingParams.stop_token_ids`,
`stop`): it leaves the decode batch and parks, its KV pages kept. Between two steps the engine calls

    answers = f(turns)  # turns: list[Turn], all the parked sequences; answers: one per turn, token ids or None

Token ids (the tool message, rendered by the caller) are appended to the sequence and fed as a chunked prefill that
continues its cache, and decoding resumes: no earlier token is computed again, where TRL re-feeds the prompt and
every earlier turn after each tool call. None finishes the sequence ("stop"). Appended tokens are part of the
completion (`max_new_tokens` counts them, TRL's rule) but carry logprob 0 and `tool_mask` 0. Tokens that would take
the completion past `max_new_tokens` are dropped and the sequence finishes there, "length"; tokens that fill it
exactly are kept (TRL keeps them too), "length".

When the callback runs: before a step, if `turn_batch` sequences are parked, or if the parked ones stand in the way
of the others: nothing else can run, or the pool ran out of pages (a group was preempted) while they held theirs.
With the default `turn_batch=1`, that is after every step in which a turn ended, with all the turns that ended in
it: a decode step costs about the same whatever its number of rows (its weights are read once), so a sequence that
waits for the turns of others, or a batch left to drain until every turn has ended (what a turn-synchronous loop
like TRL's does), wastes steps, while resuming at once keeps the batch full (3 turns of 8 prompts x G = 4 on a
2-core CPU: 224 steps, 1.58 s, against 325 steps, 1.85 s turn-synchronous; the benchmark in
tests/test_multiturn_engine.py). A larger `turn_batch` gathers more
turns per call, for tools that are slow to start, each call paying their latency once; `turn_batch` at the number
of sequences synchronises the turns like TRL's loop, still without a re-prefill. Either way the tokens are the same:
each sequence's randomness is counter-based (sampler.py), not tied to the schedule.
"""

from collections.abc import Callable
from dataclasses import dataclass

from fastgrpo.sampling.batch import Outputs
from fastgrpo.sampling.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class Turn:
    """A sequence whose turn ended: completion `completion_index` of prompt `prompt_index` (of the call)."""

    prompt_index: int
    completion_index: int
    turn: int  # 0 for its first turn
    token_ids: list[int]  # the turn's sampled tokens, its stop token (or the token completing a stop string) last
    room: int  # tokens that may still follow: max_new_tokens - (its completion so far); 0 means an answer ends it


TurnEnd = Callable[[list[Turn]], list[list[int] | None]]


def wants_turns(scheduler: Scheduler, turn_batch: int) -> bool:
    """Whether to call turn_end before the next step (an empty step calls it too: nothing else can run)."""
    return bool(scheduler.parked) and (len(scheduler.parked) >= turn_batch or scheduler.pool_ran_dry)


def end_turns(scheduler: Scheduler, outputs: Outputs, turn_end: TurnEnd, vocab_size: int) -> int:
    """Hand every parked sequence's turn to `turn_end` and apply its answers; returns the number of turns."""
    seqs = list(scheduler.parked)
    completions = outputs.token_lists([seq.seq_id for seq in seqs], [seq.num_generated for seq in seqs])
    max_new_tokens = outputs.tokens.shape[1]
    turns = [
        Turn(seq.seq_id // scheduler.n, seq.seq_id % scheduler.n, len(seq.appended),
             completion[outputs.turn_starts[seq.seq_id] :], max_new_tokens - len(completion))
        for seq, completion in zip(seqs, completions, strict=True)
    ]  # fmt: skip
    answers = turn_end(turns)
    check_answers(answers, turns, vocab_size)
    for seq, completion, answer in zip(seqs, completions, answers, strict=True):
        scheduler.resume(seq, completion, None if answer is None else list(answer))
    return len(turns)


def check_answers(answers, turns: list[Turn], vocab_size: int) -> None:
    if not isinstance(answers, (list, tuple)) or len(answers) != len(turns):
        got = f"{len(answers)} answers" if isinstance(answers, (list, tuple)) else repr(type(answers).__name__)
        raise ValueError(f"turn_end must return a list with one answer per turn ({len(turns)}), got {got}")
    for turn, answer in zip(turns, answers, strict=True):
        if answer is None:
            continue
        where = f"turn_end's answer for prompt {turn.prompt_index}, completion {turn.completion_index}"
        if not isinstance(answer, (list, tuple)):
            raise TypeError(f"{where} must be a list of token ids or None, got {type(answer).__name__}")
        for token in answer:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ValueError(f"{where} holds {token!r}, not a token id in [0, {vocab_size})")
