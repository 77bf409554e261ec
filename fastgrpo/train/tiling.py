"""A decoder layer's training memory without [tokens, intermediate] tensors, fp32 adapter or norm inputs, or a [b, 1,
T, T] mask.

Four parts, each installed on a loaded model by `apply_layer_memory_options` (loading.py calls it; the mask by
`use_mask_free_sdpa`):

* Tiled MLP (`mlp_tile_tokens`). A SwiGLU MLP's backward keeps, per token, its gate, up, SiLU(gate) and product:
  4 x intermediate values, [T, I] each, ~4x what the rest of the layer keeps (Qwen2.5-7B: I = 18944 = 5.3 H). Tiled,
  the MLP runs over the micro-batch's tokens `tile` at a time and keeps only its input [T, H]; the backward recomputes
  each tile, takes its gradients and drops it, so no [T, I] tensor is ever whole: a layer's backward holds
  [tile, I] tensors, whatever T. Equivalent: `torch.cat([mlp(x) for x in x.reshape(-1, H).split(tile)])`.
  Checkpointed, the layer's recompute stops before the MLP (_KeptInput below): the MLP runs as many times as untiled,
  once in the forward and once, tile by tile, in the backward (1.0-1.07x a CPU step; unchecked, one forward more).
* LoRA adapters that keep their input as it comes (`recompute_lora_inputs`). peft casts each adapted layer's input to
  its fp32 adapter and drops it out before lora_A: lora_A's backward keeps that fp32, dropped-out copy, 4 bytes per
  input value per adapted layer (5 with dropout: plus the mask; q, k and v each keep their own copy of one input).
  `LoRAInput` replaces lora_A with the same weight and peft's dropout folded in: it keeps the input in its own dtype
  (one tensor, that q, k and v share) and the RNG state, and its backward redoes the cast and the dropout.
  Equivalent: `F.linear(dropout(x.to(A.dtype)), A)`, peft's own expression; the gradients are peft's, bit for bit.
* Attention without a [b, 1, T, T] mask (`mask_free_attention`). transformers' SDPA path builds a [b, 1, T, T]
  boolean mask for any padded micro-batch, which SDPA turns into an additive one (2 bytes per entry, kept for the
  backward) and which rules out the flash kernel and SDPA's GQA (keys and values are repeated per query head).
  A training micro-batch is right-padded: each sequence's tokens come first, and under a causal mask they never see
  the pads that follow. MASK_FREE_SDPA is transformers' own SDPA attention with one change in its mask: a
  right-padded batch without a cache gets none, and SDPA's is_causal. Exact for every token but the pads, whose
  outputs nothing reads (PolicyLoss scores the tokens of each sequence only); anything else gets transformers' mask.
* RMSNorms that keep their input as it comes (`recompute_norms`). transformers' RMSNorm computes in fp32; its
  autograd keeps the fp32 copy of its input and an fp32 rsqrt, and its backward makes five fp32 [T, H] temporaries at
  once. Recomputed (`recompute_norms` below), each norm keeps its input in its own dtype and the backward recomputes
  it in tiles of NORM_TILE_VALUES values: the fp32 passes exist one tile at a time.

One mechanism does the first two and the fourth: `_Recomputed` (or _KeptInput + _TiledOutput) runs a per-token function
under no_grad, keeps its input, and in the backward recomputes it (in tiles, replaying the forward's random numbers) and
returns the gradients of the input and of the parameters it reads. The parameters are inputs of the Function, so their
gradients flow through autograd as any other's (hooks, FSDP2's and DDP's reductions and torch.autograd.grad see them
once, summed over tiles in the parameter's dtype).

Memory per decoder layer and micro-batch of T tokens (hidden H, intermediate I, q = heads x head_dim, kv = kv heads x
head_dim, LoRA rank r, compute dtype of b bytes), kept from the forward for the backward:
    MLP, untiled   4 I b per token (+ with LoRA the adapted layers' inputs, below)
    MLP, tiled     H b per token (its input), and during its backward 4 I b + with LoRA 4 (I + 2 H) per tile token
    LoRA, peft     (4 + [1 if dropout]) x (3 H + q + 2 H + I) + 4 r x 7 per token: fp32 inputs of q, k, v, o, gate,
                   up and down, each (with a mask), and lora_A's fp32 outputs
    LoRA, here     b x (H + H + I) + 4 r x 7 per token: the inputs of q/k/v (one tensor), gate/up (one) and down
                   (otherwise unkept: the norm weights are frozen); o's is SDPA's output, which SDPA keeps anyway.
                   Tiled, the gate/up and down terms and 3 of the 7 lora_A outputs live in the tile only
    attention mask b_mb x T^2 x (1 + b) per micro-batch of b_mb rows: the boolean mask and SDPA's additive copy (0
                   without it), and the GQA repeat of K and V: 2 q b per token (0 without a mask)
    RMSNorms       2 (4 H + 4) per token with a bf16 input (each norm's fp32 input copy and rsqrt), and 5 x 4 H per
                   token during its backward; recomputed, each keeps its input (b H; the input norm's is the layer's
                   input, which a checkpoint keeps anyway), and 5 x 4 H per tile row during the backward
"""

import functools
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

MASK_FREE_SDPA = "fastgrpo_sdpa"  # transformers' SDPA attention, registered with a mask that skips right padding
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # Llama, Qwen2, Qwen3, Mistral, Gemma: SwiGLU by name


# -- one recomputed function -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Recompute:
    """What `_Recomputed` runs: `function(x [n, H]) -> [n, H_out]`, per token (row i of the output depends on row i of
    the input only, so tiles compute what the whole does); `tile_tokens` rows at a time (None: all at once);
    `replay_rng`: the function draws random numbers (dropout), so the backward replays the forward's."""

    function: Callable[[torch.Tensor], torch.Tensor]
    tile_tokens: int | None
    replay_rng: bool


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def _replayed(state: tuple | None, device: torch.device):
    """The RNG as it was at `state` (None: untouched); the state before is restored on exit."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _tiles(n: int, tile: int | None) -> list[slice]:
    """The row ranges of n rows in tiles of `tile` (None: one range, also for n = 0)."""
    if tile is None or n <= tile:
        return [slice(0, n)]
    return [slice(start, min(start + tile, n)) for start in range(0, n, tile)]


def _tiled_output(options: Recompute, x: torch.Tensor) -> torch.Tensor:
    """options.function(x [..., H]) -> [..., H_out] without autograd, tile by tile into one output."""
    flat = x.reshape(-1, x.shape[-1])  # [n, H]
    tiles = _tiles(flat.shape[0], options.tile_tokens)
    with torch.no_grad():
        if len(tiles) == 1:
            out = options.function(flat)  # [n, H_out]
        else:
            for rows in tiles:
                y = options.function(flat[rows])  # [tile, H_out]
                if rows.start == 0:
                    out = y.new_empty(flat.shape[0], y.shape[-1])  # [n, H_out]
                out[rows] = y
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _tiled_gradients(ctx, grad: torch.Tensor) -> tuple:
    """The backward of options.function at the x and params saved in ctx, for the output's gradient `grad`
    [..., H_out]: each tile recomputed with autograd (the forward's random numbers replayed), its gradients taken and
    the tile dropped. (None for the options, x's gradient, each param's: summed over tiles, in the param's dtype)."""
    x, *params = ctx.saved_tensors
    wants_x, wants = ctx.needs_input_grad[1], [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
    flat, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])  # [n, H], [n, H_out]
    grad_x = torch.empty_like(flat) if wants_x else None  # [n, H]
    grad_params = [None] * len(params)
    with _replayed(ctx.rng, x.device), torch.enable_grad():
        for rows in _tiles(flat.shape[0], ctx.options.tile_tokens):
            part = flat[rows].detach().requires_grad_(wants_x)  # [tile, H]
            y = ctx.options.function(part)  # [tile, H_out]
            got = torch.autograd.grad(y, [part] * wants_x + [params[i] for i in wants], grad[rows], allow_unused=True)
            if wants_x:
                grad_x[rows] = got[0]
            for i, g in zip(wants, got[wants_x:], strict=True):
                if g is not None:
                    grad_params[i] = g if grad_params[i] is None else grad_params[i].add_(g)
    return None, None if grad_x is None else grad_x.view_as(x), *grad_params


def _keep(ctx, options: Recompute, x: torch.Tensor, params: tuple) -> None:
    ctx.options = options
    ctx.rng = _rng_state(x.device) if options.replay_rng else None
    ctx.save_for_backward(x, *params)


class _Recomputed(torch.autograd.Function):
    """`options.function(x)`, keeping only `x` for the backward, which recomputes it tile by tile and returns the
    gradients of x and of `params` (the tensors the function reads that need one)."""

    @staticmethod
    def forward(ctx, options: Recompute, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        _keep(ctx, options, x, params)
        return _tiled_output(options, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # [..., H_out]
        return _tiled_gradients(ctx, grad)


# _Recomputed for a function whose output has its input's shape (an MLP), in two Functions so that a checkpointed
# layer's recompute never runs it: _KeptInput keeps x before _TiledOutput computes the function, and torch's
# non-reentrant checkpoint stops recomputing at the last tensor the backward needs (x, when nothing after the MLP keeps
# any: Llama, Qwen2, Qwen3). _TiledOutput's backward hands the output's gradient on unchanged (the shapes agree) to
# _KeptInput's, which takes the function's backward. In one Function the recompute would run the MLP once more.


class _KeptInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, options: Recompute, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        _keep(ctx, options, x, params)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # [..., H]: the gradient of the function's output
        return _tiled_gradients(ctx, grad)


class _TiledOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, options: Recompute, x: torch.Tensor) -> torch.Tensor:
        return _tiled_output(options, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # [..., H]
        return None, grad


def recomputed(options: Recompute, x: torch.Tensor, params: list[torch.Tensor], same_shape: bool = False):
    """options.function(x) that keeps only x for its backward (see _Recomputed); `params`: what the function reads
    that may need a gradient (those that do are passed on). `same_shape`: the output has x's shape, and a checkpointed
    recompute need not run the function (_KeptInput)."""
    if not torch.is_grad_enabled():  # sampling, logprobs: tiles, and nothing kept
        return _tiled_output(options, x)
    params = [p for p in params if p.requires_grad]
    if not same_shape:
        return _Recomputed.apply(options, x, *params)
    return _TiledOutput.apply(options, _KeptInput.apply(options, x, *params))


# -- tiled MLP -------------------------------------------------------------------------------------------------------


def _draws_random(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in module.modules())


def _tiled_forward(mlp: torch.nn.Module, tile_tokens: int, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own forward (its class's, through its LoRA or 4-bit layers) over tiles of x [..., H]."""
    options = Recompute(functools.partial(type(mlp).forward, mlp), tile_tokens, _draws_random(mlp))
    return recomputed(options, x, list(mlp.parameters()), same_shape=True)


def tile_mlps(model: torch.nn.Module, tile_tokens: int) -> int:
    """Runs every SwiGLU MLP of `model` (a module with gate_proj, up_proj and down_proj) in tiles of `tile_tokens`
    tokens (module docstring). Its parameters, state dict and hooks are untouched: only the instance's forward is
    replaced. Returns how many MLPs; ValueError when there are none."""
    mlps = [m for m in model.modules() if all(isinstance(getattr(m, name, None), torch.nn.Module)
                                              for name in MLP_PROJECTIONS)]
    if not mlps:
        raise ValueError(f"mlp_tile_tokens: {type(model).__name__} has no MLP with {', '.join(MLP_PROJECTIONS)}")
    for mlp in mlps:
        mlp.forward = functools.partial(_tiled_forward, mlp, tile_tokens)
    return len(mlps)


# -- LoRA inputs -----------------------------------------------------------------------------------------------------


class LoRAInput(torch.nn.Linear):
    """peft's lora_A with the adapter's dropout folded in: `F.linear(dropout(x.to(weight.dtype)), weight)`, keeping x
    in its own dtype (and the RNG state) for the backward instead of the fp32, dropped-out copy."""

    dropout: torch.nn.Module  # peft's lora_dropout of the adapter: nn.Dropout or nn.Identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., r]
        if not torch.is_grad_enabled():
            return self._lora_a(x)
        replay = isinstance(self.dropout, torch.nn.Dropout) and self.dropout.p > 0 and self.dropout.training
        return recomputed(Recompute(self._lora_a, None, replay), x, [self.weight])

    def _lora_a(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.dropout(x.to(self.weight.dtype)), self.weight)


def recompute_lora_inputs(model: torch.nn.Module) -> int:
    """Every peft LoRA layer whose adapters are all plain linear ones (no DoRA or other variant) gets a LoRAInput for
    each lora_A, and stops casting the input (LoRAInput casts it). The weights, their names and the saved adapter are
    peft's. Returns how many adapters."""
    count = 0
    for layer in model.modules():
        adapters = getattr(layer, "lora_A", None)
        if not (isinstance(adapters, torch.nn.ModuleDict) and adapters and hasattr(layer, "lora_variant")
                and all(type(a) is torch.nn.Linear and a.bias is None and name not in layer.lora_variant
                        for name, a in adapters.items())):
            continue  # not a peft LoRA layer of plain linear adapters: the layer keeps peft's path, casting included
        for name, lora_a in list(adapters.items()):
            replacement = LoRAInput(lora_a.in_features, lora_a.out_features, bias=False, device="meta")
            replacement.weight = lora_a.weight
            replacement.dropout = layer.lora_dropout[name]
            replacement.train(lora_a.training)
            layer.lora_A[name] = replacement
            layer.lora_dropout[name] = torch.nn.Identity()
            count += 1
        layer.cast_input_dtype_enabled = False  # peft's own switch (peft.helpers.disable_input_dtype_casting)
    return count


# -- RMSNorm ---------------------------------------------------------------------------------------------------------


# Values per tile of a recomputed norm: 16M (4096 tokens of H 4096, or of Qwen3's 32 q heads of 128); its fp32 passes
# are then 64 MiB each, whatever the micro-batch.
NORM_TILE_VALUES = 4096 * 4096


def _is_rms_norm(module: torch.nn.Module) -> bool:
    """transformers' RMSNorm modules (LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, ...: per token over the last dim);
    not Liger's, whose kernels keep no fp32 copy already."""
    return (type(module).__name__.endswith("RMSNorm") and type(module).__module__.startswith("transformers.")
            and isinstance(getattr(module, "weight", None), torch.Tensor))


def norm_tile_rows(width: int) -> int:
    """Rows per tile of a recomputed norm over rows of `width` values (NORM_TILE_VALUES values a tile)."""
    return max(1, NORM_TILE_VALUES // width)


def _recomputed_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm's own forward, keeping only x (in its dtype) for the backward, which recomputes it in tiles."""
    options = Recompute(functools.partial(type(norm).forward, norm), norm_tile_rows(x.shape[-1]), False)
    return recomputed(options, x, [norm.weight])


def recompute_norms(model: torch.nn.Module) -> int:
    """Every transformers RMSNorm of `model` (the layers' input and post-attention norms, Qwen3's q and k norms, the
    final norm) keeps its input as it comes for the backward, and the backward recomputes it in tiles. transformers'
    RMSNorm computes in fp32: its autograd keeps the fp32 copy of its input (4 bytes a value, twice a bf16 input's)
    and its backward makes five fp32 temporaries of the input's size at once, which a layer's backward peaks at past
    ~100K tokens (Qwen3-8B). Values and gradients are the norm's own (per token; a trained norm weight's gradient is
    summed over tiles). Only the instance's forward is replaced. Returns how many norms."""
    norms = [m for m in model.modules() if _is_rms_norm(m)]
    for norm in norms:
        norm.forward = functools.partial(_recomputed_norm, norm)
    return len(norms)


# -- attention without a [b, 1, T, T] mask ---------------------------------------------------------------------------


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Every row of the [b, L] padding mask is tokens then padding (one host sync)."""
    mask = attention_mask.to(torch.int8)
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def mask_free_sdpa_mask(*, q_length: int, kv_length: int, q_offset=0, mask_function=causal_mask_function,
                        attention_mask: torch.Tensor | None = None, allow_is_causal_skip: bool = True,
                        local_size: int | None = None, **kwargs) -> torch.Tensor | None:
    """transformers' sdpa_mask, except None (SDPA's is_causal) for a plain causal mask over a right-padded batch
    without a cache: its pads follow each sequence's tokens, which the causal mask already keeps from them."""
    if (allow_is_causal_skip and mask_function is causal_mask_function and local_size is None
            and isinstance(q_offset, int) and q_offset == 0 and q_length == kv_length and attention_mask is not None
            and attention_mask.dim() == 2 and attention_mask.shape[-1] == kv_length and right_padded(attention_mask)):
        return None
    return sdpa_mask(q_length=q_length, kv_length=kv_length, q_offset=q_offset, mask_function=mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, local_size=local_size,
                     **kwargs)


AttentionInterface.register(MASK_FREE_SDPA, sdpa_attention_forward)
AttentionMaskInterface.register(MASK_FREE_SDPA, mask_free_sdpa_mask)


def use_mask_free_sdpa(model: torch.nn.Module) -> bool:
    """Switches a transformers model that attends with SDPA to MASK_FREE_SDPA; False (unchanged) for any other."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(MASK_FREE_SDPA)
    return model.config._attn_implementation == MASK_FREE_SDPA


# -- the options -----------------------------------------------------------------------------------------------------


def apply_layer_memory_options(model: torch.nn.Module, mlp_tile_tokens: int | None, lora_inputs: bool,
                               norms: bool = False) -> None:
    """The tiled MLP, the LoRA inputs and the recomputed norms on a loaded policy (after peft has wrapped it)."""
    if mlp_tile_tokens is not None:
        tile_mlps(model, mlp_tile_tokens)
    if lora_inputs:
        recompute_lora_inputs(model)
    if norms:
        recompute_norms(model)

