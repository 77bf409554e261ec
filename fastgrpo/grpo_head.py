"""The GRPO loss from hidden states with its gradient computed in the forward pass (fastgrpo's default path).

For the training loss each token's upstream gradient g_t = dL/dlogp_t is known as soon as its logp is: the
normalisers depend only on the mask and `num_items_in_batch`, and the per-token objective only on the token (token
level) or on its own sequence (sequence level). So each chunk of tokens runs GEMM 1, the row statistics, the
per-token objective and its gradient on C numbers (`fastgrpo.reference.token_objective` under autograd: the one
copy of TRL's math), the dZ pass and GEMMs 2 and 3 (fastgrpo/chunked.py), and the backward (fastgrpo.ops registers
it with the op fastgrpo::grpo_head_loss) only scales the saved dX, dW, db by grad_output. Three GEMMs in all, no
recompute.

Sequence-level ratios (GSPO) need a whole sequence's logprobs before any of its gradients: chunks then hold whole
sequences, and a sequence longer than a chunk takes two passes (its logprobs, then its chunks' logits again);
`STATS["two_pass_sequences"]` counts them.
"""

from dataclasses import dataclass

import torch

from fastgrpo import reference
from fastgrpo.chunked import HeadGrads, LogitMap, chunk_tokens, logprobs_no_grad
from fastgrpo.loss_config import TOKEN_NORMALISED_LOSS_TYPES, LossConfig

STATS = {"two_pass_sequences": 0}
# The dispatch keys autograd runs on. A registered op's kernel runs with them excluded (the dispatcher is below the
# op's own autograd there, as in every aten kernel), so the objective's gradient on C numbers lifts the exclusion.
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradCPU,  # removes the Autograd functionality of every backend
                  torch._C.DispatchKey.AutogradOther, torch._C.DispatchKey.AutogradNestedTensor,
                  torch._C.DispatchKey.ADInplaceOrView)


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


def _autograd_on():
    """Autograd back on inside an op's kernel (fastgrpo::grpo_head_loss); outside one nothing is excluded."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def _objective_and_grad(logp, unit: _Unit, tokens: TokenInputs, config: LossConfig):
    """The unit's share of the loss, sum_n w_n l_n, and its gradient w.r.t. the unit's logp [n]."""
    sl = slice(unit.start, unit.end)
    part = lambda t: None if t is None else t[sl]
    with _autograd_on(), torch.enable_grad():
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


def grpo_head(x, weight, bias, ids, tokens: TokenInputs, config: LossConfig, wants_grad):
    """(loss or None, logp [N], entropy [N], (dX [N, H], dW [V, H], db [V]) with None where not wanted) for x [N, H],
    ids [N]; wants_grad: (x, weight, bias). With no gradient wanted only the logprobs are computed (one GEMM and the
    row statistics per chunk) and the loss is None."""
    if not any(wants_grad):
        logits = LogitMap.of(config.temperature, config.logit_scale, config.logit_softcap)
        logp, ent = logprobs_no_grad(x, weight, bias, ids, logits)
        return None, logp, ent, (None, None, None)
    loss, logp, ent, grads = _loss_and_grads(x, weight, bias, ids, tokens, config, wants_grad)
    return loss, logp, ent, grads.result()


def row_weights(mask, config, num_items_in_batch):
    """w_b such that loss = sum_b w_b sum_t m_bt l_bt, for each loss type's normalisation (TRL 1.16)."""
    B = mask.shape[0]
    lengths = mask.sum(-1)  # [B]
    t = config.loss_type
    if t in ("grpo", "sapo"):
        return 1.0 / (B * lengths.clamp(min=1.0))
    if t == "bnpo":
        norm = mask.sum().clamp(min=1.0)
    elif t == "dr_grpo":
        norm = torch.tensor(float(B * config.max_completion_length), device=mask.device)
    elif t in TOKEN_NORMALISED_LOSS_TYPES:
        items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=mask.device)
        norm = items.to(mask.dtype).clamp(min=1.0)
    else:  # luspo
        norm = torch.tensor(float(B), device=mask.device)
    return (1.0 / norm).expand(B).contiguous()


def grpo_head_loss(hidden, weight, bias, completion_ids, completion_mask, advantages, old_logps, ref_logps,
                   importance_weights, num_items_in_batch, config: LossConfig, wants_grad):
    """The default path of `fastgrpo.loss.fused_grpo_loss`: grpo_head on the valid tokens (gradient in the forward),
    TRL's metrics from the reference's math on the [B, T] logprobs (no gradient).

    hidden [B, T, H]; the rest as in fused_grpo_loss; wants_grad: (hidden, weight, bias). Returns (loss [], metrics:
    dict of 0-dim tensors, (dX [B, T, H], dW [V, H], db [V]) with None where not wanted)."""
    B, T, H = hidden.shape
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    valid = completion_mask != 0  # [B, T]
    index = valid.reshape(-1).nonzero().squeeze(1)  # [N] row-major
    per_token = lambda t: None if t is None else t.reshape(-1)[index].detach().to(dtype)  # [B, T] -> [N]
    per_row = advantages[:, None].expand(B, T) if advantages.dim() == 1 else advantages  # [B, T]
    lengths = valid.sum(-1)  # [B]
    if importance_weights is not None and importance_weights.shape != (B, T):
        importance_weights = importance_weights.reshape(B, 1).expand(B, T)  # one weight per sequence
    tokens = TokenInputs(
        advantages=per_token(per_row), old_logps=per_token(old_logps), ref_logps=per_token(ref_logps),
        weights=row_weights(completion_mask.to(dtype), config, num_items_in_batch)[index // T].to(dtype),
        row_lengths=lengths[lengths > 0].tolist() if config.importance_sampling_level == "sequence" else None,
        importance_weights=per_token(importance_weights), entropy_weight=config.entropy_coef / max(index.numel(), 1),
    )  # fmt: skip
    loss, logp, ent, (dx, dw, db) = grpo_head(hidden.reshape(-1, H)[index], weight, bias,
                                              completion_ids.reshape(-1)[index], tokens, config, wants_grad)
    scatter = lambda t: t.new_zeros(B * T, *t.shape[1:]).index_copy_(0, index, t).view(B, T, *t.shape[1:])  # [N, ...]
    with torch.no_grad():
        value, metrics = reference.grpo_loss(scatter(logp), completion_mask, advantages, old_logps=old_logps,
                                             ref_logps=ref_logps, config=config, importance_weights=importance_weights,
                                             num_items_in_batch=num_items_in_batch, entropies=scatter(ent))
    return (value if loss is None else loss), metrics, (None if dx is None else scatter(dx), dw, db)
