"""The Trainer's update of a round (`Update`): num_iterations passes over the rollout, each optimizer step
accumulating micro-batches of per_device_train_batch_size samples per process (backbone forward with gradient
checkpointing, the fused GRPO loss, backward), then clipping, the optimizer and the LR schedule; and the no-grad
logprobs before it (the old policy's, the reference's).

Loss normalisation follows TRL 1.16: a micro-batch's loss is divided by gradient_accumulation_steps, except
dapo/cispo's, which divide by the loss tokens of an average optimizer step; under torchrun each process's share of a
global micro-batch is scaled so that the averaged gradients are one process's (`_share_scale`), and the metrics of the
shares merge into what one process would log (`merge_metrics`).
"""

import dataclasses
import math
from collections import defaultdict
from contextlib import nullcontext

import torch

from fastgrpo.loss_config import TOKEN_NORMALISED_LOSS_TYPES, LossConfig
from fastgrpo.reference import RATIO_METRICS
from fastgrpo.train import distributed
from fastgrpo.train.finite import check_step
from fastgrpo.train.logs import nanmean
from fastgrpo.train.rollout import Rollout, micro_batch, micro_batches


class Update:
    """The Trainer's update and no-grad logprobs (it reads the trainer's config, world, policy, reference,
    train_module, model, parameters, optimizer, scheduler, loss options and entropy control)."""

    def _update(self, rollout: Rollout) -> dict:
        """num_iterations passes over the round. Each global micro-batch (per_device_train_batch_size * K samples
        of the plan one process would make) is cut into K shares; rank r trains on share r with the loss scaled so
        that the gradients, averaged over ranks by DDP / FSDP, are those of the whole micro-batch.

        TRL's token masks (top_entropy_quantile, off_policy_mask_threshold) go to the loss as TokenMasks, with the
        global micro-batch's share token counts: its entropy quantile and the bonus's token count are then what one
        process computes on the whole micro-batch. Every micro-batch of an optimizer step applies the entropy
        coefficient the step starts with: entropy_coef, or with use_adaptive_entropy `self.entropy_control`'s, which
        the step's entropy over its bonus tokens (all micro-batches, all ranks: one exchange) then updates."""
        from fastgrpo.train.policy_loss import BONUS_ENTROPY, ROUTER_LOSS, TokenMasks

        config, world = self.config, self.world
        self.train_module.train()
        size, K = config.per_device_train_batch_size, world.size
        lengths = [len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids, strict=True)]
        tokens = [sum(m) for m in rollout.loss_mask]  # loss tokens per sample
        # TRL's dapo/cispo normaliser: the loss tokens of the round, spread over its optimizer steps.
        num_items = sum(tokens) * config.gradient_accumulation_steps / config.steps_per_generation
        token_normalised = config.loss_type in TOKEN_NORMALISED_LOSS_TYPES
        control = self.entropy_control if config.use_adaptive_entropy else None
        bonus = config.entropy_coef != 0.0 or control is not None  # TRL's _entropy_bonus_enabled: logs policy_loss
        masked = config.top_entropy_quantile < 1.0 or config.off_policy_mask_threshold is not None
        metrics, weights, losses, grad_norms, coefficients = defaultdict(list), [], [], [], []
        for iteration in range(config.num_iterations):
            shuffle = torch.Generator().manual_seed(self._seed("shuffle", iteration))
            for step_batches in micro_batches(lengths, size * world.size, config.gradient_accumulation_steps,
                                              shuffle):
                step_options = self.loss_options
                if control is not None:  # the coefficient of this step, scaled as model_loss_options scales it
                    coef = control.applied()
                    coef = coef / config.gradient_accumulation_steps if token_normalised else coef
                    step_options = dataclasses.replace(step_options, entropy_coef=coef)
                step_loss, window = 0.0, []  # window: per micro-batch [entropy sum, count] over its bonus tokens
                for j, whole in enumerate(step_batches):
                    index = whole[world.rank * size : (world.rank + 1) * size]
                    mb = micro_batch(rollout, index, self.device)
                    scale, options = self._share_scale(whole, index, tokens, step_options)
                    masks = None
                    if masked:  # the bonus is then the masks': this share's entropy over the global bonus tokens
                        shares = tuple(sum(tokens[i] for i in whole[r * size : (r + 1) * size]) for r in range(K))
                        sampled = None  # the sampler's logprobs
                        if rollout.sampling_logps is not None and config.off_policy_mask_threshold is not None:
                            sampled = torch.nn.utils.rnn.pad_sequence(
                                [rollout.sampling_logps[i] for i in index], batch_first=True).to(self.device)  # [b, T]
                        masks = TokenMasks(config.top_entropy_quantile, config.off_policy_mask_threshold,
                                           step_options.entropy_coef * K / scale if scale else 0.0,
                                           shares if K > 1 else (), sampled)
                        options = dataclasses.replace(options, entropy_coef=0.0)
                    last = j == len(step_batches) - 1
                    with nullcontext() if last or self.parallelism != "ddp" else self.train_module.no_sync():
                        loss, micro_metrics = self.train_module(
                            mb, options, num_items if token_normalised else None, masks)
                        entropy = micro_metrics.pop(BONUS_ENTROPY, None)
                        router = micro_metrics.pop(ROUTER_LOSS, None)  # an MoE's coef x load-balancing loss
                        policy = micro_metrics.pop("policy_loss", None)
                        if bonus:  # TRL's policy_loss: the loss before the bonus
                            if policy is None:
                                policy = loss + options.entropy_coef * micro_metrics["entropy"]
                            micro_metrics["policy_loss"] = policy * (scale / world.size)
                        if not token_normalised:
                            loss = loss / config.gradient_accumulation_steps
                        loss = loss * scale
                        if router is not None:  # TRL's: / accumulation steps, each process's own (DDP averages them)
                            loss = loss + router / config.gradient_accumulation_steps
                        loss.backward()
                    step_loss = step_loss + loss.detach() / world.size
                    for key, value in micro_metrics.items():
                        metrics[key].append(value.detach())
                    weights.append((sum(tokens[i] for i in index), len(index)))
                    if control is not None:
                        if entropy is None:  # the fused loss: the bonus tokens are the loss tokens
                            n = micro_metrics["entropy"].new_tensor(float(sum(tokens[i] for i in index)))
                            entropy = torch.stack([micro_metrics["entropy"] * n, n])
                        window.append(entropy.detach())
                max_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
                grad_norms.append(distributed.full_tensor(torch.nn.utils.clip_grad_norm_(self.parameters, max_norm)))
                check_step(self.step, step_loss, grad_norms[-1], world, self.model, self._last_checkpoint)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                losses.append(step_loss)
                if control is not None:
                    summed, count = map(sum, zip(*world.gather(torch.stack(window).sum(0).tolist()), strict=True))
                    control.update(summed / max(count, 1.0))
                if bonus:
                    coefficients.append(config.entropy_coef if control is None else control.coef)
        # One device sync (and with several processes one exchange) for all the metrics of the round.
        local = {"loss": torch.stack(losses).tolist(), "grad_norm": torch.stack(grad_norms).tolist(),
                 **{key: torch.stack(values).tolist() for key, values in metrics.items()}}
        merged = merge_metrics(world.gather((local, weights)), config.importance_sampling_level == "sequence")
        out = {key: nanmean(values) for key, values in merged.items()}
        if self.policy.routing is not None:  # (the engine's calls leave routes alone; nothing else should replay)
            self.policy.routing.stop()
        if coefficients:  # TRL's entropy_coef: the coefficient after each optimizer step (the same on every rank)
            out["entropy_coef"] = nanmean(coefficients)
        return out

    def _share_scale(self, whole: list[int], index: list[int], tokens: list[int],
                     options: LossConfig | None = None) -> tuple[float, LossConfig]:
        """(the factor on this rank's share of a global micro-batch, its loss options) such that the gradients,
        averaged over K ranks, are those of one process's loss on the whole micro-batch (the loss type's
        LossType.share_scale). The entropy bonus is a mean over the micro-batch's tokens: factor K * (share's
        tokens) / (micro-batch's tokens), folded into its coefficient where the loss's factor differs. `options`:
        the step's loss options (default the run's; use_adaptive_entropy changes the coefficient by step)."""
        K = self.world.size
        config = self.loss_options if options is None else options
        if K == 1:
            return 1.0, config
        share = K * sum(tokens[i] for i in index) / max(sum(tokens[i] for i in whole), 1)
        scale = config.kind.share_scale(K, share)
        if config.entropy_coef != 0.0 and scale != 0.0 and share != scale:
            config = dataclasses.replace(config, entropy_coef=config.entropy_coef * share / scale)
        return float(scale), config

    @torch.no_grad()
    def _logprobs(self, module: torch.nn.Module, rollout: Rollout) -> tuple[list[torch.Tensor], tuple[int, int]]:
        """Per sample [T_i] fp32 logprobs of its completion under `module` (a PolicyLoss; eval mode, no grad), and
        (routes where the model's own experts differ from the sampler's, routes compared) over every rank (MoE with
        the engine's routes; else (0, 0)). Chunks of per_device_train_batch_size samples are dealt to the ranks in
        turn, then gathered."""
        was_training = module.training
        routing = module.routing
        if routing is not None:
            routing.take_counts()  # (what earlier forwards counted is not this pass's)
        module.eval()
        size, K = self.config.per_device_train_batch_size, self.world.size
        starts = range(self.world.rank * size, len(rollout), size * K)
        out = {}
        for start in starts:
            mb = micro_batch(rollout, list(range(start, min(start + size, len(rollout)))), self.device)
            logps = module.logprobs(mb, temperature=self.config.temperature)  # [b, T]
            out |= {i: row[: len(rollout.completion_ids[i])].float().cpu() for row, i in zip(logps, mb.index,
                                                                                                 strict=True)}
        module.train(was_training)
        counts = (0, 0)
        if routing is not None:
            counts = routing.take_counts()
            routing.stop()
        parts = self.world.gather((out, counts))  # one process: its own
        for part, _ in parts:
            out |= part
        return [out[i] for i in range(len(rollout))], tuple(sum(c[k] for _, c in parts) for k in range(2))

    def _reference_logprobs(self, rollout: Rollout) -> list[torch.Tensor]:
        if self.reference is not None:
            return self._logprobs(self.reference, rollout)[0]
        with self.model.disable_adapter():  # LoRA: the base model is the reference
            return self._logprobs(self.policy, rollout)[0]


# Metrics of a micro-batch that are not a mean over its loss tokens: how the shares of a global micro-batch combine.
SUMMED = ("loss", "policy_loss")  # already scaled per share
SAME = ("grad_norm",)  # the same on every rank


def merge_metrics(parts: list[tuple[dict, list]], sequence_level: bool) -> dict[str, list[float]]:
    """Per rank (its metrics per micro-batch, (loss tokens, samples) per micro-batch) -> per global micro-batch the
    value one process would log for it: loss terms summed over shares, minima and maxima over shares, means over
    tokens (over samples for sequence-level ratios) weighted by the shares' counts. One rank: its own values."""
    if len(parts) == 1:
        return parts[0][0]
    merged = {}
    for key in parts[0][0]:
        columns = list(zip(*(values[key] for values, _ in parts), strict=True))  # per micro-batch, per rank
        if key in SAME:
            merged[key] = [column[0] for column in columns]
        elif key in SUMMED:
            merged[key] = [sum(column) for column in columns]
        elif key.endswith(("_min", "/min", "_max", "/max")):
            pick = min if key.endswith(("_min", "/min")) else max
            merged[key] = [pick((v for v in column if not math.isnan(v)), default=math.nan) for column in columns]
        else:
            k = 1 if sequence_level and key in RATIO_METRICS else 0
            counts = list(zip(*(weights for _, weights in parts), strict=True))  # per micro-batch, per rank
            merged[key] = [sum(v * w[k] for v, w in zip(column, count, strict=True) if w[k]) /
                           max(sum(w[k] for w in count), 1) for column, count in zip(columns, counts, strict=True)]
    return merged

