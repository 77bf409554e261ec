"""fastgrpo's public loss API: per-token logprobs and the GRPO loss, straight from hidden states.

Backends (the environment variable FASTGRPO_BACKEND forces one):
  auto       torch, on every device
  torch      the default: chunked GEMMs (cuBLAS on a GPU) and memory-bound row passes (Triton kernels on CUDA,
             PyTorch elsewhere), with the training loss's gradient computed in the forward (fastgrpo.grpo_head):
             3 GEMMs, no atomics, deterministic
  fused      (alias: triton) the fully fused Triton kernels of fastgrpo.kernels.logprob / grpo_token, opt-in: their
             backward reduces dX and dW with fp32 atomics (on CPU only under TRITON_INTERPRET=1)
  reference  fastgrpo.reference: full logits; the yardstick

The Triton kernels live in the repository's top-level `kernels/` folder, one op per file; setuptools installs that
folder as `fastgrpo.kernels` (pyproject.toml's `package-dir`), so `fastgrpo.kernels.logprob` is `kernels/logprob.py`.
"""

import math
import os

import torch
from torch import nn

from fastgrpo import chunked, ops, reference
from fastgrpo.grpo_head import row_weights
from fastgrpo.loss_config import CLIP_LOSS_TYPES, LossConfig

__all__ = ["LossConfig", "GRPOLoss", "token_logprobs", "grpo_loss", "fused_grpo_loss", "resolve_backend",
           "head_transform"]

BACKENDS = ("auto", "torch", "fused", "triton", "reference")
# Model-config options that transform the logits after the lm_head (softcapping, scales, multipliers).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                    "output_multiplier_scale", "lm_head_multiplier")
# The ones the loss applies (LossConfig.logit_scale / logit_softcap): Gemma 2/3's cap, Cohere's scale (logits times
# it) and Granite's logits_scaling (logits divided by it).
SUPPORTED_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def head_transform(model_config) -> dict:
    """The model's logit transform as LossConfig / token_logprobs keywords {logit_scale, logit_softcap}; ValueError
    (starting "config.<name>=<value>:") for a transform the loss does not apply."""
    config = model_config.get_text_config()
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and name not in SUPPORTED_LOGIT_TRANSFORMS:
            raise ValueError(f"config.{name}={value}: fastgrpo's head applies only {SUPPORTED_LOGIT_TRANSFORMS}")
    scale = getattr(config, "logit_scale", None)
    scaling = getattr(config, "logits_scaling", None)
    return {"logit_scale": float((1.0 if scale is None else scale) / (1.0 if scaling is None else scaling)),
            "logit_softcap": getattr(config, "final_logit_softcapping", None)}


def resolve_backend(device: torch.device) -> str:
    """The backend that runs for tensors on `device`, after FASTGRPO_BACKEND."""
    choice = os.environ.get("FASTGRPO_BACKEND", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"FASTGRPO_BACKEND must be one of {BACKENDS}, got {choice!r}")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if choice == "auto":
        return "torch"
    if choice in ("fused", "triton") and device.type != "cuda" and not interpreted:
        raise ValueError(f"FASTGRPO_BACKEND={choice} needs CUDA tensors or TRITON_INTERPRET=1; tensors are on {device}")
    return "triton" if choice == "fused" else choice


# -- input checks: every message names the argument and what was expected --------------------------------------
# Under torch.compile the checks that read tensor values (a host sync: `.any()`, `.all()`, `.item()`, `.tolist()`),
# which would break the graph, are skipped: token ids in range, advantages finite, num_items_in_batch finite and
# >= 0. Types, shapes, dtypes, devices and options are static under tracing and stay checked.


def _check_float(name, t, ndim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _check_same_device(ref_name, ref, **tensors):
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; expected the same device")


def _check_head(hidden, weight, bias, token_ids, valid=None) -> torch.Tensor:
    _check_float("hidden", hidden)
    _check_float("weight", weight, ndim=2)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must have shape [..., H] with H = weight.shape[1] = {weight.shape[1]}, got {tuple(hidden.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}; expected the same dtype")
    if bias is not None:
        _check_float("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0] or bias.dtype != weight.dtype:
            raise ValueError(f"bias must be [{weight.shape[0]}] of dtype {weight.dtype}, got "
                             f"{tuple(bias.shape)} {bias.dtype}")
    if not isinstance(token_ids, torch.Tensor) or token_ids.is_floating_point() or token_ids.is_complex() or (
        token_ids.dtype == torch.bool
    ):
        raise TypeError(f"token_ids must be an integer tensor, got {getattr(token_ids, 'dtype', type(token_ids))}")
    if token_ids.shape != hidden.shape[:-1]:
        raise ValueError(f"token_ids must have shape {tuple(hidden.shape[:-1])} (hidden's leading dims), "
                         f"got {tuple(token_ids.shape)}")
    _check_same_device("hidden", hidden, weight=weight, bias=bias, token_ids=token_ids)
    token_ids = token_ids.long()  # any integer dtype (uint8 ids would wrap in a comparison with V)
    if torch.compiler.is_compiling():
        return token_ids  # the range check reads the ids
    V = weight.shape[0]
    out_of_range = (token_ids < 0) | (token_ids >= V)
    if valid is not None:
        out_of_range &= valid
    if out_of_range.any():
        bad = token_ids[out_of_range][:5].tolist()
        raise ValueError(f"token_ids must lie in [0, {V}) on valid tokens; found {bad}")
    return token_ids


def _check_temperature(temperature):
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _check_config(config):
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a fastgrpo.loss.LossConfig, got {type(config).__name__}")


def _check_loss_inputs(like_name, like, completion_mask, advantages, old_logps, ref_logps, config,
                       num_items_in_batch, importance_weights=None):
    """Checks of everything but the policy's logprobs, which are [B, T] = like.shape[:2] on like.device."""
    B, T = like.shape[:2]
    if importance_weights is not None:
        _check_float("importance_weights", importance_weights)
        if importance_weights.shape not in ((B,), (B, 1), (B, T)):
            raise ValueError(f"importance_weights must have shape [{B}], [{B}, 1] or [{B}, {T}], got "
                             f"{tuple(importance_weights.shape)}")
        _check_same_device(like_name, like, importance_weights=importance_weights)
    if not isinstance(completion_mask, torch.Tensor) or completion_mask.shape != (B, T):
        raise ValueError(f"completion_mask must be a tensor of shape {(B, T)} (as {like_name}), got "
                         f"{tuple(getattr(completion_mask, 'shape', ()))}")
    _check_float("advantages", advantages)
    if advantages.shape not in ((B,), (B, T)):
        raise ValueError(f"advantages must have shape [{B}] or [{B}, {T}], got {tuple(advantages.shape)}")
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if t is not None:
            _check_float(name, t)
            if t.shape != (B, T):
                raise ValueError(f"{name} must have shape {(B, T)} (as {like_name}), got {tuple(t.shape)}")
    if config.beta != 0.0 and ref_logps is None:
        raise ValueError(f"ref_logps is required when config.beta != 0 (beta = {config.beta})")
    _check_same_device(like_name, like, completion_mask=completion_mask, advantages=advantages, old_logps=old_logps,
                       ref_logps=ref_logps)
    compiling = torch.compiler.is_compiling()  # value checks skipped
    if not compiling and not torch.isfinite(advantages).all():
        raise ValueError("advantages must be finite; found NaN or inf")
    if num_items_in_batch is not None:
        items = torch.as_tensor(num_items_in_batch)
        if items.numel() != 1 or (not compiling and (not torch.isfinite(items.float()).all() or items.item() < 0)):
            raise ValueError(f"num_items_in_batch must be one finite number >= 0, got {num_items_in_batch!r}")


# -- public API -----------------------------------------------------------------------------------------------------


def _token_offsets(hidden, index):
    """Element offset of each indexed token vector of hidden [..., H] (any strides): int64 [N]."""
    offsets = torch.zeros((), dtype=torch.int64, device=hidden.device)
    for dim, (size, stride) in enumerate(zip(hidden.shape[:-1], hidden.stride()[:-1], strict=True)):
        shape = [1] * (hidden.dim() - 1)
        shape[dim] = size
        offsets = offsets + torch.arange(size, device=hidden.device).view(shape) * stride
    return offsets.reshape(-1)[index]


def _selected_logprobs(hidden, weight, bias, token_ids, valid, logits: chunked.LogitMap):
    """The fused Triton kernel's logp and entropy [N] fp32 of the tokens where `valid` ([...] bool, or None for all),
    plus their flat index into hidden's leading dims."""
    from fastgrpo.kernels.logprob import LinearLogprobFunction

    flat_ids = token_ids.reshape(-1)
    index = (torch.arange(flat_ids.numel(), device=hidden.device) if valid is None
             else valid.reshape(-1).nonzero().squeeze(1))
    if logits.softcap is not None:
        raise ValueError("FASTGRPO_BACKEND=fused does not apply a logit softcap; use the default backend")
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    return (*LinearLogprobFunction.apply(hidden, weight.contiguous(), bias, index, _token_offsets(hidden, index),
                                         flat_ids[index], 1.0 / logits.scale), index)  # the kernel divides


def _check_logit_map(temperature, logit_scale, logit_softcap) -> chunked.LogitMap:
    _check_temperature(temperature)
    LossConfig(logit_scale=logit_scale, logit_softcap=logit_softcap)  # their checks
    return chunked.LogitMap.of(float(temperature), float(logit_scale),
                               None if logit_softcap is None else float(logit_softcap))


def token_logprobs(hidden, weight, token_ids, *, bias=None, temperature=1.0, return_entropy=False, logit_scale=1.0,
                   logit_softcap=None):
    """Per-token log-probabilities (and entropies) of `token_ids` under the lm_head, without full-vocab logits.

    hidden [..., H], weight [V, H], bias [V] or None, token_ids [...] -> (logp [...], entropy [...] or None), fp32
    (fp64 for fp64 inputs); differentiable w.r.t. hidden, weight and bias. Exact equivalent:
    `F.linear(hidden, weight, bias).float().div(temperature).log_softmax(-1).gather(-1, ids[..., None])[..., 0]`,
    except that the logits are never rounded to the input dtype. A model's `logit_scale` multiplies the logits and
    its `logit_softcap` caps them (`softcap * tanh(logits / softcap)`) before the temperature, as in
    `fastgrpo.reference.token_logprobs`.
    """
    token_ids = _check_head(hidden, weight, bias, token_ids)
    logits = _check_logit_map(temperature, logit_scale, logit_softcap)
    backend = resolve_backend(hidden.device)
    if backend == "reference":
        return reference.token_logprobs(hidden, weight, token_ids, bias=bias, temperature=temperature,
                                        return_entropy=return_entropy, logit_scale=logit_scale,
                                        logit_softcap=logit_softcap)
    if backend == "torch":  # fastgrpo::token_logprobs: one GEMM per chunk, the backward recomputes
        return ops.token_logprobs(hidden, weight, bias, token_ids, logits, return_entropy)
    logp, ent, _ = _selected_logprobs(hidden, weight, bias, token_ids, None, logits)
    return logp.view(token_ids.shape), ent.view(token_ids.shape) if return_entropy else None


def _kernel_metrics(row_stats, mask, advantages, config, entropies):
    """TRL's metrics from the kernel's per-row sums [NUM_ROW_STATS, B] (see kernels/grpo_token.py)."""
    _, kl_rows, low_rows, high_rows, region_rows = row_stats
    lengths = mask.sum(-1)  # [B]
    total = lengths.sum().clamp(min=1.0)
    metrics = {}
    if config.beta != 0.0:
        metrics["kl"] = kl_rows.sum() / total
    if entropies is not None:
        metrics["entropy"] = (entropies.detach() * mask).sum() / total
    # TRL reduces a clip indicator per sequence when both the ratio and the advantage are one per sequence.
    per_sequence = config.importance_sampling_level == "sequence" and advantages.dim() == 1
    if per_sequence:
        seq = lambda rows: rows / lengths.clamp(min=1.0)  # the row's single 0/1 indicator
        mean = lambda rows: seq(rows).sum() / max(rows.numel(), 1)
    else:
        seq = lambda rows: rows / lengths  # NaN for empty rows, dropped by the nan reductions
        mean = lambda rows: rows.sum() / total
    if config.loss_type in CLIP_LOSS_TYPES:
        metrics["clip_ratio/low_mean"] = mean(low_rows)
        metrics["clip_ratio/high_mean"] = mean(high_rows)
        metrics["clip_ratio/region_mean"] = mean(region_rows)
        metrics["clip_ratio/low_min"] = reference.nan_reduce(seq(low_rows), torch.min)
        metrics["clip_ratio/high_max"] = reference.nan_reduce(seq(high_rows), torch.max)
    elif config.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = mean(low_rows)
    return metrics


def _grpo_loss(logps, completion_mask, advantages, old_logps, ref_logps, config, num_items_in_batch, entropies,
               backend, importance_weights=None):
    # The row kernel covers neither the IS correction nor the entropy bonus: the reference's math runs them.
    if backend != "triton" or importance_weights is not None or config.entropy_coef != 0.0:
        return reference.grpo_loss(logps, completion_mask, advantages, old_logps=old_logps, ref_logps=ref_logps,
                                   config=config, num_items_in_batch=num_items_in_batch, entropies=entropies,
                                   importance_weights=importance_weights)
    from fastgrpo.kernels.grpo_token import GRPOTokenLossFunction

    f32 = lambda t: None if t is None else t.detach().to(torch.float32).contiguous()
    mask = completion_mask.to(torch.float32).contiguous()
    loss, row_stats = GRPOTokenLossFunction.apply(
        logps.float().contiguous(), f32(old_logps), f32(ref_logps), f32(advantages), mask,
        row_weights(mask, config, num_items_in_batch), config,
    )
    return loss, _kernel_metrics(row_stats, mask, advantages, config, entropies)


def grpo_loss(logps, completion_mask, advantages, *, old_logps=None, ref_logps=None, config: LossConfig,
              num_items_in_batch=None, entropies=None, importance_weights=None):
    """The GRPO loss of TRL 1.16 from per-token logprobs.

    logps [B, T] (differentiable), completion_mask [B, T], advantages [B] or [B, T], old_logps / ref_logps [B, T]
    (old_logps=None: on-policy, `logps.detach()`), entropies [B, T] (the `entropy` metric; required, and
    differentiable, for config.entropy_coef != 0), importance_weights [B], [B, 1] or [B, T] (the sampler's truncated
    IS correction, TRL's importance_sampling_ratio: multiplies the policy term, not the KL).
    Returns (loss [], metrics: dict of 0-dim tensors with TRL's names).
    Exact equivalent: `fastgrpo.reference.grpo_loss`.
    """
    _check_config(config)
    _check_float("logps", logps, ndim=2)
    _check_loss_inputs("logps", logps, completion_mask, advantages, old_logps, ref_logps, config, num_items_in_batch,
                       importance_weights)
    if config.entropy_coef != 0.0 and entropies is None:
        raise ValueError(f"entropies is required when config.entropy_coef != 0 (entropy_coef = {config.entropy_coef})")
    return _grpo_loss(logps, completion_mask, advantages, old_logps, ref_logps, config, num_items_in_batch,
                      entropies, resolve_backend(logps.device), importance_weights)


def fused_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, *, bias=None, old_logps=None,
                    ref_logps=None, config: LossConfig, num_items_in_batch=None, importance_weights=None):
    """The GRPO loss straight from the policy's last hidden states, never forming the [B, T, V] logits.

    hidden [B, T, H] (the states that predict completion_ids), weight [V, H] (lm_head), bias [V] or None,
    completion_ids / completion_mask [B, T]; the rest as in `grpo_loss`. Only tokens with completion_mask != 0
    are scored. Returns (loss, metrics). Exact equivalent: `fastgrpo.reference.fused_grpo_loss`.
    """
    _check_config(config)
    _check_float("hidden", hidden, ndim=3)
    _check_loss_inputs("hidden", hidden, completion_mask, advantages, old_logps, ref_logps, config, num_items_in_batch,
                       importance_weights)
    valid = completion_mask != 0
    completion_ids = _check_head(hidden, weight, bias, completion_ids, valid)
    backend = resolve_backend(hidden.device)
    if backend == "reference":
        return reference.fused_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, bias=bias,
                                         old_logps=old_logps, ref_logps=ref_logps, config=config,
                                         num_items_in_batch=num_items_in_batch, importance_weights=importance_weights)
    if backend == "torch":  # fastgrpo::grpo_head_loss: the gradient computed in the forward (fastgrpo.grpo_head)
        return ops.grpo_head_loss(hidden, weight, bias, completion_ids, completion_mask, advantages, old_logps,
                                  ref_logps, importance_weights, num_items_in_batch, config)
    logits = chunked.LogitMap.of(config.temperature, config.logit_scale, config.logit_softcap)
    logp, ent, index = _selected_logprobs(hidden, weight, bias, completion_ids, valid, logits)
    B, T = completion_mask.shape
    logps = logp.new_zeros(B * T).index_copy(0, index, logp).view(B, T)  # differentiable scatter
    if config.entropy_coef == 0.0:
        ent = ent.detach()
    entropies = ent.new_zeros(B * T).index_copy(0, index, ent).view(B, T)
    return _grpo_loss(logps, completion_mask, advantages, old_logps, ref_logps, config, num_items_in_batch,
                      entropies, backend, importance_weights)


class GRPOLoss(nn.Module):
    """`fused_grpo_loss` as a module holding its `LossConfig`.

    loss_fn = GRPOLoss(LossConfig(loss_type="dapo", beta=0.04))
    loss, metrics = loss_fn(hidden, model.lm_head.weight, completion_ids, completion_mask, advantages, ...)
    """

    def __init__(self, config: LossConfig | None = None, **overrides):
        super().__init__()
        if config is not None and overrides:
            raise ValueError("pass either config or keyword overrides, not both")
        self.config = config if config is not None else LossConfig(**overrides)

    def forward(self, hidden, weight, completion_ids, completion_mask, advantages, *, bias=None, old_logps=None,
                ref_logps=None, num_items_in_batch=None):
        return fused_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, bias=bias,
                               old_logps=old_logps, ref_logps=ref_logps, config=self.config,
                               num_items_in_batch=num_items_in_batch)

    def extra_repr(self) -> str:
        return repr(self.config)
