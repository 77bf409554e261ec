"""`FastGRPOTrainer`: TRL's `GRPOTrainer` with fastgrpo's per-token logprobs and fused GRPO loss.

    from fastgrpo.integrations.trl import FastGRPOTrainer as GRPOTrainer   # the one-line change

Same constructor, config, generation, rewards, advantages, batching and logging as `trl.GRPOTrainer` (trl 1.16.x);
two of TRL's methods are replaced:

  _get_per_token_logps_and_entropies   old and reference logprobs: `fastgrpo.loss.token_logprobs`
  _compute_loss                        the loss: `fastgrpo.loss.fused_grpo_loss` (or `token_logprobs` + `grpo_loss`
                                       when a token mask needs the logprobs first: top_entropy_quantile < 1,
                                       off_policy_mask_threshold), then TRL's gradient-accumulation scaling, entropy
                                       bonus (static or adaptive: TRL's controller and its state) and metrics

Both read the final-norm hidden states (the backbone's last_hidden_state, taken by a forward hook) from the (wrapped)
model's own forward with `logits_to_keep` an empty index, so the model produces no logits, and go through the lm_head
weight without ever forming the [B, T, V] logits. The head runs in the weight's dtype with autocast off (as TRL's
does with cast_lm_head_to_fp32; without it TRL's head runs under the trainer's autocast, e.g. in bf16 for fp32
weights with bf16=True, where fastgrpo's fp32 head is the more precise of the two).

FSDP2 (GRPOConfig fsdp=True, fsdp_config={"version": 2, ...}: torch's `fully_shard`): the lm_head weight is read right
after the model's forward, where FSDP2 has all-gathered it whole, and used in place: no second whole copy is made.
accelerate shards the policy's final norm and lm_head (with the input embeddings when tied) as one group that does
not reshard after its forward, so the weight is then a plain tensor, and its gradient accumulates there like the
lm_head's own, for FSDP to reduce-scatter at the end of backward. TRL's reference model is one group that reshards
after its forward: for those no-grad logprobs the sharded weight is gathered, the only whole copy while it lasts. An
lm_head that FSDP2 reshards after its forward in the policy is refused when the loss reads it (a gathered copy's
gradient would bypass FSDP's reduce-scatter), as are FSDP1 and DeepSpeed ZeRO-3, where the weight is whole only
inside the lm_head's own forward.

Exact equivalent: `trl.GRPOTrainer._compute_loss` (tested in fp32 to 1e-5, tests/test_trl_trainer.py; FSDP2 and DDP on
two processes too). Options fastgrpo cannot reproduce exactly raise a `ValueError` naming the option when the trainer
is built (`REFUSALS`).
"""

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.distributed.tensor import DTensor

from fastgrpo.loss import LOGIT_TRANSFORMS, fused_grpo_loss, grpo_loss, head_transform, token_logprobs
from fastgrpo.loss_config import LOSS_TYPES, TOKEN_NORMALISED_LOSS_TYPES, LossConfig
from fastgrpo.models import find_hf_model

# trl versions whose GRPOTrainer internals this module was written against and tested with (1.16.0).
SUPPORTED_TRL = ">=1.16.0,<1.17"


def check_trl_version(version: str) -> None:
    """ImportError unless `version` (trl's) is supported: the overridden methods are TRL internals."""
    if Version(version) not in SpecifierSet(SUPPORTED_TRL):
        raise ImportError(
            f"fastgrpo.integrations.trl supports trl {SUPPORTED_TRL} (tested with 1.16.0), but trl {version} is "
            f"installed. Install a supported version: pip install 'trl{SUPPORTED_TRL}'"
        )


try:
    import trl
except ImportError as error:
    raise ImportError(f"fastgrpo.integrations.trl needs trl: pip install 'trl{SUPPORTED_TRL}'") from error
check_trl_version(trl.__version__)

from accelerate.utils import is_peft_model  # noqa: E402
from transformers import ProcessorMixin  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanmax, nanmin  # noqa: E402

__all__ = ["FastGRPOTrainer", "REFUSALS", "SUPPORTED_TRL", "check_trl_version"]


def _sharded_head(args=None, *_, trainer=None):
    if trainer is not None:
        fsdp_version = trainer.accelerator.state.fsdp_plugin.fsdp_version if trainer.is_fsdp_enabled else None
        zero3 = trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    else:
        fsdp_version = args.fsdp_plugin_args["fsdp_version"] if args.fsdp_plugin_args else None
        zero3 = args.deepspeed_plugin is not None and args.deepspeed_plugin.zero_stage == 3
    return "fsdp_version=1 (FSDP1)" if fsdp_version == 1 else "DeepSpeed ZeRO-3" if zero3 else None


def _prompt_learning(args=None, peft_config=None, processing_class=None, *, trainer=None):
    if trainer is None:
        configs = [] if peft_config is None else [peft_config]
    else:
        model = trainer.accelerator.unwrap_model(trainer.model)
        configs = list(model.peft_config.values()) if is_peft_model(model) else []
    learning = [type(c).__name__ for c in configs if c.is_prompt_learning]
    return f"PEFT prompt learning ({', '.join(learning)})" if learning else None


def _vision(args=None, peft_config=None, processing_class=None, *, trainer=None):
    vlm = trainer._is_vlm if trainer is not None else isinstance(processing_class, ProcessorMixin)
    return "vision-language models (a ProcessorMixin processing_class)" if vlm else None


def _logit_transform(*_, trainer):
    try:
        head_transform(trainer.accelerator.unwrap_model(trainer.model).config)
    except ValueError as error:
        return str(error).split(":")[0]
    return None


def _untied_last_hidden_state(*_, trainer):
    text_config = trainer.accelerator.unwrap_model(trainer.model).config.get_text_config()
    return "tie_last_hidden_states=False" if getattr(text_config, "tie_last_hidden_states", True) is False else None


@dataclass(frozen=True)
class Refusal:
    """An option fastgrpo cannot reproduce exactly. `found` returns the offending setting (or None) from the
    constructor's arguments `(args, peft_config, processing_class)`, before TRL builds anything, or from the built
    `trainer=`; `stages` says which of the two it reads ("args", "trainer")."""

    reason: str
    found: Callable[..., str | None]
    stages: tuple[str, ...]


# What FastGRPOTrainer refuses, and why: read by the checks below and by the tests.
REFUSALS = {
    "fsdp1_zero3": Refusal("there the lm_head weight is whole only inside the lm_head's own forward (FSDP1's flat "
                           "parameters, ZeRO-3's partitions); use FSDP2: fsdp_config={'version': 2}", _sharded_head,
                           ("args", "trainer")),
    "peft_prompt_learning": Refusal("virtual tokens change the hidden-state positions", _prompt_learning,
                                    ("args", "trainer")),
    "vision_language": Refusal("multimodal inputs are not forwarded", _vision, ("args", "trainer")),
    "router_aux_loss_coef": Refusal(
        "the MoE load-balancing loss is not added; set router_aux_loss_coef=0.0",
        lambda *_, trainer: f"router_aux_loss_coef={trainer.router_aux_loss_coef}" if trainer.aux_loss_enabled
        else None, ("trainer",)),
    "logit_transform": Refusal(
        "fastgrpo's head applies logit_scale, logits_scaling and final_logit_softcapping only (of "
        + ", ".join(LOGIT_TRANSFORMS) + ")", _logit_transform, ("trainer",)),
    "tie_last_hidden_states": Refusal("hidden_states[-1] would not be the final-norm output",
                                      _untied_last_hidden_state, ("trainer",)),
}  # fmt: skip


def _refuse(stage: str, *args, **trainer) -> None:
    """ValueError naming the first refused setting that `stage` ("args" or "trainer") can see."""
    for refusal in REFUSALS.values():
        found = refusal.found(*args, **trainer) if stage in refusal.stages else None
        if found is not None:
            raise ValueError(f"FastGRPOTrainer does not support {found}: {refusal.reason}")


# TRL's per-sequence clip extremes: gathered across processes, then nan-reduced (the others are token means).
_EXTREMES = {"clip_ratio/low_min": nanmin, "clip_ratio/high_max": nanmax}


def _loss_options(args) -> LossConfig:
    """TRL's GRPOConfig as fastgrpo's LossConfig."""
    if args.loss_type not in LOSS_TYPES:
        raise ValueError(f"FastGRPOTrainer does not support loss_type={args.loss_type!r}: supported are "
                         f"{tuple(LOSS_TYPES)}")
    if args.max_completion_length is None and args.loss_type == "dr_grpo":
        raise ValueError("FastGRPOTrainer: loss_type='dr_grpo' needs max_completion_length (its normaliser), got None")
    try:
        return LossConfig.from_trl(args)
    except (TypeError, ValueError) as error:
        raise ValueError(f"FastGRPOTrainer cannot use this GRPOConfig: {error}") from error


class FastGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` (same arguments) computing logprobs and the loss with fastgrpo, from hidden states."""

    def __init__(self, *args, **kwargs):
        given = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        if given.get("args") is not None:  # before TRL loads models or starts vLLM (TRL's default args pass)
            _refuse("args", given["args"], given.get("peft_config"), given.get("processing_class"))
            _loss_options(given["args"])
        super().__init__(*args, **kwargs)
        _refuse("trainer", trainer=self)
        self.head = head_transform(self.accelerator.unwrap_model(self.model).config)  # logit_scale, logit_softcap
        self.loss_options = dataclasses.replace(_loss_options(self.args), **self.head)

    # -- hidden states and logprobs ----------------------------------------------------------------------------------

    def _lm_head(self, model):
        """(weight [V, H], bias [V] or None) of the lm_head, whole; PEFT leaves it untouched (TRL rejects adapters on
        it). Read right after `model`'s forward: under FSDP2 the lm_head's group is then still unsharded, if it does
        not reshard after forward; if it does, the weight is gathered for a no-grad forward and refused for the loss.
        """
        model = self.accelerator.unwrap_model(model)
        if is_peft_model(model):
            model = model.get_base_model()
        head = model.get_output_embeddings()
        if not isinstance(head.weight, DTensor):
            return head.weight, head.bias
        if torch.is_grad_enabled():
            # A gathered copy's gradient would bypass FSDP's reduce-scatter of the lm_head's group.
            raise ValueError(
                "FastGRPOTrainer does not support an lm_head that FSDP2 reshards after its forward (its weight is a "
                "sharded DTensor when the loss reads it: an FSDP group of its own with reshard_after_forward=True, "
                "e.g. from fully_shard(model.lm_head)): let accelerate shard the model (fsdp_config={'version': 2, "
                "'auto_wrap_policy': 'TRANSFORMER_BASED_WRAP', 'transformer_layer_cls_to_wrap': [the decoder layer "
                "class]} groups the lm_head with the final norm, whole after the forward), or shard the lm_head with "
                "reshard_after_forward=False"
            )
        # TRL's reference model: one group that reshards after forward. The gathered weight is the only whole copy.
        return head.weight.full_tensor(), None if head.bias is None else head.bias.full_tensor()

    def _completion_hidden_states(self, model, input_ids, attention_mask, num_completion):
        """Final-norm hidden states [B, T, H] that predict the last T = num_completion tokens of input_ids [B, S].

        Calls the model itself (DDP / PEFT wrappers included); `logits_to_keep` = no position, so no logits are made.
        """
        no_positions = torch.empty(0, dtype=torch.long, device=input_ids.device)
        # The backbone's last_hidden_state, from a hook: output_hidden_states=[-1] selects it only in transformers
        # >= 5.23 (5.17-5.22 read a list as layer indices without negatives and return None for -1; older ones keep
        # every layer's output).
        net = find_hf_model(model)
        captured = []
        hook = getattr(net, net.base_model_prefix).register_forward_hook(lambda m, a, out: captured.append(out[0]))
        try:
            with self.accelerator.autocast():
                model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                      logits_to_keep=no_positions)
        finally:
            hook.remove()
        return captured[-1][:, -num_completion - 1 : -1]  # position t predicts token t + 1

    def _token_logprobs(self, hidden, weight, bias, token_ids, valid):
        """logps, entropies [B, T] fp32 of token_ids [B, T] where valid [B, T]; 0 elsewhere, as TRL's fused head.

        Only the valid tokens are scored: hidden[valid] is [N, H].
        """
        with torch.autocast(hidden.device.type, enabled=False):
            logp, entropy = token_logprobs(hidden[valid].to(weight.dtype), weight, token_ids[valid], bias=bias,
                                           temperature=self.temperature, return_entropy=True, **self.head)  # [N]
        zeros = logp.new_zeros(valid.shape)
        return zeros.masked_scatter(valid, logp), zeros.masked_scatter(valid, entropy)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's old / reference logprobs (and entropies), in chunks of batch_size rows: ([B, T], [B, T] | None, None).

        `multimodal` (pixel_values, ...) and `compute_aux_loss` are always None / False: excluded at construction.
        """
        assert not compute_aux_loss and all(v is None for v in multimodal.values()), "excluded at construction"
        T = logits_to_keep
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            hidden = self._completion_hidden_states(model, input_ids[rows], attention_mask[rows], T)  # [b, T, H]
            weight, bias = self._lm_head(model)  # after the forward: FSDP2 may have swapped the parameter
            logp, entropy = self._token_logprobs(hidden, weight, bias, input_ids[rows, -T:],
                                                 attention_mask[rows, -T:] != 0)
            logps.append(logp)
            entropies.append(entropy)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    # -- the loss ------------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        """TRL's `_compute_loss` (trl 1.16): the same loss, gradient and logged metrics, from fastgrpo's loss."""
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]  # [B, T]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]  # [B, T]
        hidden = self._completion_hidden_states(
            model, torch.cat([inputs["prompt_ids"], completion_ids], 1),
            torch.cat([inputs["prompt_mask"], completion_mask], 1), completion_ids.size(1),
        )  # [B, T, H]
        weight, bias = self._lm_head(model)
        advantages = inputs["advantages"]  # [B] (or [B, T] from subclasses)
        old_logps = inputs.get("old_per_token_logps")  # [B, T] or None: on-policy
        scale, accumulation = self._loss_scale(mode), self.current_gradient_accumulation_steps if mode == "train" else 1
        # TRL's entropy bonus is a mean over the tokens divided by the accumulation steps only, never by the loss
        # type's normaliser: after `loss * scale` below it must be the coefficient / accumulation. With
        # use_adaptive_entropy the coefficient is TRL's controller's (self.entropy_coef, which TRL's checkpoints keep),
        # applied while the last optimizer step's entropy was at or below entropy_target.
        applied = self.entropy_coef
        if self.use_adaptive_entropy and not self._last_world_entropy <= self.args.entropy_target:
            applied = 0.0
        bonus = applied / (accumulation * scale)
        config = dataclasses.replace(self.loss_options, entropy_coef=bonus)
        correct = self.use_vllm and self.vllm_importance_sampling_correction  # the sampler's truncated IS ratio
        loss_inputs = dict(
            old_logps=old_logps, ref_logps=inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
            config=config, importance_weights=inputs["importance_sampling_ratio"] if correct else None,
            # dapo / cispo divide by the generation batch's token count; _loss_scale rescales it as TRL does
            num_items_in_batch=inputs["num_items_in_batch"] if self.loss_type in TOKEN_NORMALISED_LOSS_TYPES else None,
        )
        if self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None:
            # TRL multiplies the policy term (not the KL) by 0/1 token masks that need the logprobs first. Every loss
            # type's policy term is linear in the advantage given its sign, so zeroing the advantage is the same.
            logps, entropies = self._token_logprobs(hidden, weight, bias, completion_ids, mask != 0)  # [B, T]
            keep, bonus_mask = torch.ones_like(mask), mask  # [B, T]; bonus_mask: TRL's effective_mask
            if self.top_entropy_quantile < 1.0:
                keep = self.get_high_entropy_mask(entropies.detach(), mask, 1 - self.top_entropy_quantile)
                bonus_mask = mask * keep
            per_row = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # [B, 1] or [B, T]
            if self.off_policy_mask_threshold is not None:
                sampling = inputs.get("sampling_per_token_logps", logps.detach() if old_logps is None else old_logps)
                keep = keep * self.get_off_policy_mask(per_row, logps, sampling, mask, self.off_policy_mask_threshold)
            loss_inputs["config"] = dataclasses.replace(config, entropy_coef=0.0)  # the bonus is below
            loss, _ = grpo_loss(logps, mask, per_row * keep, **loss_inputs)
            with torch.no_grad():  # TRL's clip metrics read the unmasked advantages
                _, metrics = grpo_loss(logps.detach(), mask, advantages, entropies=entropies.detach(), **loss_inputs)
            bonus_entropy = (entropies * bonus_mask).sum() / bonus_mask.sum().clamp(min=1.0)
            if bonus != 0.0:
                loss = loss - bonus * bonus_entropy
            window = torch.stack([(entropies.detach() * bonus_mask).sum(), bonus_mask.sum().float()])
            bonus_entropy = bonus_entropy.detach()
        else:
            with torch.autocast(hidden.device.type, enabled=False):
                loss, metrics = fused_grpo_loss(hidden.to(weight.dtype), weight, completion_ids, mask, advantages,
                                                bias=bias, **loss_inputs)
            bonus_entropy, tokens = metrics["entropy"], mask.sum().float()
            window = torch.stack([bonus_entropy * tokens, tokens])
        self._log_loss_metrics(metrics, mask, advantages, mode)
        if self._entropy_bonus_enabled:  # TRL's policy_loss: the policy term as its normaliser leaves it
            policy = (loss.detach() + bonus * bonus_entropy) * scale
            if self.loss_type not in TOKEN_NORMALISED_LOSS_TYPES:
                policy = policy * accumulation
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy.reshape(1)).nanmean().item())
            if self.use_adaptive_entropy and mode == "train":
                self._adapt_entropy_coef(window)
            if mode == "train" and self.accelerator.sync_gradients:  # logged per optimizer step, as TRL
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss * scale

    def _adapt_entropy_coef(self, window):
        """TRL's adaptive entropy control: `window` [entropy sum, count] of a micro-batch's bonus tokens, summed over
        the accumulation window; at its last micro-batch, summed over the processes, the window's mean entropy moves
        the coefficient by entropy_coef_delta, up if at or below entropy_target, else down, within
        [entropy_coef_min, entropy_coef_max]."""
        stats = self._entropy_window_stats
        self._entropy_window_stats = window if stats is None else stats + window
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        args = self.args
        if entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy, self._entropy_window_stats = entropy, None

    def _loss_scale(self, mode):
        """What turns fastgrpo's loss into TRL's: TRL divides by the accumulation steps in training, and for dapo /
        cispo by num_items_in_batch / num_processes * accumulation steps / steps_per_generation instead of by
        num_items_in_batch (eval: / num_processes)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.loss_type in TOKEN_NORMALISED_LOSS_TYPES:
            per_generation = self.args.steps_per_generation if mode == "train" else 1
            return self.accelerator.num_processes * per_generation / accumulation
        return 1.0 / accumulation

    def _log_loss_metrics(self, metrics, mask, advantages, mode):
        """Append fastgrpo's local metrics to TRL's `_metrics` as TRL reduces them across processes: means as
        (sum, count) totals, per-sequence clip extremes gathered and nan-reduced."""
        B, T = mask.shape
        tokens = mask.sum().float()
        # TRL averages over sequences (count B) a value with one column: any when T == 1, the clip indicators when
        # both the ratio and the advantage are one per sequence.
        clip_per_sequence = self.importance_sampling_level == "sequence" and advantages.dim() == 1
        for name, value in metrics.items():
            if name in _EXTREMES:
                gathered = self.accelerator.gather(value.reshape(1).float())
                self._metrics[mode][name].append(_EXTREMES[name](gathered).item())
                continue
            per_sequence = T == 1 or (clip_per_sequence and name not in ("kl", "entropy")) or (
                name == "vespo/phi_seq_mean" and advantages.dim() == 1)  # one value per sequence
            count = torch.tensor(float(B), device=mask.device) if per_sequence else tokens
            totals = self.accelerator.reduce(torch.stack([value.float() * count, count]), reduction="sum")
            self._metrics[mode][name].append((totals[0] / totals[1].clamp(min=1.0)).item())
