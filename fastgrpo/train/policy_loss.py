"""The policy's training forward: the backbone to the hidden states of completion tokens, then the fused GRPO loss
(`PolicyLoss.forward`) or, without gradient, the completion tokens' logprobs (`PolicyLoss.logprobs`).

TRL 1.16's loss-side options that `fastgrpo train` shares with `GRPOConfig`:
  top_entropy_quantile       the policy term only on the tokens of highest entropy (`entropy_threshold`)
  off_policy_mask_threshold  drop negative-advantage sequences that drifted off-policy (`off_policy_mask`)
  use_adaptive_entropy       the entropy bonus's coefficient steered towards entropy_target (`EntropyControl`)
The two masks need the logprobs before the loss: with either on, `PolicyLoss.loss` scores the tokens first
(`token_logprobs`: logprobs and entropies, without [B, T, V] logits), then takes `masked_grpo_loss` of them.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch

from fastgrpo.loss import fused_grpo_loss, grpo_loss, token_logprobs
from fastgrpo.loss_config import LossConfig
from fastgrpo.models import find_hf_model
from fastgrpo.routing import routing_of
from fastgrpo.train.moe import load_balancing_loss

# The metric `masked_grpo_loss` adds for the trainer, which pops it: [summed entropy, count] over the share's bonus
# tokens (the adaptive controller's window).
BONUS_ENTROPY = "bonus_entropy"
# An MoE's router load-balancing loss of a micro-batch (TRL's metric), and the term the trainer pops and adds to the
# loss: router_aux_loss_coef times it.
AUX_LOSS = "aux_loss"
ROUTER_LOSS = "router_loss"


def completion_hidden(model: torch.nn.Module, sequences: list[list[int]], prompt_lengths: list[int],
                      max_completion: int, packed: bool) -> torch.Tensor:
    """Last hidden states that predict each completion token: [B, max_completion, H] (rows past a completion's end
    hold a copy of some other state; mask them).

    sequences[i] = prompt_i + completion_i. Packed: one row, positions restarting per sequence (flash-attn varlen,
    or transformers' block-diagonal mask elsewhere). Padded: right-padded to the longest sequence.
    """
    output, starts, _ = backbone_forward(model, sequences, packed)
    return completion_rows(output.last_hidden_state, starts, sequences, prompt_lengths, max_completion)


def backbone_forward(model: torch.nn.Module, sequences: list[list[int]], packed: bool, **kwargs):
    """(the backbone's output on `sequences` packed in one row or right-padded, as completion_hidden runs it; the flat
    index of each sequence's first token [B]; the real tokens of the flattened rows [rows] bool, None when packed).
    `kwargs` go to the backbone (output_router_logits=True)."""
    net = find_hf_model(model)
    backbone = getattr(net, net.base_model_prefix)
    device = net.get_input_embeddings().weight.device
    lengths = [len(s) for s in sequences]
    if packed:
        input_ids = torch.tensor([t for s in sequences for t in s])[None]  # [1, sum L]
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, sum L]
        output = backbone(input_ids=input_ids.to(device), position_ids=position_ids.to(device), use_cache=False,
                          **kwargs)
        return output, torch.tensor([0, *lengths[:-1]]).cumsum(0), None  # [B]
    L = max(lengths)
    input_ids = torch.zeros(len(sequences), L, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros(len(sequences), L, dtype=torch.long)  # [B, L]
    for i, s in enumerate(sequences):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
    attention_mask = attention_mask.to(device)
    output = backbone(input_ids=input_ids.to(device), attention_mask=attention_mask, use_cache=False, **kwargs)
    return output, torch.arange(len(sequences)) * L, attention_mask.view(-1) != 0  # [B], [B * L]


def completion_rows(hidden: torch.Tensor, starts: torch.Tensor, sequences: list[list[int]], prompt_lengths: list[int],
                    max_completion: int) -> torch.Tensor:
    """The rows of `hidden` [1 or B, L, H] (backbone_forward's, sequence i from flat row starts[i]) that predict each
    completion token: [B, max_completion, H]."""
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [tokens, H]
    offsets = torch.arange(max_completion)  # [T]
    last = torch.tensor([len(s) for s in sequences]) - 1  # [B] the final token predicts nothing
    rows = starts[:, None] + torch.minimum(torch.tensor(prompt_lengths)[:, None] - 1 + offsets, last[:, None] - 1)
    return hidden[rows.to(hidden.device)]  # [B, T, H]


def aligned_routes(routes: list[torch.Tensor], sequences: list[list[int]], packed: bool, unrouted: int
                   ) -> torch.Tensor:
    """Per sequence routes [L_i, layers, k] -> [tokens, layers, k] in backbone_forward's order (one packed row, or
    right-padded rows with `unrouted` padding)."""
    for route, sequence in zip(routes, sequences, strict=True):
        assert len(route) == len(sequence), (len(route), len(sequence))
    if packed:
        return torch.cat(routes)
    L = max(map(len, sequences))
    out = routes[0].new_full((len(routes), L, *routes[0].shape[1:]), unrouted)  # [B, L, layers, k]
    for row, route in zip(out, routes, strict=True):
        row[: len(route)] = route
    return out.flatten(0, 1)


def lm_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    head = find_hf_model(model).get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


# -- TRL's token masks and adaptive entropy control --------------------------------------------------------------


def check_options(config) -> None:
    """ValueError naming the first out-of-range option among TRL's masks and adaptive entropy control (a TrainConfig's
    or a GRPOConfig's fields). TRL checks none of them; a quantile outside [0, 1] fails in its first loss."""
    if not 0.0 <= config.top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {config.top_entropy_quantile!r}")
    threshold = config.off_policy_mask_threshold
    if threshold is not None and not threshold >= 0:
        raise ValueError(f"off_policy_mask_threshold must be None or >= 0 (a mean KL in nats), got {threshold!r}")
    for name in ("entropy_coef_delta", "entropy_target"):
        if not getattr(config, name) >= 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(config, name)!r}")
    if not config.entropy_coef_min <= config.entropy_coef_max:
        raise ValueError(f"entropy_coef_min ({config.entropy_coef_min}) must be <= entropy_coef_max "
                         f"({config.entropy_coef_max})")


def entropy_threshold(pool: torch.Tensor, quantile: float) -> torch.Tensor:
    """The entropy a token needs to keep its policy term (TRL's get_high_entropy_mask): the `quantile` quantile of the
    entropies `pool` [n], ranked in fp32 with torch's linear interpolation; +inf for an empty pool (no token kept)."""
    if pool.numel() == 0:
        return pool.new_tensor(math.inf, dtype=torch.float32)
    return torch.quantile(pool.float(), quantile)


def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """TRL's get_off_policy_mask (DeepSeek-V3.2's off-policy sequence masking): 1 keeps a sequence, 0 drops it.

    advantages [B, 1] or [B, T]; logps, sampling_logps (what the sequence was sampled with), mask [B, T] -> [B, 1]
    (or [B, T]) in logps' dtype. Dropped: advantage < 0 and the mean over the mask of sampling_logps - logps, the
    sequence's KL(sampling || current), above `threshold`. A token without a sampling logprob (NaN) counts 0."""
    mask = mask.to(logps.dtype)
    kl = torch.where(mask != 0, torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0), 0.0)  # [B, T]
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)  # [B, 1]
    return ((advantages >= 0) | (mean_kl <= threshold)).to(logps.dtype)


@dataclass(frozen=True)
class TokenMasks:
    """TRL 1.16's 0/1 masks on the policy term, for one rank's share of a global micro-batch (the K shares of K ranks
    make the micro-batch one process would train on; one process: its micro-batch), and the entropy bonus with them.

    top_entropy_quantile       keep the policy term on the loss tokens whose entropy is at least the
                               (1 - top_entropy_quantile) quantile of the global micro-batch's loss tokens' entropies
                               (TRL's get_high_entropy_mask, which gathers TRL's processes' micro-batches); 1.0: all
    off_policy_mask_threshold  drop the sequences that `off_policy_mask` drops; None: off
    entropy_coef               the bonus: minus entropy_coef x the share's summed entropy over its bonus tokens / the
                               global micro-batch's bonus tokens, where the bonus tokens are the loss tokens the entropy
                               mask keeps (TRL's effective_mask); 0: none
    share_tokens               the loss tokens of each rank's share, in rank order (every rank knows them from the
                               rollout); (): one process
    sampling_logps             [b, T] the logprobs the sequences were sampled with, for the off-policy KL; None: the
                               old logprobs, or on-policy the current ones (TRL's rule without vLLM's logprobs)
    """

    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0
    share_tokens: tuple[int, ...] = ()
    sampling_logps: torch.Tensor | None = None


def _all_shares(local: torch.Tensor, share_tokens: tuple[int, ...]) -> torch.Tensor:
    """Every rank's values [sum(share_tokens)] from this rank's [share_tokens[rank]]: one all_gather, each rank's
    padded to the largest share. () or one share: `local`."""
    if len(share_tokens) <= 1:
        return local
    assert local.numel() == share_tokens[torch.distributed.get_rank()], (local.numel(), share_tokens)
    padded = local.new_zeros(max(*share_tokens, 1))
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in share_tokens]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, share_tokens, strict=True)])


def masked_grpo_loss(logps: torch.Tensor, entropies: torch.Tensor, completion_mask: torch.Tensor,
                     advantages: torch.Tensor, *, masks: TokenMasks, config: LossConfig, old_logps=None, ref_logps=None,
                     num_items_in_batch=None, importance_weights=None) -> tuple[torch.Tensor, dict]:
    """TRL 1.16's GRPO loss with its token masks, from the tokens' logprobs and entropies [B, T] (differentiable; 0 off
    the mask), the rest as `fastgrpo.loss.grpo_loss` takes them (config.entropy_coef is not read: the bonus is
    masks.entropy_coef's). Returns (loss, metrics).

    The masks multiply the policy term, not the KL. Every loss type's policy term is a function of the advantage that
    is 0 where the advantage is, so the masks zero the advantages of the tokens they drop. The metrics are grpo_loss's
    for the unmasked advantages, as TRL logs them, plus `policy_loss` (the loss before the bonus) and BONUS_ENTROPY.
    Exact equivalent: TRL's `_compute_loss` on its per_token_logps and entropies."""
    valid = completion_mask != 0  # [B, T]
    mask = completion_mask.to(logps.dtype)
    per_row = advantages if advantages.dim() == 2 else advantages[:, None]  # [B, 1] or [B, T]
    detached = entropies.detach()
    keep = torch.ones_like(mask)  # [B, T]
    bonus_tokens = mask  # [B, T]: what the bonus and the adaptive controller average over (TRL's effective_mask)
    bonus_count = mask.new_tensor(float(sum(masks.share_tokens))) if masks.share_tokens else mask.sum()  # global
    if masks.top_entropy_quantile < 1.0:
        pool = _all_shares(detached[valid], masks.share_tokens)  # [n]: the global micro-batch's loss tokens
        threshold = entropy_threshold(pool, 1.0 - masks.top_entropy_quantile)
        keep = ((detached >= threshold) & valid).to(mask.dtype)
        bonus_tokens, bonus_count = mask * keep, (pool >= threshold).sum().to(mask.dtype)
    if masks.off_policy_mask_threshold is not None:
        sampling = next(t for t in (masks.sampling_logps, old_logps, logps.detach()) if t is not None)
        keep = keep * off_policy_mask(per_row, logps, sampling, mask, masks.off_policy_mask_threshold)
    inputs = dict(old_logps=old_logps, ref_logps=ref_logps, config=dataclasses.replace(config, entropy_coef=0.0),
                  num_items_in_batch=num_items_in_batch, importance_weights=importance_weights)
    policy, _ = grpo_loss(logps, completion_mask, per_row * keep, **inputs)
    with torch.no_grad():  # TRL's metrics read the unmasked advantages
        _, metrics = grpo_loss(logps.detach(), completion_mask, advantages, entropies=detached, **inputs)
    loss = policy
    if masks.entropy_coef != 0.0:
        loss = policy - masks.entropy_coef * (entropies * bonus_tokens).sum() / bonus_count.clamp(min=1.0)
    metrics["policy_loss"] = policy.detach()
    metrics[BONUS_ENTROPY] = torch.stack([(detached * bonus_tokens).sum(), bonus_tokens.sum()])
    return loss, metrics


@dataclass(slots=True)
class EntropyControl:
    """TRL 1.16's adaptive entropy control (use_adaptive_entropy, from Skywork-OR1): the entropy bonus's coefficient,
    steered once per optimizer step towards entropy_target.

    Every micro-batch of an optimizer step applies `applied()`: `coef` if the previous step's entropy was at or below
    the target, else 0 (0 before the first step). After the step, `update(entropy)` takes the step's mean entropy over
    its bonus tokens (all its micro-batches on all processes; with top_entropy_quantile < 1 the kept tokens only) and
    moves `coef` by delta, up if that entropy is at or below the target, else down, within [coef_min, coef_max].
    `coef` starts at entropy_coef; `state_dict` is what a checkpoint keeps."""

    coef: float
    target: float
    coef_min: float
    coef_max: float
    delta: float
    last_entropy: float = math.inf  # the previous optimizer step's

    @classmethod
    def of(cls, config) -> "EntropyControl":
        """From the options of a TrainConfig (or a GRPOConfig)."""
        return cls(config.entropy_coef, config.entropy_target, config.entropy_coef_min, config.entropy_coef_max,
                   config.entropy_coef_delta)

    def applied(self) -> float:
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        """JSON-ready: last_entropy None before the first step."""
        return {"entropy_coef": self.coef, "last_entropy": None if self.last_entropy == math.inf else self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["entropy_coef"]
        self.last_entropy = math.inf if state["last_entropy"] is None else state["last_entropy"]


# -- the policy's forward -------------------------------------------------------------------------------------------


class PolicyLoss(torch.nn.Module):
    """One micro-batch through the model: the backbone, then the lm_head's fused GRPO loss (`forward`, the pass DDP
    and FSDP2 wrap) or, without gradient, the completion tokens' logprobs (`logprobs`). Under FSDP2 this module is the
    root: the embeddings, final norm and lm_head (tied or not) are whole inside both, so the fused head reads the full
    weight and FSDP reduce-scatters its gradient like any other; under DDP it is the module DDP wraps."""

    def __init__(self, model: torch.nn.Module, packed: bool, head: dict, router_aux_loss_coef: float = 0.0,
                 routing_replay: bool = False):
        super().__init__()
        self.model = model
        self.packed = packed
        self.head = head  # the model's logit transform {logit_scale, logit_softcap} (check_head)
        # An MoE's router load-balancing loss (moe.router_aux_loss_coef): forward returns it weighted, as ROUTER_LOSS
        self.router_aux_loss_coef = router_aux_loss_coef
        # An MoE's routers (fastgrpo/routing.py): a micro-batch with the engine's routes replays them (routing_replay)
        # or is compared with them; the routes stay set through the backward (a checkpointed layer's recompute)
        self.routing = routing_of(model)
        self.routing_replay = routing_replay

    def route(self, mb) -> None:
        """The routes of `mb`'s tokens for the forwards that follow, in backbone_forward's token order."""
        if self.routing is None:
            return
        if mb.routes is None:
            self.routing.stop()
            return
        device = find_hf_model(self.model).get_input_embeddings().weight.device
        routes = aligned_routes(mb.routes, mb.sequences, self.packed, self.routing.sentinel)
        self.routing.replay(routes.to(device, non_blocking=True), force=self.routing_replay)

    def hidden(self, mb) -> torch.Tensor:
        """The backbone's last hidden states that predict micro-batch `mb`'s completion tokens: [b, T, H]."""
        self.route(mb)
        return completion_hidden(self.model, mb.sequences, mb.prompt_lengths, mb.mask.shape[1], self.packed)

    def loss(self, hidden: torch.Tensor, mb, config: LossConfig, num_items_in_batch: float | None = None,
             masks: TokenMasks | None = None):
        """The GRPO loss of micro-batch `mb` from its `hidden` states (and its metrics): fused, its gradient computed
        on the way; or, with TRL's token `masks`, `masked_grpo_loss` of the tokens' logprobs and entropies, scored
        first (differentiable: 4 GEMMs per chunk in all, against the fused path's 3)."""
        weight, bias = lm_head(self.model)
        if masks is None:
            return fused_grpo_loss(hidden, weight, mb.completion_ids, mb.mask, mb.advantages, bias=bias,
                                   old_logps=mb.old_logps, ref_logps=mb.ref_logps, config=config,
                                   importance_weights=mb.importance_weights, num_items_in_batch=num_items_in_batch)
        valid = mb.mask != 0  # [b, T]
        logp, entropy = token_logprobs(hidden[valid], weight, mb.completion_ids[valid], bias=bias,
                                       temperature=config.temperature, return_entropy=True,
                                       logit_scale=config.logit_scale, logit_softcap=config.logit_softcap)  # [N]
        zeros = logp.new_zeros(valid.shape)  # [b, T]
        return masked_grpo_loss(zeros.masked_scatter(valid, logp), zeros.masked_scatter(valid, entropy), mb.mask,
                                mb.advantages, masks=masks, config=config, old_logps=mb.old_logps,
                                ref_logps=mb.ref_logps, num_items_in_batch=num_items_in_batch,
                                importance_weights=mb.importance_weights)

    def forward(self, mb, config: LossConfig, num_items_in_batch: float | None = None,
                masks: TokenMasks | None = None):
        """`loss(hidden(mb), ...)`: the pass DDP and FSDP2 wrap (a memory trace counts its two parts apart). With
        router_aux_loss_coef, the metrics also hold the micro-batch's load-balancing loss over its real tokens
        (prompts and completions, as TRL's forward counts them): AUX_LOSS, and ROUTER_LOSS = the coefficient times
        it, differentiable, which the trainer adds to the loss (TRL adds it outside the loss type's normalisation)."""
        if not self.router_aux_loss_coef:
            return self.loss(self.hidden(mb), mb, config, num_items_in_batch, masks)
        net = find_hf_model(self.model)
        self.route(mb)
        output, starts, real = backbone_forward(self.model, mb.sequences, self.packed, output_router_logits=True)
        hidden = completion_rows(output.last_hidden_state, starts, mb.sequences, mb.prompt_lengths, mb.mask.shape[1])
        aux = load_balancing_loss(output.router_logits, net.config.get_text_config().num_experts_per_tok, real)
        loss, metrics = self.loss(hidden, mb, config, num_items_in_batch, masks)
        metrics[AUX_LOSS] = aux.detach()
        metrics[ROUTER_LOSS] = self.router_aux_loss_coef * aux
        return loss, metrics

    def logprobs(self, mb, temperature: float = 1.0) -> torch.Tensor:
        """Logprobs of the completion tokens of micro-batch `mb`: [b, T] fp32 (one GEMM per chunk without grad)."""
        weight, bias = lm_head(self.model)
        return token_logprobs(self.hidden(mb), weight, mb.completion_ids, bias=bias, temperature=temperature,
                              **self.head)[0]
