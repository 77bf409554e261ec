"""TRL's sampling options beyond temperature / top-k / top-p: `min_p`, `repetition_penalty` (SamplingParams) and
`generation_kwargs` (TrainConfig), against transformers' generate and logits processors on tiny random models (CPU,
fp32), through preemptions and tool turns, on the PyTorch and the fused sampler."""

import os
import types
from dataclasses import replace

import pytest
import torch
from helpers import assert_close
from sampling_helpers import NO_STOP, TURN_STOPS, full_forward_logits, prompts_for, reprefill, tiny, tokens_of, tool
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.sampling.sampler import SeenTokens, logit_floor, processed_logits, sample, uniforms
from fastgrpo.train import TrainConfig, Trainer

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="Triton kernels: CUDA or the interpreter")


@pytest.fixture(scope="module")
def model():
    return tiny("qwen2")


def hf_processors(params: SamplingParams) -> LogitsProcessorList:
    """transformers' processors for `params`, in the order generate builds them (_get_logits_processor: the
    repetition penalty among the processors, then the warpers temperature, top-k, top-p, min-p when sampling)."""
    out = LogitsProcessorList()
    if params.repetition_penalty != 1:
        out.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    if not params.greedy:
        if params.temperature != 1:
            out.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            out.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            out.append(TopPLogitsWarper(params.top_p))
        if params.min_p:
            out.append(MinPLogitsWarper(params.min_p))
    return out


def hf_logprobs(model, prompt: list[int], completion: list[int], params: SamplingParams) -> torch.Tensor:
    """[len(completion)]: each token's log-softmax under transformers' processed logits, from one full forward and
    the processors applied step by step to prompt + the completion before it (tool tokens included)."""
    logits = full_forward_logits(model, prompt, completion)  # [C, V]
    ids = torch.tensor([prompt + completion])
    processors = hf_processors(params)
    rows = [processors(ids[:, : len(prompt) + t], logits[t : t + 1].clone()) for t in range(len(completion))]
    return torch.cat(rows).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def hf_generate_greedy(model, prompt: list[int], max_new_tokens: int, repetition_penalty: float) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         repetition_penalty=repetition_penalty, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


# -- against transformers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("repetition_penalty", [1.3, 0.7])
def test_greedy_repetition_penalty_matches_hf_generate(model, repetition_penalty):
    """Token for token with generate(repetition_penalty=...): the penalty counts the prompt and every token so far,
    with ragged prompts across pages, chunked prefill and preemptions (the penalty follows a sequence, not a row)."""
    prompts = prompts_for(4)
    params = SamplingParams(temperature=0, repetition_penalty=repetition_penalty, max_new_tokens=16, **NO_STOP)
    want = [hf_generate_greedy(model, prompt, 16, repetition_penalty) for prompt in prompts]
    plain = Engine(model, block_size=4).generate(prompts, n=1, params=replace(params, repetition_penalty=1.0))
    assert want != [g[0].token_ids for g in plain], "the penalty changes some completion"
    for config in (dict(), dict(num_blocks=26, max_num_batched_tokens=7)):
        engine = Engine(model, block_size=4, **config)
        outputs = engine.generate(prompts, n=2, params=params)
        for prompt, completions, tokens in zip(prompts, outputs, want, strict=True):
            assert [c.token_ids for c in completions] == [tokens, tokens], (len(prompt), config)
            # Greedy logprobs: the log-softmax of the penalized logits the token is the argmax of.
            assert_close("logprobs", torch.tensor(completions[0].logprobs),
                         hf_logprobs(model, prompt, tokens, params), atol=1e-4)  # fmt: skip
        assert engine.stats.leaked_blocks == 0
    assert engine.stats.num_preemptions > 0


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,repetition_penalty", [
    (1.0, 0, 1.0, 0.1, 1.0), (0.7, 0, 1.0, 0.0, 1.3), (0.8, 7, 1.0, 0.05, 1.2), (1.3, 0, 0.8, 0.1, 1.5),
    (0.9, 20, 0.9, 0.2, 0.8),
])  # fmt: skip
def test_sampled_logprobs_match_transformers_processors(model, temperature, top_k, top_p, min_p, repetition_penalty):
    """Each sampled token's logprob is the log-softmax, at that token, of transformers' processed logits (repetition
    penalty, temperature, top-k, top-p, min-p) over the prompt and the completion before it; the token is inside
    the kept set (finite)."""
    prompts = prompts_for(4)[:4]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, max_new_tokens=16, seed=1, **NO_STOP)  # fmt: skip
    outputs = Engine(model, block_size=4).generate(prompts, n=3, params=params)
    moved = 0.0
    for prompt, completions in zip(prompts, outputs, strict=True):
        for c in completions:
            want = hf_logprobs(model, prompt, c.token_ids, params)
            assert torch.isfinite(want).all(), "sampled a token transformers' processors remove"
            assert_close("logprobs", torch.tensor(c.logprobs), want, atol=1e-4)
            plain = full_forward_logits(model, prompt, c.token_ids) / temperature
            plain = plain.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            moved = max(moved, (want - plain).abs().max().item())
    assert moved > 1e-2, "the options change the distribution"


def test_sampler_order_of_operations():
    """processed_logits on one row, written out: penalty on the raw logits (seen tokens, repeats allowed), then
    / temperature, then min-p against the most likely token of what top-k left."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -3.0, 0.0]])
    seen = torch.tensor([[0, 1, 1, 4]])
    params = SamplingParams(temperature=0.5, top_k=4, min_p=0.4, repetition_penalty=2.0)
    penalized = torch.tensor([[1.0, -2.0, 0.5, 1.0, -6.0, 0.0]])  # x / 2 where x >= 0, x * 2 where x < 0
    z = penalized / 0.5  # [2, -4, 1, 2, -12, 0]; top-4 keeps 2, 1, 2, 0
    keep = torch.tensor([True, False, False, True, False, False])  # min-p: exp(z - 2) >= 0.4 only for the two 2s
    want = z.masked_fill(~keep, float("-inf"))
    assert torch.equal(processed_logits(logits, params, seen), want)
    assert torch.equal(processed_logits(logits, replace(params, temperature=0), seen), penalized)  # greedy: penalty
    assert torch.equal(hf_processors(params)(torch.tensor([[0, 1, 1, 4]]), logits.clone()), want)


# -- off is today's sampler ---------------------------------------------------------------------------------------


def test_options_off_change_nothing(model):
    """min_p 0 and repetition_penalty 1 leave the sampler's arithmetic as it was: bit-equal tokens and logprobs; a
    min_p that removes nothing (1e-30) is bit-equal too, and so is the fused sampler's threshold without min-p."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 300, generator=g) * 3
    u = uniforms(5, torch.arange(32), torch.zeros(32, dtype=torch.long))
    seen = torch.randint(0, 300, (32, 40), generator=g)
    for base in (SamplingParams(temperature=0.8, top_k=50), SamplingParams(temperature=1.0, top_p=0.9),
                 SamplingParams(temperature=0)):
        want = sample(logits, base, None if base.greedy else u)
        off = replace(base, min_p=0.0, repetition_penalty=1.0)
        for got in (sample(logits, off, None if base.greedy else u, seen),
                    sample(logits, replace(base, min_p=1e-30), None if base.greedy else u)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), base
    kth = torch.topk(logits, 50, dim=-1).values[:, -1]
    assert torch.equal(logit_floor(logits, SamplingParams(top_k=50)), kth)
    assert logit_floor(logits, SamplingParams()) is None and logit_floor(logits, SamplingParams(temperature=0)) is None
    prompts = prompts_for(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, **NO_STOP)
    plain = Engine(model, block_size=4).generate(prompts, n=2, params=params)
    tiny_min_p = Engine(model, block_size=4).generate(prompts, n=2, params=replace(params, min_p=1e-30))
    assert [[(c.token_ids, c.logprobs) for c in g] for g in plain] == [
        [(c.token_ids, c.logprobs) for c in g] for g in tiny_min_p]


# -- schedules, turns ---------------------------------------------------------------------------------------------


def test_preemption_and_schedules_change_nothing(model):
    """Seeded sampling with the penalty and min-p stays a function of (seed, completion, column): a preempting pool,
    a smaller batch and chunked prefill give the same tokens, and a slice of the prompts at its place in the batch
    (group_ids) samples what the whole call did."""
    prompts = prompts_for(4)
    params = SamplingParams(temperature=1.0, top_k=20, min_p=0.05, repetition_penalty=1.3, max_new_tokens=12, seed=5,
                            **NO_STOP)  # fmt: skip
    want = Engine(model, block_size=4).generate(prompts, n=3, params=params)
    preemptions = 0
    for config in (dict(num_blocks=22, max_num_batched_tokens=7), dict(max_num_seqs=3, max_num_batched_tokens=5)):
        engine = Engine(model, block_size=4, **config)
        got = engine.generate(prompts, n=3, params=params)
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want], config
        for g, w in zip(got, want, strict=True):
            for c, d in zip(g, w, strict=True):
                assert_close("logprobs", torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-5)
        assert engine.stats.leaked_blocks == 0
        preemptions += engine.stats.num_preemptions
    assert preemptions > 0
    share = Engine(model, block_size=4).generate(prompts[3:5], n=3, params=params, group_ids=[3, 4])
    assert [[c.token_ids for c in g] for g in share] == [[c.token_ids for c in g] for g in want[3:5]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_penalty_counts_tool_tokens(model, temperature):
    """With turn_end, the tool tokens appended to a completion are among its seen tokens: the engine's continuation
    samples what TRL's re-prefill loop samples, where they are part of the new prompt (so transformers' penalty
    counts them), also when a small pool preempts sequences mid-conversation."""
    prompts = prompts_for(4)
    params = SamplingParams(temperature=temperature, repetition_penalty=1.4, max_new_tokens=40,
                            stop_token_ids=TURN_STOPS, seed=7)  # fmt: skip
    want = reprefill(Engine(model, block_size=4), prompts, 2, params, tool)
    for config in (dict(), dict(num_blocks=31, max_num_batched_tokens=8)):
        engine = Engine(model, block_size=4, **config)
        got = engine.generate(prompts, n=2, params=params, turn_end=tool)
        assert tokens_of(got) == tokens_of(want), config
        assert engine.stats.num_turns >= 8 and engine.stats.leaked_blocks == 0
    assert engine.stats.num_preemptions > 0
    without = Engine(model, block_size=4).generate(prompts, n=2, params=replace(params, repetition_penalty=1.0),
                                                   turn_end=tool)  # fmt: skip
    assert tokens_of(without) != tokens_of(got)
    for prompt, group in zip(prompts, got, strict=True):
        for c in group:
            sampled = torch.tensor(c.tool_mask, dtype=torch.bool)
            want_logprobs = hf_logprobs(model, prompt, c.token_ids, params)[sampled]
            assert_close("logprobs", torch.tensor(c.logprobs)[sampled], want_logprobs, atol=1e-4)


def test_seen_tokens_rows():
    """SeenTokens: a row's prompt (padded with its first token) and its completion's columns before the one it
    samples, the rest filled with the prompt's first token: repeats penalize nothing more."""
    completions = torch.tensor([[7, 8, 9, 0], [5, 5, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]])  # 2 prompts x n = 2
    seen = SeenTokens([[3, 4, 5], [6]], 2, completions)
    rows = seen(torch.tensor([0, 1, 3]), torch.tensor([3, 2, 0]), torch.tensor([3, 2, 0]).numpy())
    assert rows.tolist() == [[3, 4, 5, 7, 8, 9], [3, 4, 5, 5, 5, 3], [6, 6, 6, 6, 6, 6]]


# -- the fused sampler --------------------------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize("temperature,top_k,min_p,repetition_penalty", [
    (0.0, 0, 0.0, 1.3), (1.0, 0, 0.1, 1.0), (0.6, 300, 0.02, 1.0), (0.6, 0, 0.3, 0.8), (1.0, 5, 1.0, 1.2),
])  # fmt: skip
def test_fused_sampler_with_min_p_and_penalty(temperature, top_k, min_p, repetition_penalty):
    """What the engine runs where Triton does (Engine._sample): the penalty on an fp32 copy, top-k and min-p as one
    threshold per row (logit_floor), the kernels over several vocabulary tiles; the PyTorch sampler's tokens, and
    logprobs to 1e-6. min-p's threshold in logits (max + temperature log min_p) against transformers' probability
    ratio could differ only for a logit within a few ulps of it; none is here."""
    from fastgrpo.kernels.sampling import BLOCK_V, fused_sample
    from fastgrpo.sampling.sampler import penalized

    rows, vocab = 64, 2 * BLOCK_V + 333
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(rows, vocab, generator=g) * 4).bfloat16()
    seen = torch.randint(0, vocab, (rows, 50), generator=g)
    seen[:, :5] = logits.float().topk(5, dim=-1).indices  # the penalty reaches the likeliest tokens
    params = SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty)
    u = None if params.greedy else uniforms(7, torch.arange(rows), torch.full((rows,), 2))
    z = penalized(logits, seen, repetition_penalty) if repetition_penalty != 1 else logits
    tokens, logprobs = fused_sample(z, temperature, u, logit_floor(z, params))
    want_tokens, want_logprobs = sample(logits.float(), params, u, seen)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-6)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run of the Triton backend")
@pytest.mark.slow  # the whole model in Triton's interpreter
def test_triton_backend_samples_what_the_torch_backend_samples(model):
    prompts = prompts_for(4)[:4]
    for params in (SamplingParams(temperature=0, repetition_penalty=1.3, max_new_tokens=8, **NO_STOP),
                   SamplingParams(temperature=0.8, top_k=20, min_p=0.05, repetition_penalty=1.2, max_new_tokens=8,
                                  seed=2, **NO_STOP)):  # fmt: skip
        fused = Engine(model, block_size=4, attention="triton", max_num_batched_tokens=24)
        got = fused.generate(prompts, n=2, params=params)
        want = Engine(model, block_size=4, max_num_batched_tokens=24).generate(prompts, n=2, params=params)
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
        for g, w in zip(got, want, strict=True):
            for c, d in zip(g, w, strict=True):
                assert_close("logprobs", torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-5)


# -- options and their checks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"), (dict(min_p=True), "min_p"), (dict(min_p="0.1"), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=-1.2), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
])  # fmt: skip
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match) as error:
        SamplingParams(**kwargs)
    assert "\n" not in str(error.value)


def config(**overrides) -> TrainConfig:
    return TrainConfig(model_name_or_path="builtin", dataset_name="builtin", **overrides)


def sampling_params(cfg: TrainConfig, evaluation: bool = False) -> SamplingParams:
    """The trainer's SamplingParams for `cfg` (its helper needs only the config and the stop tokens)."""
    trainer = types.SimpleNamespace(config=cfg, stop_token_ids=(1,))
    return Trainer._sampling_params(trainer, seed=3, evaluation=evaluation)


def test_train_config_options_reach_the_sampler():
    """TRL's defaults (min_p None, repetition_penalty 1) are off; generation_kwargs' keys override the options of
    the same names (TRL's update of its generation kwargs), except that evaluation keeps eval_temperature."""
    default = sampling_params(config())
    assert (default.min_p, default.repetition_penalty, default.temperature) == (0.0, 1.0, 1.0)
    cfg = config(min_p=0.05, repetition_penalty=1.1, top_p=0.9, temperature=0.7, max_completion_length=9,
                 generation_kwargs={"temperature": 1.2, "top_k": 40, "min_p": 0.1, "repetition_penalty": 1.3})
    train = sampling_params(cfg)
    assert (train.temperature, train.top_p, train.top_k, train.min_p, train.repetition_penalty) == (
        1.2, 0.9, 40, 0.1, 1.3)
    assert (train.max_new_tokens, train.stop_token_ids, train.seed) == (9, (1,), 3)
    evaluation = sampling_params(cfg, evaluation=True)
    assert (evaluation.temperature, evaluation.top_k, evaluation.repetition_penalty) == (0.0, 40, 1.3)
    assert sampling_params(config(min_p=0.2, generation_kwargs={"min_p": None})).min_p == 0.0


@pytest.mark.parametrize("overrides,match", [
    (dict(min_p=1.5), r"min_p must be None or a number in \[0, 1\], got 1.5"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a number in \(0, inf\), got 0.0"),
    (dict(generation_kwargs={"num_beams": 4}), "generation_kwargs: 'num_beams' is not a sampling option"),
    (dict(generation_kwargs={"suppress_tokens": [3]}), "generation_kwargs: 'suppress_tokens'"),
    (dict(generation_kwargs={"max_new_tokens": 64}), r"'max_new_tokens' .* \(set max_completion_length instead\)"),
    (dict(generation_kwargs={"max_tokens": 64}), r"'max_tokens' .* \(set max_completion_length instead\)"),
    (dict(generation_kwargs={"seed": 1}), r"'seed' .* \(set seed instead\)"),
    (dict(generation_kwargs={"top_p": 0}), r"generation_kwargs\['top_p'\] must be a number in \(0, 1\], got 0"),
    (dict(generation_kwargs={"top_k": 2.5}), r"generation_kwargs\['top_k'\] must be an int >= 0"),
    (dict(generation_kwargs={"temperature": "hot"}), r"generation_kwargs\['temperature'\] must be a number >= 0"),
    (dict(generation_kwargs={"repetition_penalty": True}), r"generation_kwargs\['repetition_penalty'\]"),
])  # fmt: skip
def test_bad_train_config_sampling_options(overrides, match):
    with pytest.raises(ValueError, match=match) as error:
        config(**overrides)
    assert "\n" not in str(error.value)


def test_generation_kwargs_from_the_command_line():
    """A JSON object on the command line, as TRL's parser takes it."""
    import argparse

    from fastgrpo.train.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--generation-kwargs", '{"min_p": 0.1, "repetition_penalty": 1.2}', "--min-p", "0.05",
                              "--repetition-penalty", "1.1"])  # fmt: skip
    assert args.generation_kwargs == {"min_p": 0.1, "repetition_penalty": 1.2}
    assert (args.min_p, args.repetition_penalty) == (0.05, 1.1)
