"""The plain-PyTorch reference: full logits, and the exact math of TRL 1.16's `GRPOTrainer._compute_loss`.

One process, gradient_accumulation_steps=1, steps_per_generation=1, no vLLM importance correction, no entropy
mask or bonus, no off-policy mask. This is the yardstick for every fast path in tests and benchmarks; it also serves
as the `FASTGRPO_BACKEND=reference` backend. It materializes the [..., V] logits, so it is neither fast nor small.
"""

import torch
import torch.nn.functional as F

from fastgrpo.loss_config import CLIP_LOSS_TYPES, TOKEN_NORMALISED_LOSS_TYPES, LossConfig


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
    """fn over the non-NaN entries of x; NaN when there are none (TRL's nanmin/nanmax)."""
    finite = x[~torch.isnan(x)]
    return fn(finite) if finite.numel() else torch.tensor(float("nan"), device=x.device)


def token_objective(logps, mask, advantages, old_logps, ref_logps, config: LossConfig, importance_weights=None):
    """TRL's per-token objective before normalisation: logps / mask / old / ref [B, T], advantages and
    importance_weights (the sampler's truncated IS correction; None: 1) [B, 1] or [B, T] -> (per_token_loss [B, T]
    (or [B, 1] broadcastable), per_token_kl [B, T] or None, coef_1).

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

    if c.loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=c.epsilon_high).detach()
        loss = -clamped_ratios * advantages * logps
    elif c.loss_type in CLIP_LOSS_TYPES:
        coef_2 = torch.clamp(coef_1, 1 - c.epsilon_low, 1 + c.epsilon_high)
        if c.delta is not None:
            coef_1 = torch.clamp(coef_1, max=c.delta)
        loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    else:  # sapo
        temperatures = torch.where(advantages > 0, c.sapo_temperature_pos, c.sapo_temperature_neg)
        loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages

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

    if c.loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif c.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif c.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * c.max_completion_length)
    elif c.loss_type in TOKEN_NORMALISED_LOSS_TYPES:
        items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=mask.dtype)
        loss = (per_token_loss * mask).sum() / items.clamp(min=1.0)
    else:  # luspo
        loss = (per_token_loss * mask).sum(-1).mean()
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
    if c.loss_type in CLIP_LOSS_TYPES:
        is_low = ((coef_1 < 1 - c.epsilon_low) & (advantages < 0)).to(mask.dtype)
        is_high = ((coef_1 > 1 + c.epsilon_high) & (advantages > 0)).to(mask.dtype)
        metrics["clip_ratio/low_mean"] = global_masked_mean(is_low)
        metrics["clip_ratio/high_mean"] = global_masked_mean(is_high)
        metrics["clip_ratio/region_mean"] = global_masked_mean(torch.maximum(is_low, is_high))
        metrics["clip_ratio/low_min"] = nan_reduce(masked_seq_mean(is_low), torch.min)
        metrics["clip_ratio/high_max"] = nan_reduce(masked_seq_mean(is_high), torch.max)
    elif c.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = global_masked_mean(((coef_1 > c.epsilon_high) & (advantages > 0)).to(mask.dtype))
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
