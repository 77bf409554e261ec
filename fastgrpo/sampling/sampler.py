"""Logits -> next tokens, with the log-probability of each token under the distribution it was drawn from.

Randomness is counter-based: the uniform that picks a sequence's token at a column of its completion is a hash of
(seed, sequence, column), computed on the device for all rows at once. So what a sequence samples depends only on
the seed, which completion it is and its tokens so far: not on the batch it was decoded in, the order of the rows,
preemptions, or how the prompts were split across calls or processes. One uniform per row picks the token by
inverse CDF (fp64 cumulative sum of the probabilities): a CPU draws random numbers at ~5 ns each, so the usual
exponential race (one draw per vocabulary entry) would cost more than everything else the engine does per step.
"""

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


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] fp32 -> the logits actually sampled from: / temperature, then top-k, then top-p (-inf outside).

    Greedy decoding samples from the raw logits, so they are returned unchanged.
    """
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
    return logits


def sample(
    logits: torch.Tensor,  # [R, V] fp32
    params: SamplingParams,
    u: torch.Tensor | None,  # [R] fp64 in (0, 1): each row's uniform (from `uniforms`); None when greedy
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R] int64, logprobs [R] fp32
    """Four passes over [R, V]: max, subtract, exp, and the fp64 cumulative sum whose last entry is the softmax's
    denominator, so log p(token) = z_token - max - log(sum) needs no log-softmax of the whole row."""
    z = processed_logits(logits, params)  # [R, V]
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
