"""fastgrpo's public loss API: per-token logprobs and the GRPO loss, straight from hidden states.

Paths (the environment variable FASTGRPO_BACKEND picks one; `auto` is `chunked`):
  chunked    the default, on every device (fastgrpo.grpo_head): per chunk of tokens a GEMM forms fp32 logits (cuBLAS
             on a GPU), memory-bound row passes read them (Triton kernels on CUDA, fastgrpo/kernels/logit_rows.py;
             PyTorch on a CPU), and the training loss's gradient is computed in the forward: 3 GEMMs, no atomics,
             no recompute
  reference  fastgrpo.reference: full logits; the yardstick

The Triton kernels live in `fastgrpo/kernels/`, one op per file (inside the package, so that no top-level name
`kernels` shadows PyPI's package of that name when Python runs from the repository root).
"""

import math
import os

import torch
from torch import nn

from fastgrpo import chunked, grpo_head, reference
from fastgrpo.loss_config import LossConfig

__all__ = ["LossConfig", "GRPOLoss", "token_logprobs", "grpo_loss", "fused_grpo_loss", "resolve_backend",
           "head_transform"]

BACKENDS = ("auto", "chunked", "reference")
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


def resolve_backend() -> str:
    """The path that runs, after FASTGRPO_BACKEND: "chunked" or "reference"."""
    choice = os.environ.get("FASTGRPO_BACKEND", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"FASTGRPO_BACKEND must be one of {BACKENDS}, got {choice!r}")
    return "chunked" if choice == "auto" else choice


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
        if config.kind.policy == "vespo" and importance_weights.shape != (B, T):
            raise ValueError(f"importance_weights must have shape [{B}, {T}] (per-token ratios; TRL's "
                             "vllm_importance_sampling_mode 'token_truncate' or 'token_mask') for loss_type='vespo', "
                             f"got {tuple(importance_weights.shape)}")
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
    if resolve_backend() == "reference":
        return reference.token_logprobs(hidden, weight, token_ids, bias=bias, temperature=temperature,
                                        return_entropy=return_entropy, logit_scale=logit_scale,
                                        logit_softcap=logit_softcap)
    return grpo_head.head_logprobs(hidden, weight, bias, token_ids, logits, return_entropy)


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
    return reference.grpo_loss(logps, completion_mask, advantages, old_logps=old_logps, ref_logps=ref_logps,
                               config=config, num_items_in_batch=num_items_in_batch, entropies=entropies,
                               importance_weights=importance_weights)


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
    if resolve_backend() == "reference":
        return reference.fused_grpo_loss(hidden, weight, completion_ids, completion_mask, advantages, bias=bias,
                                         old_logps=old_logps, ref_logps=ref_logps, config=config,
                                         num_items_in_batch=num_items_in_batch, importance_weights=importance_weights)
    return grpo_head.grpo_head_loss(hidden, weight, bias, completion_ids, completion_mask, advantages, old_logps,
                                    ref_logps, importance_weights, num_items_in_batch, config)


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
