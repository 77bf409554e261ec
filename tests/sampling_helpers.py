"""Shared helpers of the sampling-engine tests: tiny random Qwen2 / Qwen3 / Llama models with peaked outputs, prompts
of ragged lengths across page boundaries, and independent expectations (HF greedy, full-forward logits, the
logprobs of the processed distribution)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fastgrpo.sampling import Engine, SamplingParams, Turn
from fastgrpo.sampling.engine import Completion

NUM_WORDS = 125  # vocab 128 with the 3 special tokens
# tiny()'s families as test parameters: qwen2 in the fast run (-m "not slow"), all three in the full run.
FAMILIES = ["qwen2", pytest.param("qwen3", marks=pytest.mark.slow), pytest.param("llama", marks=pytest.mark.slow)]


def tiny(family: str, seed: int = 0):
    """A tiny fp32 model with peaked output distributions (random init std 0.02 makes them almost uniform, and
    greedy ties would then hinge on the last ulp)."""
    common = dict(vocab_size=NUM_WORDS + 3, num_hidden_layers=2, max_position_embeddings=256, eos_token_id=1,
                  pad_token_id=0, bos_token_id=1, tie_word_embeddings=False)
    if family == "qwen2":  # 4 query heads on 2 KV heads
        model_cls, config = Qwen2ForCausalLM, Qwen2Config(hidden_size=64, intermediate_size=128,
                                                          num_attention_heads=4, num_key_value_heads=2, **common)
    elif family == "qwen3":  # q/k norms, explicit head_dim
        model_cls, config = Qwen3ForCausalLM, Qwen3Config(hidden_size=64, intermediate_size=128, head_dim=16,
                                                          num_attention_heads=4, num_key_value_heads=4, **common)
    else:  # 6 query heads on 1 KV head
        model_cls, config = LlamaForCausalLM, LlamaConfig(hidden_size=96, intermediate_size=128,
                                                          num_attention_heads=6, num_key_value_heads=1, **common)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    return model


def prompts_for(block_size: int, seed: int = 0) -> list[list[int]]:
    """Ragged lengths at and across page boundaries."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 1, 37]
    return [torch.randint(3, NUM_WORDS + 3, (n,), generator=g).tolist() for n in lengths if n > 0]


def hf_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


NO_STOP = dict(stop_token_ids=())


def full_forward_logits(model, prompt, completion):
    """[len(completion), V] fp32 logits that predicted each completion token, from one plain forward pass."""
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def expected_logprobs(logits, tokens, temperature, top_k, top_p):
    """Log-softmax of the processed logits at `tokens`, written out independently of the sampler."""
    z = logits / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k:
        keep &= z >= z.topk(top_k, dim=-1).values[:, -1:]
    if top_p < 1:
        for row in range(z.shape[0]):
            order = z[row].masked_fill(~keep[row], float("-inf")).argsort(descending=True)
            probs = z[row].masked_fill(~keep[row], float("-inf")).softmax(0)[order]
            mass, kept = 0.0, torch.zeros_like(keep[row])
            for token, p in zip(order.tolist(), probs.tolist(), strict=True):
                if mass >= top_p:
                    break
                kept[token], mass = True, mass + p
            keep[row] &= kept
    logp = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


# -- multi-turn sampling: a stand-in tool, TRL's re-prefill loop, and what each position costs -----------------

# 10 of the 128 ids end a turn: on these peaked models turns last from 1 to a few tens of tokens.
TURN_STOPS = tuple(range(3, 13))


def tool(turns: list[Turn]) -> list[list[int] | None]:
    """A deterministic stand-in for tools: finishes some sequences, answers the others with 2..8 tokens that depend
    on the turn's text (so siblings that diverged get different results)."""
    answers = []
    for t in turns:
        if t.turn >= 3 or (t.prompt_index + t.completion_index + t.turn) % 4 == 3:
            answers.append(None)
        else:
            length = 2 + (sum(t.token_ids) + t.turn) % 7
            answers.append([3 + (7 * sum(t.token_ids) + 13 * k) % NUM_WORDS for k in range(length)])
    return answers


def reprefill(engine: Engine, prompts: list[list[int]], n: int, params: SamplingParams, turn_end) -> list:
    """TRL's loop: generate; hand the turns that ended on a stop to `turn_end`; drop an answer that would take the
    completion past max_new_tokens (the sequence ends as it is); generate again from prompt + completion + answer
    (max_new_tokens new tokens, cut to what the completion has left, as TRL cuts post-tool tokens)."""
    limit = params.max_new_tokens
    state = {}  # (i, j) -> [tokens, logprobs, mask, finish_reason, turns]
    live = []  # (i, j, the turn's tokens)
    for i, group in enumerate(engine.generate(prompts, n=n, params=params)):
        for j, c in enumerate(group):
            state[i, j] = [list(c.token_ids), list(c.logprobs), [1] * len(c.token_ids), c.finish_reason, 0]
            if c.finish_reason == "stop":
                live.append((i, j, c.token_ids))
    while live:
        turns = [Turn(i, j, state[i, j][4], tokens, limit - len(state[i, j][0])) for i, j, tokens in live]
        keys, next_prompts = [], []
        for (i, j, _), answer in zip(live, turn_end(turns), strict=True):
            tokens, logprobs, mask, _, _ = s = state[i, j]
            if answer is None:
                continue  # finish_reason stays "stop"
            s[3] = "length"
            if len(tokens) + len(answer) > limit:
                continue  # rolled back
            tokens += answer
            logprobs += [0.0] * len(answer)
            mask += [0] * len(answer)
            s[4] += 1
            if len(tokens) < limit:
                keys.append((i, j))
                next_prompts.append(prompts[i] + tokens)
        live = []
        if not keys:
            break
        outputs = engine.generate(next_prompts, n=1, params=params, group_ids=[i * n + j for i, j in keys],
                                  first_columns=[len(state[key][0]) for key in keys])  # fmt: skip
        for key, (c,) in zip(keys, outputs, strict=True):
            tokens, logprobs, mask, _, _ = s = state[key]
            room = limit - len(tokens)
            tokens += c.token_ids[:room]
            logprobs += c.logprobs[:room]
            mask += [1] * len(c.token_ids[:room])
            s[3] = c.finish_reason if len(c.token_ids) <= room else "length"
            if s[3] == "stop":
                live.append((*key, c.token_ids))
    completions = {key: Completion(tokens, logprobs, reason, mask) for key, (tokens, logprobs, mask, reason, _)
                   in state.items()}  # fmt: skip
    return [[completions[i, j] for j in range(n)] for i in range(len(prompts))]


def tokens_of(outputs) -> list:
    return [[(c.token_ids, c.tool_mask, c.finish_reason) for c in group] for group in outputs]


def never_fed(c: Completion) -> int:
    """A completion's tokens that are never fed to the model: its last sampled one and the tool tokens after it
    (those that filled it to max_new_tokens)."""
    last_sampled = max(i for i, sampled in enumerate(c.tool_mask) if sampled)
    return len(c.tool_mask) - last_sampled


def assert_each_position_once(engine: Engine, prompts, outputs) -> None:
    """Every prompt token once per group, every completion token once (bar those never fed), with nothing
    recomputed: no prompt or earlier turn is computed again."""
    stats = engine.stats
    completions = [c for group in outputs for c in group]
    fed_once = sum(map(len, prompts)) + sum(len(c.token_ids) - never_fed(c) for c in completions)
    assert stats.num_forward_tokens - stats.num_recomputed_tokens == fed_once
    assert stats.num_generated_tokens == sum(sum(c.tool_mask) for c in completions)
    assert stats.num_appended_tokens == sum(len(c.tool_mask) - sum(c.tool_mask) for c in completions)
    assert stats.leaked_blocks == 0
