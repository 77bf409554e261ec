"""fastgrpo's default path as torch.library ops, so that torch.compile traces the loss without graph breaks.

    fastgrpo::token_logprobs            (hidden [..., H], weight [V, H], bias [V]?, token_ids [...], scale, softcap,
                                         entropy) -> (logp [...], entropy [...] or [0])
    fastgrpo::token_logprobs_backward   its recompute backward -> (d_hidden, d_weight, d_bias), [0] where not wanted
    fastgrpo::grpo_head_loss            (hidden [B, T, H], weight, bias?, completion_ids, completion_mask, advantages,
                                         old_logps?, ref_logps?, importance_weights?, num_items_in_batch?,
                                         wants_grad, the LossConfig's fields) -> (loss [], metrics [M], d_hidden,
                                         d_weight, d_bias), the gradients computed in the forward

Everything of data-dependent shape (the valid tokens' nonzero, the per-row lengths of sequence-level chunks, the
metrics' NaN filters) stays inside a kernel; the outputs' shapes follow from the inputs' shapes and the config, so
the graph around the ops is static. A kernel's optional outputs are [0] tensors (an op returns no None). The metrics
travel as one tensor in `metric_names(config)` order and come back as fastgrpo.reference.grpo_loss's dict.

Under torch.compile the wrappers call the ops; in eager they run the same kernels, setup_context and backward through
an autograd.Function: an op is opaque to TorchDispatchModes (FLOP counters, tests/test_grpo_head.py's GEMM count),
which should keep seeing the loss's GEMMs.
"""

import dataclasses
import types

import torch

from fastgrpo import chunked, grpo_head
from fastgrpo.loss_config import CLIP_LOSS_TYPES, LossConfig

# -- LossConfig <-> the ops' scalar arguments: the one place that converts ----------------------------------------

CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(LossConfig))
_SCHEMA_TYPES = {str: "str", float: "float", float | None: "float?", bool: "bool", int: "int"}
_CONFIG_SCHEMA = ", ".join(f"{_SCHEMA_TYPES[field.type]} {field.name}" for field in dataclasses.fields(LossConfig))


def config_args(config: LossConfig) -> tuple:
    """The config's fields in CONFIG_FIELDS order: the ops' trailing scalar arguments."""
    return tuple(getattr(config, name) for name in CONFIG_FIELDS)


def _config_of(options) -> LossConfig:
    return LossConfig(**dict(zip(CONFIG_FIELDS, options, strict=True)))


CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max")


def metric_names(config: LossConfig) -> tuple[str, ...]:
    """The keys of fastgrpo.reference.grpo_loss's metrics (entropies given) for `config`, in its order."""
    kl = ("kl",) if config.beta != 0.0 else ()
    ratios = CLIP_METRICS if config.loss_type in CLIP_LOSS_TYPES else (
        ("cispo_clip_ratio",) if config.loss_type == "cispo" else ())
    return (*kl, "entropy", *ratios)


def _or_empty(t, like):
    """t, or a [0] tensor like `like` for a None (an op's outputs are tensors)."""
    return like.new_empty(0) if t is None else t


def _like_or_empty(t, wanted: bool):
    """A fake output: t's shape when wanted, else [0]."""
    return t.new_empty(t.shape if wanted else (0,))


def _wants_grad(*tensors) -> list[bool]:
    return [torch.is_grad_enabled() and t is not None and t.requires_grad for t in tensors]


def _eager_function(name, kernel, setup_context, backward):
    """An op's kernel, setup_context and backward as an autograd.Function, for eager calls. Its forward takes ctx and
    calls setup_context itself, as the ops' own autograd does: the setup_context style of autograd.Function binds its
    arguments by signature on every call (+0.17 ms on a CPU)."""

    def forward(ctx, *args):
        output = kernel(*args)
        setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward),
                                                   "kernel": staticmethod(kernel)})


def _call(op, eager, args, wants_grad):
    """The registered op under torch.compile; in eager its autograd.Function when a gradient is wanted, else the kernel
    itself."""
    if torch.compiler.is_compiling():
        return op(*args)
    return eager.apply(*args) if any(wants_grad) else eager.kernel(*args)


# -- fastgrpo::token_logprobs and its backward -----------------------------------------------------------------------


def _token_logprobs_kernel(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           token_ids: torch.Tensor, scale: float, softcap: float | None,
                           entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logp, ent = chunked.logprobs_no_grad(hidden.reshape(-1, hidden.shape[-1]), weight, bias, token_ids.reshape(-1),
                                         chunked.LogitMap(scale, softcap), entropy=entropy)  # [N], [N] or None
    return logp.view(token_ids.shape), ent.view(token_ids.shape) if entropy else logp.new_empty(0)


def _token_logprobs_backward_kernel(grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                                    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                    token_ids: torch.Tensor, scale: float, softcap: float | None,
                                    wants_grad: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = lambda g: None if g is None else g.reshape(-1)  # [...] -> [N]
    # ChunkedLinearLogprobFunction.backward holds the one copy of the recompute; it reads these three from its ctx.
    saved = types.SimpleNamespace(saved_tensors=(hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat(token_ids)),
                                  needs_input_grad=wants_grad, logits=chunked.LogitMap(scale, softcap))
    dx, dw, db, _, _ = chunked.ChunkedLinearLogprobFunction.backward(saved, flat(grad_logp), flat(grad_entropy))
    dx = None if dx is None else dx.view(hidden.shape)
    return _or_empty(dx, hidden), _or_empty(dw, weight), _or_empty(db, weight if bias is None else bias)


token_logprobs_op = torch.library.custom_op("fastgrpo::token_logprobs", _token_logprobs_kernel, mutates_args=())
token_logprobs_backward_op = torch.library.custom_op("fastgrpo::token_logprobs_backward",
                                                     _token_logprobs_backward_kernel, mutates_args=())


@token_logprobs_op.register_fake
def _(hidden, weight, bias, token_ids, scale, softcap, entropy):
    logp = hidden.new_empty(token_ids.shape, dtype=torch.promote_types(hidden.dtype, torch.float32))
    return logp, _like_or_empty(logp, entropy)


@token_logprobs_backward_op.register_fake
def _(grad_logp, grad_entropy, hidden, weight, bias, token_ids, scale, softcap, wants_grad):
    return (_like_or_empty(hidden, wants_grad[0]), _like_or_empty(weight, wants_grad[1]),
            _like_or_empty(weight if bias is None else bias, wants_grad[2] and bias is not None))


def _token_logprobs_setup(ctx, inputs, output):
    hidden, weight, bias, token_ids, scale, softcap, entropy = inputs
    ctx.save_for_backward(hidden, weight, bias, token_ids)
    ctx.logits, ctx.entropy = (scale, softcap), entropy
    if not entropy:
        ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no entropy term in dZ


def _token_logprobs_grads(ctx, grad_logp, grad_entropy, backward):
    wants_grad = list(ctx.needs_input_grad[:3])
    grads = backward(grad_logp, grad_entropy if ctx.entropy else None, *ctx.saved_tensors, *ctx.logits, wants_grad)
    return (*(g if wanted else None for g, wanted in zip(grads, wants_grad, strict=True)), None, None, None, None)


def _token_logprobs_backward(ctx, grad_logp, grad_entropy):
    return _token_logprobs_grads(ctx, grad_logp, grad_entropy, token_logprobs_backward_op)  # one node for AOTAutograd


def _token_logprobs_eager_backward(ctx, grad_logp, grad_entropy):
    return _token_logprobs_grads(ctx, grad_logp, grad_entropy, _token_logprobs_backward_kernel)


token_logprobs_op.register_autograd(_token_logprobs_backward, setup_context=_token_logprobs_setup)
_TokenLogprobsFunction = _eager_function("_TokenLogprobsFunction", _token_logprobs_kernel, _token_logprobs_setup,
                                         _token_logprobs_eager_backward)


def token_logprobs(hidden, weight, bias, token_ids, logits: chunked.LogitMap, entropy: bool):
    """(logp [...], entropy [...] or None) of token_ids [...] under hidden [..., H] @ weight [V, H].T (+ bias),
    >= fp32; differentiable w.r.t. hidden, weight and bias (the backward recomputes each chunk's logits)."""
    args = (hidden, weight, bias, token_ids, logits.scale, logits.softcap, entropy)
    logp, ent = _call(token_logprobs_op, _TokenLogprobsFunction, args, _wants_grad(hidden, weight, bias))
    return logp, ent if entropy else None


# -- fastgrpo::grpo_head_loss -----------------------------------------------------------------------------------------


def _grpo_head_loss_kernel(hidden, weight, bias, completion_ids, completion_mask, advantages, old_logps, ref_logps,
                           importance_weights, num_items_in_batch, wants_grad, *options):
    config = _config_of(options)
    loss, metrics, (dx, dw, db) = grpo_head.grpo_head_loss(hidden, weight, bias, completion_ids, completion_mask,
                                                           advantages, old_logps, ref_logps, importance_weights,
                                                           num_items_in_batch, config, wants_grad)
    values = torch.stack([metrics[name].to(loss.dtype) for name in metric_names(config)])  # [M]
    return loss, values, _or_empty(dx, hidden), _or_empty(dw, weight), _or_empty(db, weight if bias is None else bias)


grpo_head_loss_op = torch.library.custom_op(
    "fastgrpo::grpo_head_loss", _grpo_head_loss_kernel, mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor completion_ids, Tensor completion_mask, "
           "Tensor advantages, Tensor? old_logps, Tensor? ref_logps, Tensor? importance_weights, "
           f"Tensor? num_items_in_batch, bool[] wants_grad, {_CONFIG_SCHEMA}) "
           "-> (Tensor loss, Tensor metrics, Tensor d_hidden, Tensor d_weight, Tensor d_bias)",
)


_WANTS_GRAD = 10  # wants_grad's place among the op's arguments


@grpo_head_loss_op.register_fake
def _(hidden, weight, bias, completion_ids, completion_mask, advantages, old_logps, ref_logps, importance_weights,
      num_items_in_batch, wants_grad, *options):
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    loss = hidden.new_empty((), dtype=dtype)
    metrics = hidden.new_empty(len(metric_names(_config_of(options))), dtype=dtype)
    return (loss, metrics, _like_or_empty(hidden, wants_grad[0]), _like_or_empty(weight, wants_grad[1]),
            _like_or_empty(weight if bias is None else bias, wants_grad[2] and bias is not None))


def _grpo_head_loss_setup(ctx, inputs, output):
    loss, metrics, *grads = output
    ctx.wants_grad = inputs[_WANTS_GRAD]
    ctx.save_for_backward(*grads)
    ctx.mark_non_differentiable(metrics, *grads, *(() if any(ctx.wants_grad) else (loss,)))


def _grpo_head_loss_backward(ctx, grad_loss, *_):
    """The forward's gradients times grad_output."""
    scaled = [g * grad_loss.to(g.dtype) if wanted else None
              for g, wanted in zip(ctx.saved_tensors, ctx.wants_grad, strict=True)]
    return (*scaled, *[None] * (len(ctx.needs_input_grad) - len(scaled)))


grpo_head_loss_op.register_autograd(_grpo_head_loss_backward, setup_context=_grpo_head_loss_setup)


_GRPOHeadLossFunction = _eager_function("_GRPOHeadLossFunction", _grpo_head_loss_kernel, _grpo_head_loss_setup,
                                        _grpo_head_loss_backward)


def grpo_head_loss(hidden, weight, bias, completion_ids, completion_mask, advantages, old_logps, ref_logps,
                   importance_weights, num_items_in_batch, config: LossConfig):
    """fastgrpo.grpo_head.grpo_head_loss, differentiable w.r.t. hidden, weight and bias: (loss [], metrics dict)."""
    wants_grad = _wants_grad(hidden, weight, bias)
    if num_items_in_batch is not None and not isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = torch.as_tensor(num_items_in_batch, dtype=torch.float64)  # a number as is, exactly
    args = (hidden, weight, bias, completion_ids, completion_mask, advantages, old_logps, ref_logps, importance_weights,
            num_items_in_batch, wants_grad, *config_args(config))
    loss, metrics, *_ = _call(grpo_head_loss_op, _GRPOHeadLossFunction, args, wants_grad)
    return loss, dict(zip(metric_names(config), metrics.unbind(0), strict=True))
