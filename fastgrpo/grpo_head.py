"""The lm_head and the GRPO loss from hidden states, chunk by chunk: the default path of fastgrpo.loss.

Training loss (`grpo_head_loss`). Each token's upstream gradient g_t = dL/dlogp_t is known as soon as its logp is:
the normalisers depend only on the mask and `num_items_in_batch`, the per-token objective only on the token (token
level) or on its own sequence (sequence level). So the gradient is computed in the forward pass: per chunk of
tokens, GEMM 1 forms the logits, the row statistics give logp and entropy, `torch.func.grad_and_value` of
`fastgrpo.reference.token_objective` (the one copy of TRL's math) gives g on those C numbers, the dZ pass writes the
logits' gradient, and GEMMs 2 and 3 give dX and accumulate dW (fastgrpo/chunked.py). The backward only scales the
saved dX, dW, db by grad_output (`_GradientInForward`): three GEMMs in all, no recompute.

Sequence-level ratios (GSPO) and VESPO's sequence weight (off-policy or with the sampler's ratios; on-policy without
them it is 1) need a whole sequence's logprobs before any of its gradients: chunks then hold whole sequences, and a
sequence longer than a chunk takes two passes (its logprobs, then its chunks' logits again).

`head_logprobs` (behind fastgrpo.loss.token_logprobs): with no gradient one GEMM per chunk and the row statistics;
with one, the backward forms each chunk's logits again (4 GEMMs in all), since the caller's loss is not known here.

Which tokens are scored. Eager: only the valid ones (completion_mask != 0), selected with a nonzero (a host sync).
Under torch.compile: every position of [B, T] with padding weighed 0, so that shapes are static and nothing syncs
(the loop traces into one graph around the row ops; the cost is padding's share of the GEMMs).
"""

from dataclasses import dataclass

import torch

from fastgrpo import reference
from fastgrpo.chunked import HeadGrads, LogitMap, logprobs_no_grad
from fastgrpo.loss_config import LossConfig


@dataclass(frozen=True)
class TokenInputs:
    """Per scored token n (row-major): all [N], on the hidden states' device, of the loss's dtype."""

    mask: torch.Tensor  # 1 on valid tokens, 0 on padding (scored only under torch.compile)
    advantages: torch.Tensor
    weights: torch.Tensor  # the loss type's normaliser of the token's row (loss = sum_n w_n mask_n l_n)
    old_logps: torch.Tensor | None  # None: on-policy
    ref_logps: torch.Tensor | None  # None: beta = 0
    importance_weights: torch.Tensor | None  # the sampler's IS correction of the policy term
    entropy_weights: torch.Tensor | None  # the entropy bonus: loss -= sum_n entropy_weights_n entropy_n
    row_lengths: list[int] | None  # whole sequences: scored tokens per row; token by token: None


@dataclass(frozen=True)
class _Unit:
    """Scored tokens [start, end) whose gradients can be computed together; `lengths` their rows' (sequence
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


def _unit_loss(logp, unit: _Unit, tokens: TokenInputs, config: LossConfig):
    """The unit's share of the loss, sum_n w_n mask_n l_n, from its logp [n]."""
    sl = slice(unit.start, unit.end)
    part = lambda t: None if t is None else t[sl]
    if unit.lengths is None:  # token by token: every token on its own, as one row [1, n]
        rows = lambda t: None if t is None else t[None]
    else:  # whole sequences, right-padded to [r, L]
        lengths = torch.tensor(unit.lengths, device=logp.device)
        filled = torch.arange(max(unit.lengths), device=logp.device) < lengths[:, None]  # [r, L]
        rows = lambda t: None if t is None else t.new_zeros(filled.shape).masked_scatter(filled, t)
    mask = rows(part(tokens.mask))
    objective, _, _ = reference.token_objective(rows(logp), mask, rows(part(tokens.advantages)),
                                                rows(part(tokens.old_logps)), rows(part(tokens.ref_logps)), config,
                                                rows(part(tokens.importance_weights)))  # [r, L]
    return (objective * mask * rows(part(tokens.weights))).sum()


def _objective_and_grad(logp, entropy, unit: _Unit, tokens: TokenInputs, config: LossConfig):
    """(the unit's share of the loss with its entropy bonus, the gradients w.r.t. the unit's logp [n] and entropy [n]
    (None without a bonus))."""
    g, value = torch.func.grad_and_value(lambda lp: _unit_loss(lp, unit, tokens, config))(logp)
    if tokens.entropy_weights is None:
        return value, g, None
    h = -tokens.entropy_weights[unit.start : unit.end]
    return value + (h * entropy).sum(), g, h


def _loss_and_grads(x, weight, bias, ids, tokens: TokenInputs, config: LossConfig, need):
    """(loss, logp [N], entropy [N], (dX, dW, db)) for x [N, H], ids [N]."""
    N = x.shape[0]
    logits = LogitMap.of(config.temperature, config.logit_scale, config.logit_softcap)
    out_dtype = torch.promote_types(x.dtype, torch.float32)
    logp, ent = torch.empty(N, dtype=out_dtype, device=x.device), torch.empty(N, dtype=out_dtype, device=x.device)
    grads = HeadGrads(x, weight, bias, *need)
    loss = torch.zeros((), dtype=out_dtype, device=x.device)
    chunk = grads.plan.chunk
    for unit in _units(N, chunk, tokens.row_lengths):
        pieces = [slice(s, min(s + chunk, unit.end)) for s in range(unit.start, unit.end, chunk)]
        two_pass = len(pieces) > 1  # one sequence longer than a chunk: its logprobs first, then its logits again
        for sl in pieces if two_pass else ():
            rows = grads.buffers.rows(x[sl], grads.w, bias, logits, ids[sl])
            logp[sl], ent[sl] = rows.logp, rows.entropy
        g = h = None
        for sl in pieces:
            rows = grads.buffers.rows(x[sl], grads.w, bias, logits, ids[sl])
            if g is None:  # the unit's logprobs are all known: its objective's gradient
                if not two_pass:
                    logp[sl], ent[sl] = rows.logp, rows.entropy
                whole = slice(unit.start, unit.end)
                part, g, h = _objective_and_grad(logp[whole], ent[whole], unit, tokens, config)
                loss += part
            within = slice(sl.start - unit.start, sl.stop - unit.start)
            grads.add(sl, rows.grad(g[within], None if h is None else h[within], logits.scale, grads.gemm_dtype))
            del rows  # the chunk's logits go before the next chunk's arrive
    return loss, logp, ent, grads.result()


class _GradientInForward(torch.autograd.Function):
    """loss -> loss, with the gradients w.r.t. x, weight, bias computed in the forward (None: not wanted): the
    backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, loss, x, weight, bias, dx, dw, db):
        ctx.save_for_backward(dx, dw, db)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return None, *scaled, None, None, None


def _wants_grad(*tensors) -> list[bool]:
    return [torch.is_grad_enabled() and t is not None and t.requires_grad for t in tensors]


def grpo_head_loss(hidden, weight, bias, completion_ids, completion_mask, advantages, old_logps, ref_logps,
                   importance_weights, num_items_in_batch, config: LossConfig):
    """fastgrpo.loss.fused_grpo_loss's default path: (loss [], metrics: dict of 0-dim tensors), differentiable
    w.r.t. hidden [B, T, H], weight and bias (the gradient computed in the forward); TRL's metrics from the
    reference's math on the [B, T] logprobs. The rest as in fused_grpo_loss."""
    B, T, H = hidden.shape
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    valid = completion_mask != 0  # [B, T]
    # A token's objective reads its whole sequence's logprobs: GSPO's mean log-ratio, VESPO's summed one (constant 0
    # on-policy, where VESPO's weight reads only the sampler's ratios, given per token)
    whole_sequences = config.importance_sampling_level == "sequence" or (
        config.kind.policy == "vespo" and (old_logps is not None or importance_weights is not None))
    if torch.compiler.is_compiling():  # every position, padding weighed 0: static shapes, no sync
        index = None
        x = torch.where(valid.reshape(-1, 1), hidden.reshape(-1, H), 0)  # [B T, H]
        ids = completion_ids.reshape(-1).masked_fill(~valid.reshape(-1), 0)  # padding ids may be out of range
        row_lengths = [T] * B
    else:  # the valid tokens only
        index = valid.reshape(-1).nonzero().squeeze(1)  # [N] row-major
        x = hidden.reshape(-1, H)[index]  # [N, H]
        ids = completion_ids.reshape(-1)[index]
        row_lengths = None
        if whole_sequences:
            lengths = valid.sum(-1)  # [B]
            row_lengths = lengths[lengths > 0].tolist()
    select = lambda t: None if t is None else (t.reshape(-1) if index is None else t.reshape(-1)[index]).to(dtype)
    per_row = advantages[:, None].expand(B, T) if advantages.dim() == 1 else advantages  # [B, T]
    if importance_weights is not None and importance_weights.shape != (B, T):
        importance_weights = importance_weights.reshape(B, 1).expand(B, T)  # one weight per sequence
    mask = valid.to(dtype)  # [B, T]
    weights = reference.row_weights(mask, config, num_items_in_batch)[:, None].expand(B, T)  # [B, T]
    entropy_weights = None
    if config.entropy_coef != 0.0:
        entropy_weights = select(mask * (config.entropy_coef / mask.sum().clamp(min=1.0)))
    tokens = TokenInputs(
        mask=select(mask), advantages=select(per_row), weights=select(weights), old_logps=select(old_logps),
        ref_logps=select(ref_logps), importance_weights=select(importance_weights), entropy_weights=entropy_weights,
        row_lengths=row_lengths if whole_sequences else None,
    )  # fmt: skip
    wants_grad = _wants_grad(hidden, weight, bias)
    with torch.no_grad():
        detached = (x.detach(), weight.detach(), None if bias is None else bias.detach())
        if any(wants_grad):
            loss, logp, ent, grads = _loss_and_grads(*detached, ids, tokens, config, wants_grad)
        else:  # the logprobs only: one GEMM and the row statistics per chunk
            logits = LogitMap.of(config.temperature, config.logit_scale, config.logit_softcap)
            logp, ent = logprobs_no_grad(*detached, ids, logits)
        if index is not None:
            logp, ent = (t.new_zeros(B * T).index_copy_(0, index, t) for t in (logp, ent))
        value, metrics = reference.grpo_loss(logp.view(B, T), completion_mask, advantages, old_logps=old_logps,
                                             ref_logps=ref_logps, config=config, importance_weights=importance_weights,
                                             num_items_in_batch=num_items_in_batch, entropies=ent.view(B, T))
    if not any(wants_grad):
        return value, metrics
    return _GradientInForward.apply(loss, x, weight, bias, *grads), metrics


# -- head_logprobs --------------------------------------------------------------------------------------------------


def _token_logprobs_no_grad(hidden, weight, bias, token_ids, logits: LogitMap, entropy: bool):
    """(logp [...], entropy [...] or None) of token_ids [...] under hidden [..., H] @ weight.T (+ bias): one GEMM per
    chunk and the row statistics."""
    logp, ent = logprobs_no_grad(hidden.reshape(-1, hidden.shape[-1]), weight, bias, token_ids.reshape(-1), logits,
                                 entropy=entropy)  # [N], [N] or None
    return logp.view(token_ids.shape), None if ent is None else ent.view(token_ids.shape)


class _TokenLogprobs(torch.autograd.Function):
    """_token_logprobs_no_grad, differentiable w.r.t. hidden, weight and bias: the backward forms each chunk's logits
    again and takes dZ for the upstream gradients of logp and entropy (GEMMs 2 and 3 on it)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, scale, softcap, entropy):
        ctx.logits, ctx.entropy = LogitMap(scale, softcap), entropy
        logp, ent = _token_logprobs_no_grad(hidden, weight, bias, token_ids, ctx.logits, entropy)
        ctx.save_for_backward(hidden, weight, bias, token_ids)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no entropy term in dZ
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, token_ids = ctx.saved_tensors
        x, ids = hidden.reshape(-1, hidden.shape[-1]), token_ids.reshape(-1)  # [N, H], [N]
        grads = HeadGrads(x, weight, bias, *ctx.needs_input_grad[:3])
        for sl in grads.chunks():
            rows = grads.buffers.rows(x[sl], grads.w, bias, ctx.logits, ids[sl])
            g = torch.zeros_like(rows.logp) if grad_logp is None else grad_logp.reshape(-1)[sl].to(rows.logp.dtype)
            h = None if grad_entropy is None or not ctx.entropy else grad_entropy.reshape(-1)[sl].to(g.dtype)
            grads.add(sl, rows.grad(g, h, ctx.logits.scale, grads.gemm_dtype))
            del rows
        dx, dw, db = grads.result()
        return None if dx is None else dx.view(hidden.shape), dw, db, None, None, None, None


def head_logprobs(hidden, weight, bias, token_ids, logits: LogitMap, entropy: bool):
    """(logp [...], entropy [...] or None) of token_ids [...] under hidden [..., H] @ weight [V, H].T (+ bias),
    >= fp32; differentiable w.r.t. hidden, weight and bias."""
    if any(_wants_grad(hidden, weight, bias)):
        return _TokenLogprobs.apply(hidden, weight, bias, token_ids, logits.scale, logits.softcap, entropy)
    return _token_logprobs_no_grad(hidden, weight, bias, token_ids, logits, entropy)
