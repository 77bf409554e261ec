"""Mixture-of-experts models in training: the router's load-balancing loss (TRL's `router_aux_loss_coef`), the
experts' weights that LoRA can reach, and routing replay's checks and metrics (fastgrpo/routing.py).

transformers 5 keeps an MoE layer's experts as fused 3-D parameters (`mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I]; gpt-oss's transposed), not as nn.Linear modules, so peft's `all-linear` misses
them and only its `target_parameters` reaches them.
"""

import math

import torch
from transformers import PreTrainedModel


def router_aux_loss_coef(requested: float | None, model: PreTrainedModel) -> float:
    """The weight of the router's load-balancing loss in the training loss, by TRL 1.16's rule: `requested`, or when
    None the model config's own `router_aux_loss_coef` (0 where it declares none). Only a model whose config has
    `output_router_logits` (an MoE whose forward returns its router logits) has that loss: for any other model a
    nonzero request is refused and None is 0."""
    config = model.config.get_text_config()
    if not hasattr(config, "output_router_logits"):
        if requested:
            raise ValueError(f"router_aux_loss_coef={requested}: {type(model).__name__} is not a mixture-of-experts "
                             "model that returns its router logits (its config has no output_router_logits), so there "
                             "is no load-balancing loss to weight; leave router_aux_loss_coef unset or 0")
        return 0.0
    if requested is not None:
        return float(requested)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], top_k: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6) over all MoE layers at once, as
    transformers' MoE models compute it (`aux_loss` of their forward with output_router_logits): a scalar fp32.

    router_logits: one [N, E] tensor of router logits per MoE layer, the N tokens in the same order in each;
    mask [N] (bool or 0/1): the tokens that count (None: all). With p = softmax(logits) per token and layer,
    f_e = (top-k picks of expert e) / (layers x counted tokens) and P_e = (sum of p_e) / (layers x counted tokens):
        loss = E * sum_e f_e * P_e
    which is top_k for perfectly balanced routing (f_e = top_k / E, P_e = 1 / E). Only P carries a gradient (the
    picks are discrete), to the router's weights."""
    E = router_logits[0].shape[-1]
    picks = router_logits[0].new_zeros(E, dtype=torch.float32)  # [E]
    probs = router_logits[0].new_zeros(E, dtype=torch.float32)  # [E]
    weight = None if mask is None else mask.reshape(-1).to(device=picks.device, dtype=torch.float32)  # [N]
    rows = 0.0
    for logits in router_logits:  # [N, E]
        p = torch.softmax(logits.float(), dim=-1)  # [N, E]
        chosen = torch.topk(p, top_k, dim=-1).indices  # [N, k]
        counted = p.new_ones(chosen.shape[0]) if weight is None else weight  # [N]
        picks = picks + torch.zeros_like(picks).scatter_add_(0, chosen.reshape(-1), counted.repeat_interleave(top_k))
        probs = probs + (p * counted[:, None]).sum(0)
        rows = rows + counted.sum()
    return E * (picks / rows * (probs / rows)).sum()


def expert_parameters(model: PreTrainedModel) -> list[str]:
    """The names, as peft's `target_parameters` takes them (the path below a decoder layer:
    "mlp.experts.gate_up_proj"), of the model's fused expert weights: its 3-D parameters but convolutions' (Qwen3.5's
    and Mamba-2's causal conv1d, [C, 1, K]). Empty for a dense model."""
    convolutions = {id(p) for m in model.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)
                    for p in m.parameters(recurse=False)}  # fmt: skip
    names = []
    for full_name, parameter in model.named_parameters():
        if parameter.dim() != 3 or id(parameter) in convolutions:
            continue
        _, sep, rest = full_name.partition(".layers.")
        suffix = rest.split(".", 1)[1] if sep and "." in rest else full_name
        if suffix not in names:
            names.append(suffix)
    return names


def check_routing_replay(config, routing, model: PreTrainedModel) -> None:
    """routing_replay needs routers whose experts and weights the trainer can replay (fastgrpo/routing.py): one line
    naming the model otherwise."""
    if not config.routing_replay:
        return
    if routing is None:
        raise ValueError(f"routing_replay: {type(model).__name__} is not a mixture-of-experts model with a router "
                         "transformers records (_can_record_outputs['router_logits']): there are no routes to replay")
    if routing.unsupported:
        raise ValueError(f"routing_replay: {type(model).__name__}: {routing.unsupported}")


def routing_metrics(counts: tuple[int, int], rollout, completions) -> dict[str, float]:
    """What the old logprobs' pass measured against the sampler (routing/mismatch: the share of (token, MoE layer)
    routes where the model's own top k differs from the one the sampler used, whether or not it was replayed), and
    TRL's sampling/sampling_logp_difference of the sampled tokens (tool tokens excluded)."""
    differ, compared = counts
    metrics = {"routing/mismatch": differ / compared if compared else math.nan}
    deltas = [(old - torch.tensor(c.logprobs, dtype=torch.float32)).abs()[torch.tensor(mask, dtype=torch.bool)]
              for old, c, mask in zip(rollout.old_logps, completions, rollout.loss_mask, strict=True)]
    delta = torch.cat(deltas) if deltas else torch.zeros(0)
    delta = delta[~delta.isnan()]  # (a rollout_func's samples have no sampler logprobs)
    if delta.numel():
        metrics["sampling/sampling_logp_difference/mean"] = float(delta.mean())
        metrics["sampling/sampling_logp_difference/max"] = float(delta.max())
    return metrics
