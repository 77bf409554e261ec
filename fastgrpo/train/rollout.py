"""One generation round's samples, their group advantages, and how they are cut into micro-batches.

A completion carries, beside its tokens, one value per token of three kinds (the engine's Completion, or a
rollout_func's fields); `rollout_of` takes them into the Rollout, `micro_batch` pads them to the micro-batch's layout:
  tool_mask    1 sampled, 0 appended by a tool         -> loss_mask (0 also for every token of a cut completion with
                                                          mask_truncated_completions): what enters the loss
  logprobs     the sampler's, of the distribution it    -> sampling_logps: the IS correction, the off-policy mask
               drew from (NaN: a rollout_func gave none)    (routing_metrics reads the completions' own)
  routes       MoE: the experts each position went      -> routes: what the training forwards replay or compare
               through, prompt positions first             (PolicyLoss.route, fastgrpo/routing.py)
"""

import math
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Rollout:
    """P prompts x G completions, prompt-major: sample i belongs to prompt i // G."""

    prompt_ids: list[list[int]]  # [P*G] (each group repeats its prompt)
    completion_ids: list[list[int]]  # [P*G]
    truncated: torch.Tensor  # [P*G] bool: hit max_completion_length without a stop
    advantages: torch.Tensor  # [P*G]
    loss_mask: list[list[int]]  # [P*G][T_i]: 1 on tokens that enter the loss
    old_logps: list[torch.Tensor] | None = None  # [P*G][T_i] fp32 (None: on-policy, the current logps)
    ref_logps: list[torch.Tensor] | None = None  # [P*G][T_i] fp32 (None: beta = 0)
    sampling_logps: list[torch.Tensor] | None = None  # [P*G][T_i] fp32: the sampler's (IS correction, off-policy mask)
    # The sampler's truncated IS correction: [P*G][T_i] per token, or [P*G] per sequence (None: off).
    importance_weights: list[torch.Tensor] | torch.Tensor | None = None
    # The experts the engine routed each position through (MoE, routing.py): [P*G][prompt + T_i, MoE layers, k]
    # (an entry None: a rollout_func's sample; the list None: no routes recorded)
    routes: list[torch.Tensor | None] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)


def rollout_of(completions: list, prompt_ids: list[list[int]], advantages: torch.Tensor, mask_truncated: bool,
               sampler_logps: str | None = None) -> Rollout:
    """The round's Rollout from its completions (prompt-major, prompt_ids per sample) and their advantages, every
    per-token extra taken here. sampler_logps: "required" (the IS correction: kept, NaN or not, for check_inputs to
    refuse), "if given" (the off-policy mask: kept unless a rollout_func gave none), or None (not kept)."""
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])
    cut = truncated.tolist()
    sampled = None
    if sampler_logps is not None:
        sampled = [torch.tensor(c.logprobs, dtype=torch.float32) for c in completions]
        if sampler_logps == "if given" and any(bool(t.isnan().any()) for t in sampled):
            sampled = None
    return Rollout(
        prompt_ids=prompt_ids, completion_ids=[c.token_ids for c in completions], truncated=truncated,
        advantages=advantages,
        loss_mask=[[0] * len(c.token_ids) if mask_truncated and cut[i] else list(c.tool_mask)
                   for i, c in enumerate(completions)],
        sampling_logps=sampled,
        routes=[c.routes for c in completions] if any(c.routes is not None for c in completions) else None,
    )  # fmt: skip


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> tuple[torch.Tensor, ...]:
    """rewards [P*G] (NaN for an unscorable sample: every reward function returned None) -> (advantages [P*G], the
    std they were scaled by [P*G] (the group's, or the batch's with "batch"), zero-std flags [P*G]).

    As TRL 1.16: A = r - nanmean(group); divided by nanstd(group) + 1e-4 ("group"), by nanstd(batch) + 1e-4
    ("batch") or not at all ("none"); unscorable samples are left out of the means and stds and get A = 0. A group
    whose scorable rewards are all equal gets exactly zero advantage.
    """
    grouped = rewards.view(-1, num_generations)  # [P, G]
    mean = torch.nanmean(grouped, 1, keepdim=True)
    group_std = nanstd(grouped, 1, keepdim=True).expand_as(grouped).reshape(-1)  # [P*G]
    advantages = (grouped - mean).reshape(-1)
    std = nanstd(rewards).expand_as(rewards) if scale_rewards == "batch" else group_std
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    spread = grouped.nan_to_num(-math.inf).amax(1, keepdim=True) - grouped.nan_to_num(math.inf).amin(1, keepdim=True)
    flat = ~(spread > 0).expand_as(grouped).reshape(-1)  # [P*G]: no two scorable rewards differ
    return advantages.nan_to_num(0.0).masked_fill(flat, 0.0), std, flat


def decoupled_advantages(per_func: torch.Tensor, weights: torch.Tensor, num_generations: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO, TRL 1.16's multi_objective_aggregation="normalize_then_sum": per_func [P*G, F] (NaN where a function
    returned None) -> (advantages [P*G], zero-std flags [P*G]).

    Each function's rewards are normalised within their group, (r - nanmean) / (nanstd + 1e-4), then weighted and
    summed (nansum); the sums are normalised over the batch, (s - nanmean) / (nanstd + 1e-4). A sample every function
    left unscored gets 0. scale_rewards does not apply; the zero-std flag is the batch's, as TRL logs it."""
    grouped = per_func.view(-1, num_generations, per_func.shape[1])  # [P, G, F]
    normalised = (grouped - torch.nanmean(grouped, 1, keepdim=True)) / (nanstd(grouped, 1, keepdim=True) + 1e-4)
    summed = (normalised.reshape(per_func.shape) * weights).nansum(1)  # [P*G]
    summed = summed.masked_fill(per_func.isnan().all(1), math.nan)
    std = nanstd(summed).expand_as(summed)
    advantages = (summed - torch.nanmean(summed)) / (std + 1e-4)
    return advantages.nan_to_num(0.0), torch.isclose(std, torch.zeros_like(std))


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The standard deviation (Bessel-corrected) of the values that are not NaN; NaN with fewer than two."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~x.isnan()).sum(dim=dim, keepdim=True)
    variance = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    std = variance.masked_fill(count < 2, math.nan).sqrt()
    return std if keepdim else std.squeeze() if dim is None else std.squeeze(dim)


def sampler_importance_weights(rollout: Rollout, mode: str, clip_min: float | None,
                               clip_max: float | None) -> tuple[list[torch.Tensor] | torch.Tensor, dict]:
    """TRL 1.16's vllm_importance_sampling_ratio from the old (training-forward) and the sampler's logprobs:
    (weights [P*G][T_i] for token_* modes or [P*G] for sequence_* modes, TRL's sampling/* metrics).

    d = (old - sampling) * mask; the ratio is exp(d) per token, or exp(sum_t d) per sequence; *_truncate clamps it
    to [clip_min, clip_max], *_mask sets it to 0 outside (a None bound is no bound). The sampler's logprobs are those of
    the distribution it drew from (after the repetition penalty, temperature, top-k, top-p and min-p), as vLLM's
    processed logprobs that TRL uses; the old ones are the full softmax at the temperature, so with a filter on, a
    ratio is the kept mass, below 1 (and with a repetition penalty it differs either way).
    """
    assert rollout.old_logps is not None and rollout.sampling_logps is not None, "needs the old and sampler logprobs"
    lengths = [len(ids) for ids in rollout.completion_ids]
    T = max(lengths)
    old = _padded(rollout.old_logps, T, "cpu")  # [N, T]
    sampling = _padded(rollout.sampling_logps, T, "cpu")  # [N, T]
    mask = _padded([torch.tensor(m, dtype=torch.float32) for m in rollout.loss_mask], T, "cpu")  # [N, T]
    diff = (old - sampling) * mask  # [N, T]
    per_sequence = mode.startswith("sequence")
    ratio = torch.exp(diff.sum(-1, keepdim=True) if per_sequence else diff)  # [N, 1] or [N, T]
    if mode.endswith("_truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    valid = mask != 0
    delta = (old - sampling).abs()[valid]  # [tokens]
    flat = ratio.flatten() if per_sequence else ratio[valid]
    stat = lambda x, fn: float(fn(x)) if x.numel() else 0.0
    metrics = {
        "sampling/sampling_logp_difference/mean": stat(delta, torch.mean),
        "sampling/sampling_logp_difference/max": stat(delta, torch.max),
        "sampling/importance_sampling_ratio/min": stat(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": stat(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": stat(flat, torch.max),
    }
    weights = ratio[:, 0] if per_sequence else [row[:n] for row, n in zip(ratio, lengths, strict=True)]
    return weights, metrics


@dataclass(slots=True)
class MicroBatch:
    index: list[int]  # sample indices into the rollout
    completion_ids: torch.Tensor  # [b, T] (0 past each completion)
    mask: torch.Tensor  # [b, T] float: the loss mask
    advantages: torch.Tensor  # [b]
    sequences: list[list[int]]  # prompt + completion per sample
    prompt_lengths: list[int]
    old_logps: torch.Tensor | None  # [b, T]
    ref_logps: torch.Tensor | None  # [b, T]
    importance_weights: torch.Tensor | None  # [b, T] per token or [b] per sequence
    routes: list[torch.Tensor] | None = None  # per sample [prompt + completion, MoE layers, k] (None: not recorded)


def micro_batches(lengths: list[int], micro_batch_size: int, gradient_accumulation_steps: int,
                  generator: torch.Generator) -> list[list[list[int]]]:
    """Sample indices per optimizer step, per micro-batch. A seeded shuffle deals the samples to optimizer steps;
    within a step they are sorted by length before being cut into micro-batches, so each micro-batch pads to a
    similar length (the step's summed gradient does not depend on how its samples are grouped)."""
    order = torch.randperm(len(lengths), generator=generator).tolist()
    per_step = micro_batch_size * gradient_accumulation_steps
    steps = []
    for start in range(0, len(order), per_step):
        ranked = sorted(order[start : start + per_step], key=lambda i: lengths[i])
        steps.append([ranked[k : k + micro_batch_size] for k in range(0, len(ranked), micro_batch_size)])
    return steps


def _padded(rows: list[torch.Tensor], T: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(rows), T)
    for r, row in enumerate(rows):
        out[r, : len(row)] = row
    return out.to(device)


def micro_batch(rollout: Rollout, index: list[int], device: torch.device) -> MicroBatch:
    T = max(len(rollout.completion_ids[i]) for i in index)
    logps = lambda per_sample: None if per_sample is None else _padded([per_sample[i] for i in index], T, device)
    completion_ids = torch.zeros(len(index), T, dtype=torch.long)
    mask = torch.zeros(len(index), T)
    for row, i in enumerate(index):
        ids = rollout.completion_ids[i]
        completion_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = torch.tensor(rollout.loss_mask[i], dtype=torch.float32)
    return MicroBatch(
        index=index,
        completion_ids=completion_ids.to(device),
        mask=mask.to(device),
        advantages=rollout.advantages[index].to(device),
        sequences=[rollout.prompt_ids[i] + rollout.completion_ids[i] for i in index],
        prompt_lengths=[len(rollout.prompt_ids[i]) for i in index],
        old_logps=logps(rollout.old_logps),
        ref_logps=logps(rollout.ref_logps),
        importance_weights=(rollout.importance_weights[index].to(device)
                            if isinstance(rollout.importance_weights, torch.Tensor)
                            else logps(rollout.importance_weights)),
        routes=_routes([rollout.routes[i] for i in index]) if rollout.routes is not None else None,
    )


def _routes(per_sample: list[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """A micro-batch's routes when every sample has them (a rollout_func's have none: the whole micro-batch routes
    itself)."""
    return None if any(r is None for r in per_sample) else per_sample
