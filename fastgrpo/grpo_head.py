"""The GRPO loss from hidden states with its gradient computed in the forward pass (fastgrpo's default path).

For the training loss each token's upstream gradient g_t = dL/dlogp_t is known as soon as its logp is: the
normalisers depend only on the mask and `num_items_in_batch`, and the per-token objective only on the token (token
level) or on its own sequence (sequence level). So each chunk of tokens runs GEMM 1, the row statistics, the
per-token objective and its gradient on C numbers (`fastgrpo.reference.token_objective` under autograd: the one
copy of TRL's math), the dZ pass and GEMMs 2 and 3 (fastgrpo/chunked.py), and the autograd backward only scales the
saved dX, dW, db by grad_output. Three GEMMs in all, no recompute.

Sequence-level ratios (GSPO) need a whole sequence's logprobs before any of its gradients: chunks then hold whole
sequences, and a sequence longer than a chunk takes two passes (its logprobs, then its chunks' logits again);
`STATS["two_pass_sequences"]` counts them.
"""

from dataclasses import dataclass

import torch

from fastgrpo import reference
from fastgrpo.chunked import HeadGrads, LogitMap, chunk_tokens, logprobs_no_grad
from fastgrpo.loss_config import LossConfig

STATS = {"two_pass_sequences": 0}


@dataclass(frozen=True)
class TokenInputs:
    """Per selected token n (the valid completion tokens, row-major): all [N], on the hidden states' device."""

    advantages: torch.Tensor  # fp32
    weights: torch.Tensor  # fp32: the loss type's normaliser of the token's row (loss = sum_n w_n l_n)
    old_logps: torch.Tensor | None  # fp32; None: on-policy
    ref_logps: torch.Tensor | None  # fp32; None: beta = 0
    row_lengths: list[int] | None  # sequence level: selected tokens per row (rows with none left out); else None
    importance_weights: torch.Tensor | None = None  # fp32: the sampler's IS correction of the policy term
    entropy_weight: float = 0.0  # the entropy bonus: loss -= entropy_coef / tokens * sum_n entropy_n


@dataclass(frozen=True)
class _Unit:
    """Selected tokens [start, end) whose gradients can be computed together; `lengths` their rows' (sequence
    level)."""

    start: int
    end: int
    lengths: list[int] | None


def _units(N: int, chunk: int, row_lengths: list[int] | None) -> list[_Unit]:
    if row_lengths is None:
        return [_Unit(start, min(start + chunk, N), None) for start in range(0, N, chunk)]
    units, start, lengths = [], 0, []
    for length in row_lengths:
        if lengths and sum(lengths) + length > chunk:
            units.append(_Unit(start, start + sum(lengths), lengths))
            start, lengths = start + sum(lengths), []
        lengths.append(length)
    if lengths:
        units.append(_Unit(start, start + sum(lengths), lengths))
    return units


def _objective_and_grad(logp, unit: _Unit, tokens: TokenInputs, config: LossConfig):
    """The unit's share of the loss, sum_n w_n l_n, and its gradient w.r.t. the unit's logp [n]."""
    sl = slice(unit.start, unit.end)
    part = lambda t: None if t is None else t[sl]
    with torch.enable_grad():
        lp = logp.detach().requires_grad_(True)  # [n]
        if unit.lengths is None:  # token level: every token on its own, as one row [1, n]
            rows = lambda t: None if t is None else t[None]
            mask = torch.ones_like(lp)[None]
        else:  # whole sequences, right-padded to [r, L]
            lengths = torch.tensor(unit.lengths, device=lp.device)
            filled = torch.arange(max(unit.lengths), device=lp.device) < lengths[:, None]  # [r, L]
            rows = lambda t: None if t is None else t.new_zeros(filled.shape).masked_scatter(filled, t)
            mask = filled.to(lp.dtype)
        objective, _, _ = reference.token_objective(rows(lp), mask, rows(part(tokens.advantages)),
                                                    rows(part(tokens.old_logps)), rows(part(tokens.ref_logps)),
                                                    config, rows(part(tokens.importance_weights)))  # [r, L]
        loss = (objective * mask * rows(part(tokens.weights))).sum()
        (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g


def _loss_and_grads(x, weight, bias, ids, tokens: TokenInputs, config: LossConfig, need):
    """(loss, logp [N], entropy [N], HeadGrads) for x [N, H], ids [N]."""
    N, V = x.shape[0], weight.shape[0]
    logits = LogitMap.of(config.temperature, config.logit_scale, config.logit_softcap)
    out_dtype = torch.promote_types(x.dtype, torch.float32)
    logp, ent = torch.empty(N, dtype=out_dtype, device=x.device), torch.empty(N, dtype=out_dtype, device=x.device)
    grads = HeadGrads(x, weight, bias, *need)
    loss = torch.zeros((), dtype=out_dtype, device=x.device)
    chunk = chunk_tokens(V, x.device)
    for unit in _units(N, chunk, tokens.row_lengths):
        if unit.end - unit.start <= chunk:
            sl = slice(unit.start, unit.end)
            rows = grads.buffers.rows(x[sl], grads.w, bias, logits, ids[sl])
            logp[sl], ent[sl] = rows.logp, rows.entropy
            part, g = _objective_and_grad(rows.logp, unit, tokens, config)
            part, h = _entropy_bonus(part, rows.entropy, tokens)
            grads.add(sl, rows.grad(g, h, logits.scale, grads.gemm_dtype))
            del rows  # the chunk's logits go before the next chunk's arrive
        else:  # one sequence longer than a chunk: its logprobs first, then its chunks' logits again
            STATS["two_pass_sequences"] += 1
            pieces = [slice(s, min(s + chunk, unit.end)) for s in range(unit.start, unit.end, chunk)]
            for sl in pieces:
                rows = grads.buffers.rows(x[sl], grads.w, bias, logits, ids[sl], grad=False)
                logp[sl], ent[sl] = rows.logp, rows.entropy
            part, g = _objective_and_grad(logp[unit.start : unit.end], unit, tokens, config)
            part, h = _entropy_bonus(part, ent[unit.start : unit.end], tokens)
            for sl in pieces:
                rows = grads.buffers.rows(x[sl], grads.w, bias, logits, ids[sl])
                within = slice(sl.start - unit.start, sl.stop - unit.start)
                grads.add(sl, rows.grad(g[within], None if h is None else h[within], logits.scale, grads.gemm_dtype))
        loss += part
    return loss, logp, ent, grads


def _entropy_bonus(part, entropy, tokens: TokenInputs):
    """(part minus the bonus of these tokens, h = d loss / d entropy [n] or None)."""
    if tokens.entropy_weight == 0.0:
        return part, None
    h = torch.full_like(entropy, -tokens.entropy_weight)
    return part + (h * entropy).sum(), h


class GRPOHeadFunction(torch.autograd.Function):
    """(x [N, H], weight [V, H], bias [V] | None, ids [N], tokens, config) -> (loss [], logp [N], entropy [N]).

    The forward computes the gradients; the backward scales them by grad_output. logp and entropy are not
    differentiable outputs."""

    @staticmethod
    def forward(ctx, x, weight, bias, ids, tokens, config):
        need = ctx.needs_input_grad[:3]
        loss, logp, ent, grads = _loss_and_grads(x, weight, bias, ids, tokens, config, need)
        result = grads.result()  # (dX, dW, db), None where not wanted
        ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in result))
        ctx.has = [t is not None for t in result]
        ctx.mark_non_differentiable(logp, ent)
        return loss, logp, ent

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_ent):
        scaled = [t * grad_loss.to(t.dtype) if has else None
                  for t, has in zip(ctx.saved_tensors, ctx.has, strict=True)]
        return (*scaled, None, None, None)


def grpo_head(x, weight, bias, ids, tokens: TokenInputs, config: LossConfig):
    """(loss or None, logp [N], entropy [N]); the loss carries the gradient when autograd wants one, else only
    the logprobs are computed (one GEMM and the row statistics per chunk) and the loss is None."""
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
        logits = LogitMap.of(config.temperature, config.logit_scale, config.logit_softcap)
        logp, ent = logprobs_no_grad(x, weight, bias, ids, logits)
        return None, logp, ent
    return GRPOHeadFunction.apply(x, weight, bias, ids, tokens, config)
