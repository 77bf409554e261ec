"""The plain-PyTorch reference: full logits, and the math of TRL 1.16's `GRPOTrainer._compute_loss`.

It covers every loss type (VESPO's sequence weight in `vespo_weights`), token- and sequence-level ratios, the k3 KL
(with TRL's bias correction), the static entropy bonus (`entropy_coef`), the sampler's truncated importance-sampling
correction (`importance_weights`), `num_items_in_batch`, the model's logit scale and softcap, and TRL's metrics.
Off-policy masks and entropy masks (TRL's `off_policy_mask_threshold`, `top_entropy_quantile`) act on the per-token loss
before it reaches here: the TRL integration applies them to the mask. This module is the one home of the per-token
objective (`token_objective`, which the default path differentiates chunk by chunk), of the loss types' normalisers
(`row_weights`) and of the metrics (`grpo_loss`); it is the yardstick for every fast path in tests and benchmarks and
the `FASTGRPO_BACKEND=reference` backend. It materializes the [..., V] logits, so it is neither fast nor small.
"""

import math

import torch
import torch.nn.functional as F

from fastgrpo.loss_config import LossConfig


def token_logprobs(hidden, weight, token_ids, *, bias=None, temperature=1.0, return_entropy=False, logit_scale=1.0,
                   logit_softcap=None):
    """hidden [..., H], weight [V, H], token_ids [...] -> (logp [...], entropy [...] or None), at least fp32.

    The logits are computed in the inputs' dtype (as an lm_head in bf16 does) and then upcast; then the model's
    logit scale and softcap (Cohere, Gemma 2), then the temperature.
    """
    logits = F.linear(hidden, weight, bias)  # [..., V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * logit_scale
    if logit_softcap is not None:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    logits = logits / temperature
    all_logps = logits.log_softmax(-1)  # [..., V]
    logp = all_logps.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(all_logps.exp() * all_logps).sum(-1) if return_entropy else None
    return logp, entropy


def nan_reduce(x, fn):
    """fn (torch.min or torch.max) over the non-NaN entries of x; NaN when there are none (TRL's nanmin/nanmax).
    Static shapes (no boolean indexing), so torch.compile traces it without a graph break."""
    nan = torch.isnan(x)
    fill = torch.finfo(x.dtype).max if fn is torch.min else torch.finfo(x.dtype).min
    return torch.where(nan.all(), torch.nan, fn(torch.where(nan, fill, x)))


# The metrics that are means of a ratio indicator: per sequence when the ratio is (importance_sampling_level
# "sequence" with one advantage per sequence), so shares of a batch combine them weighted by sequences, not tokens.
RATIO_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")
# VESPO's bounds on a log-ratio (TRL 1.16): the summed log-ratio lies in [log 1e-8, 20], and so does each log of a
# sampler ratio (a ratio of 0, a token_mask-ed token, counts as 1e-8); each token's log-ratio lies in [-20, 20].
VESPO_LOG_MIN, VESPO_LOG_MAX, VESPO_TOKEN_LOG_BOUND = math.log(1e-8), 20.0, 20.0


def row_weights(mask, config: LossConfig, num_items_in_batch=None):
    """w [B] such that the loss is sum_b w_b sum_t mask_bt loss_bt: each loss type's normaliser (TRL 1.16),
    from mask [B, T] of the loss's dtype."""
    B = mask.shape[0]
    normaliser = config.kind.normaliser
    if normaliser == "sequence":
        return 1.0 / (B * mask.sum(-1).clamp(min=1.0))
    if normaliser == "tokens":
        norm = mask.sum().clamp(min=1.0)
    elif normaliser == "max_length":
        norm = mask.new_tensor(float(B * config.max_completion_length))
    elif normaliser == "items":
        items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=mask.device)
        norm = items.to(mask.dtype).clamp(min=1.0)
    else:
        assert normaliser == "rows", normaliser
        norm = mask.new_tensor(float(B))
    return (1.0 / norm).expand(B)


def vespo_weights(logps, mask, advantages, old_logps, config: LossConfig, importance_weights=None):
    """VESPO's weight of each sequence, phi [B, 1] ([B, T] for per-token advantages), detached: a constant factor of
    the policy term's gradient. logps / mask / old_logps (None: logps, on-policy) [B, T], advantages [B, 1] or [B, T],
    importance_weights (the sampler's per-token ratios pi_old / pi_sampler, folded into w) [B, T] or None.

        log w   = clamp(sum_t mask_t clamp(logp_t - old_t, -20, 20) + sum_t log clamp(iw_t, 1e-8, e^20), log 1e-8, 20)
        phi     = exp(lam + k log w - lam w) = e^lam w^k e^(-lam w), so phi(1) = 1
        (k, lam) = (vespo_k_pos, vespo_lambda_pos) for advantages >= 0, else the _neg pair; lam at least 1e-4

    phi is 0 where it overflows or is NaN (TRL's nan_to_num). Masked positions never reach the result."""
    c = config
    valid = mask != 0
    logps = torch.where(valid, logps.detach(), 0.0)
    old_logps = logps if old_logps is None else torch.where(valid, old_logps, 0.0)
    log_ratio = torch.clamp(logps - old_logps, -VESPO_TOKEN_LOG_BOUND, VESPO_TOKEN_LOG_BOUND)  # [B, T]
    log_w = (log_ratio * mask).sum(-1, keepdim=True)  # [B, 1]
    if importance_weights is not None:
        log_iw = torch.clamp(torch.log(importance_weights.to(log_w.dtype)), VESPO_LOG_MIN, VESPO_LOG_MAX)  # [B, T]
        log_w = log_w + torch.where(valid, log_iw, 0.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, VESPO_LOG_MIN, VESPO_LOG_MAX)
    nonneg = advantages >= 0  # [B, 1] or [B, T]
    pick = lambda pos, neg: torch.where(nonneg, log_w.new_tensor(pos), log_w.new_tensor(neg))  # in log_w's dtype
    k, lam = pick(c.vespo_k_pos, c.vespo_k_neg), pick(c.vespo_lambda_pos, c.vespo_lambda_neg).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def token_objective(logps, mask, advantages, old_logps, ref_logps, config: LossConfig, importance_weights=None):
    """TRL's per-token objective before normalisation: logps / mask / old / ref [B, T], advantages and
    importance_weights (the sampler's truncated IS correction; None: 1) [B, 1] or [B, T] -> (per_token_loss [B, T]
    (or [B, 1] broadcastable), per_token_kl [B, T] or None, coef_1). For vespo the importance weights ([B, T] only)
    enter the sequence's weight phi (`vespo_weights`) instead of multiplying the policy term.

    Masked positions never reach the result: logprobs there (often -inf or NaN padding) count as 0."""
    c = config
    valid = mask != 0
    logps = torch.where(valid, logps, 0.0)
    old_logps = logps.detach() if old_logps is None else torch.where(valid, old_logps, 0.0)
    log_ratio = logps - old_logps  # [B, T]
    if c.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    coef_1 = torch.exp(log_importance_weights)

    per_token_kl = None
    if c.beta != 0.0:
        ref_logps = torch.where(valid, ref_logps, 0.0)
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # [B, T]
        if c.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    policy = c.kind.policy
    if policy == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=c.epsilon_high).detach()
        loss = -clamped_ratios * advantages * logps
    elif policy == "clip":
        coef_2 = torch.clamp(coef_1, 1 - c.epsilon_low, 1 + c.epsilon_high)
        if c.delta is not None:
            coef_1 = torch.clamp(coef_1, max=c.delta)
        loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif policy == "sapo":
        temperatures = torch.where(advantages > 0, c.sapo_temperature_pos, c.sapo_temperature_neg)
        loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    else:
        assert policy == "vespo", policy
        phi = vespo_weights(logps, mask, advantages, old_logps, c, importance_weights)  # [B, 1] or [B, T]
        loss = -phi * advantages * logps
        importance_weights = None  # already in phi

    if importance_weights is not None:
        loss = loss * torch.where(valid, importance_weights, 0.0) if importance_weights.shape == valid.shape else (
            loss * importance_weights)
    if c.beta != 0.0:
        loss = loss + c.beta * per_token_kl
    return loss, per_token_kl, coef_1


def grpo_loss(logps, completion_mask, advantages, *, old_logps=None, ref_logps=None, config: LossConfig,
              num_items_in_batch=None, entropies=None, importance_weights=None):
    """TRL's GRPO loss from per-token logprobs [B, T]; returns (loss, metrics) with TRL's metric names.

    With config.entropy_coef != 0, `entropies` [B, T] carry the bonus's gradient (TRL: minus the coefficient times
    the masked mean entropy); importance_weights [B], [B, 1] or [B, T] multiply the policy term (not the KL)."""
    c = config
    mask = completion_mask.to(logps.dtype)  # [B, T]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # [B, 1]
    if importance_weights is not None and importance_weights.dim() == 1:
        importance_weights = importance_weights.unsqueeze(1)  # [B, 1]
    per_token_loss, per_token_kl, coef_1 = token_objective(logps, mask, advantages, old_logps, ref_logps, c,
                                                           importance_weights)

    loss = ((per_token_loss * mask).sum(-1) * row_weights(mask, c, num_items_in_batch)).sum()
    if c.entropy_coef != 0.0:
        loss = loss - c.entropy_coef * (torch.where(mask != 0, entropies, 0.0) * mask).sum() / mask.sum().clamp(min=1.0)

    def masked_seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return x.sum() / max(x.shape[0], 1)
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    metrics = {}
    if c.beta != 0.0:
        metrics["kl"] = global_masked_mean(per_token_kl)
    if entropies is not None:
        metrics["entropy"] = global_masked_mean(entropies)
    if c.kind.policy == "clip":
        is_low = ((coef_1 < 1 - c.epsilon_low) & (advantages < 0)).to(mask.dtype)
        is_high = ((coef_1 > 1 + c.epsilon_high) & (advantages > 0)).to(mask.dtype)
        metrics["clip_ratio/low_mean"] = global_masked_mean(is_low)
        metrics["clip_ratio/high_mean"] = global_masked_mean(is_high)
        metrics["clip_ratio/region_mean"] = global_masked_mean(torch.maximum(is_low, is_high))
        metrics["clip_ratio/low_min"] = nan_reduce(masked_seq_mean(is_low), torch.min)
        metrics["clip_ratio/high_max"] = nan_reduce(masked_seq_mean(is_high), torch.max)
    elif c.kind.policy == "cispo":
        metrics["cispo_clip_ratio"] = global_masked_mean(((coef_1 > c.epsilon_high) & (advantages > 0)).to(mask.dtype))
    elif c.kind.policy == "vespo":
        phi = vespo_weights(logps, mask, advantages, old_logps, c, importance_weights)
        metrics["vespo/phi_seq_mean"] = global_masked_mean(phi)
    return loss, {k: v.detach() for k, v in metrics.items()}


def fused_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, *, bias=None, old_logps=None,
                    ref_logps=None, config: LossConfig, num_items_in_batch=None, importance_weights=None):
    """The whole loss from hidden [B, T, H] through full logits [B, T, V]."""
    ids = completion_ids.masked_fill(completion_mask == 0, 0)  # padding ids may be out of range
    logps, entropies = token_logprobs(hidden, weight, ids, bias=bias, temperature=config.temperature,
                                      return_entropy=True, logit_scale=config.logit_scale,
                                      logit_softcap=config.logit_softcap)
    return grpo_loss(logps, completion_mask, advantages, old_logps=old_logps, ref_logps=ref_logps, config=config,
                     num_items_in_batch=num_items_in_batch, importance_weights=importance_weights,
                     entropies=entropies if config.entropy_coef != 0.0 else entropies.detach())
