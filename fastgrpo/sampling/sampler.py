"""Logits -> next tokens, with the log-probability of each token under the distribution it was drawn from.

Randomness is counter-based: the uniform that picks a sequence's token at a column of its completion is a hash of
(seed, sequence, column), computed on the device for all rows at once. So what a sequence samples depends only on
the seed, which completion it is and its tokens so far: not on the batch it was decoded in, the order of the rows,
preemptions, or how the prompts were split across calls or processes. One uniform per row picks the token by
inverse CDF (fp64 cumulative sum of the probabilities): a CPU draws random numbers at ~5 ns each, so the usual
exponential race (one draw per vocabulary entry) would cost more than everything else the engine does per step.
"""

import math

import numpy as np
import torch

from fastgrpo.sampling.params import SamplingParams

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanche hash of 32-bit values held in int64: multipliers below 2^31 keep every product below 2^63, so
    no step overflows (the same bits on every device)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


def uniforms(seed: int, streams: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """fp64 in (0, 1), one per (seed, stream, column) (streams and columns broadcast), independent of everything
    else in the batch."""
    seed_hash = _mix32(torch.tensor([seed & _MASK32, (seed >> 32) & _MASK32], device=streams.device))
    h = _mix32(seed_hash[0] ^ _mix32((streams & _MASK32) ^ seed_hash[1]))
    h = _mix32(h ^ (columns & _MASK32))
    return (h.double() + 0.5) / 2.0**32


def penalized(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """[R, V] -> an fp32 copy with the repetition penalty on each row's seen tokens (`seen` [R, L] int64, repeats
    allowed): a logit x becomes x / penalty when x >= 0, x * penalty when x < 0 (transformers'
    RepetitionPenaltyLogitsProcessor; gather, then scatter back)."""
    out = logits.to(torch.float32, copy=True)
    x = out.gather(-1, seen)  # [R, L]
    return out.scatter_(-1, seen, torch.where(x < 0, x * penalty, x / penalty))


def processed_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """[R, V] fp32 -> the logits actually sampled from, in transformers' order: the repetition penalty on the tokens
    in `seen` [R, L] (None: off), then / temperature, top-k, top-p and min-p (-inf outside).

    Greedy decoding samples from the penalized logits (transformers applies the penalty there too, the rest not).
    """
    if seen is not None and params.repetition_penalty != 1:
        logits = penalized(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits
    if params.temperature != 1:
        logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it already does.
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if params.min_p > 0:
        probs = logits.softmax(dim=-1)  # [R, V]
        logits = logits.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def logit_floor(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """[R, V] (the sampled logits before temperature) -> [R] fp32: the value below which the fused sampler masks a
    logit x, for top-k and min-p together (top-p aside); None when neither is on, or greedy.

    top-k: the k-th largest x. min-p: exp((x - max) / temperature) >= min_p, i.e. x >= max + temperature log(min_p)
    (min-p keeps the maximum, and ratios to it do not depend on what top-k dropped). Both: the larger of the two.
    """
    if params.greedy:
        return None
    floor = None
    if 0 < params.top_k < logits.shape[-1]:
        floor = torch.topk(logits, params.top_k, dim=-1).values[:, -1].float()
    if params.min_p > 0:
        min_p = logits.amax(dim=-1).float() + params.temperature * math.log(params.min_p)
        floor = min_p if floor is None else torch.maximum(floor, min_p)
    return floor


class SeenTokens:
    """Each sampling row's tokens so far, for the repetition penalty: its prompt and its completion's columns before
    the one it samples (sampled tokens and the tokens turn_end appended), as rows of token ids built on the device
    per step. They come from the prompts (kept once per call) and the output buffer that already holds every
    completion's tokens (batch.Outputs), addressed by output row: so they follow a sequence through joins, leaves,
    preemptions and continuations without state of their own in the decode batch.

    Bytes: the prompts, [num_prompts, longest prompt] int64, for the call; per step [R, longest prompt + the rows'
    furthest column] int64 of token ids and as much fp32 of gathered logits (256 rows x 4608 columns: 9.4 + 4.7 MB).
    """

    def __init__(self, prompts: list[list[int]], n: int, completions: torch.Tensor):
        """`completions` [num_prompts * n, max_new_tokens] int64: the output buffer (Outputs.tokens); completion j of
        prompt i is its row i * n + j."""
        width = max(map(len, prompts))
        # Padding repeats a prompt's first token: a repeated index penalizes nothing more.
        padded = [prompt + prompt[:1] * (width - len(prompt)) for prompt in prompts]
        self.prompts = torch.tensor(padded, dtype=torch.long).to(completions.device)  # [P, width]
        self.n, self.completions = n, completions

    def __call__(self, seq_ids: torch.Tensor, columns: torch.Tensor, host_columns: np.ndarray) -> torch.Tensor:
        """Rows sampling completion `seq_ids` [R] at `columns` [R] (on the host too) -> [R, L] int64 token ids."""
        prompts = self.prompts[seq_ids // self.n]  # [R, width]
        width = int(host_columns.max()) if len(host_columns) else 0
        before = torch.arange(width, device=columns.device) < columns[:, None]  # [R, width]: columns already filled
        completions = torch.where(before, self.completions[seq_ids, :width], prompts[:, :1])  # [R, width]
        return torch.cat([prompts, completions], dim=1)


def sample(
    logits: torch.Tensor,  # [R, V] fp32
    params: SamplingParams,
    u: torch.Tensor | None,  # [R] fp64 in (0, 1): each row's uniform (from `uniforms`); None when greedy
    seen: torch.Tensor | None = None,  # [R, L] int64: each row's tokens so far (SeenTokens), for repetition_penalty
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R] int64, logprobs [R] fp32
    """Four passes over [R, V]: max, subtract, exp, and the fp64 cumulative sum whose last entry is the softmax's
    denominator, so log p(token) = z_token - max - log(sum) needs no log-softmax of the whole row."""
    z = processed_logits(logits, params, seen)  # [R, V]
    top = z.amax(dim=-1, keepdim=True)  # [R, 1]
    weights = (z - top).exp_()  # [R, V]: unnormalised probabilities (0 outside top-k / top-p)
    if params.greedy:
        tokens = z.argmax(dim=-1)
        total = weights.sum(dim=-1, dtype=torch.float64)
    else:
        # Inverse CDF: token v when cdf[v - 1] <= u * total < cdf[v]; tokens of probability 0 have an empty
        # interval, so they are never drawn.
        cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [R, V]
        total = cdf[:, -1]
        tokens = torch.searchsorted(cdf, (u * total)[:, None], right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
    logprobs = (z.gather(-1, tokens[:, None])[:, 0] - top[:, 0]).double() - total.log()
    return tokens, logprobs.float()
