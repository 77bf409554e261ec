"""The memory plan: each phase's peak device memory predicted from the model's config alone, and the settings that fit.

`fastgrpo plan` prints it, `fastgrpo train` logs it at the start, and `fastgrpo train --auto-fit` applies it: the
largest micro-batch, the KV pool and the loss chunk that fit `gpu_memory`. The model is built on the meta device
(no weights read or allocated), which gives every parameter's shape exactly; the rest are formulas over the shapes,
written out with their derivations in benchmarks/NOTES.md ("Memory plan") and checked against live-tensor traces of
real runs (fastgrpo/bench/memory_trace.py, `fastgrpo bench memory-plan`).

Phases (bytes of live tensors; the CUDA context and allocator slack are the `RESERVE` left out of gpu_memory):
    sampling   weights + trainable state + the KV pool + one engine forward (a token budget) and the sampler
    logprobs   weights + trainable state + the larger of a no-grad micro-batch forward's last layer and the head's
               no-grad chunk with the final hidden states
    train      weights + trainable state + gradients + one micro-batch's checkpointed layer inputs, the recompute of
               one layer in the backward and the fused loss's chunk and gradients, + the optimizer step's states
A layer's terms follow the layer memory options (mlp_tile_tokens, recompute_lora_inputs, mask_free_attention,
recompute_norms: fastgrpo/train/tiling.py), the KV pool kv_cache_dtype (fp8: a byte per value); `auto_fit` states its
order of preference.
Sequences are planned at their longest, as a micro-batch pads to its longest: the training data's longest prompt
(`fastgrpo train`) or max_prompt_length (`fastgrpo plan`, which reads no data), plus max_completion_length.
"""

import math
from dataclasses import dataclass, field

import torch

from fastgrpo.sampling.block_pool import blocks_for, least_pages, most_pages
from fastgrpo.sampling.engine import available_memory
from fastgrpo.sampling.params import EngineConfig
from fastgrpo.sizes import GiB
from fastgrpo.train.config import TrainConfig, train_dtype

# Left out of the device's memory before planning: the CUDA context with cuBLAS, Triton's modules and the decode
# graphs' pools (~0.5-0.8 GiB), NCCL's buffers under torchrun (~0.2 GiB), and the caching allocator's fragmentation
# (a few % of what it holds). 24 GiB leaves 21.8 GiB for tensors, 80 GiB 75.0.
RESERVE_BYTES = GiB
RESERVE_FRACTION = 0.05
NF4_BLOCK, NF4_STATE_BLOCK = 64, 256  # bitsandbytes: 4-bit blocks of 64 weights; double quantization's 256 scales
ADAM8_BLOCK, ADAM8_MIN = 256, 4096  # bitsandbytes' 8-bit AdamW: a scale per 256 values; smaller tensors stay 32-bit
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 8  # fp32 logits, exp, fp64 cdf (fastgrpo/sampling/sampler.py)
ENGINE = EngineConfig()  # the defaults the trainer's engine runs with
CUDA_LOSS_BYTES_PER_LOGIT = 4 + 2  # fp32 logits and the bf16 dZ of a chunk (fastgrpo/chunked.py)
OUTPUT_BYTES_PER_TOKEN = 8 + 4 + 8  # the engine's Outputs per token it may sample: int64 id, fp32 logprob, fp64 uniform
DECODE_ROW_BYTES = 4 * 8  # DecodeBatch's int64 context, last token, output row and count per row (+ its page table)


@dataclass(slots=True)
class Shapes:
    """What the plan needs of a model, read off a meta-device build of its config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    params: int  # every parameter (a tied head once)
    linear_params: int  # the decoder layers' linear weights (what 4-bit quantizes and LoRA adapts)
    linears: list[tuple[int, int]]  # (in, out) of every linear layer in the decoder layers
    linear_inputs: int  # per token, the summed input width of one layer's linears (LoRA dropout copies)
    head_norms: bool = False  # RMSNorms over each head's q and k (Qwen3's q_norm, k_norm)


def model_shapes(model_config) -> Shapes:
    """Shapes of the causal LM `model_config` describes, from a build on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    text = model_config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = next(m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList))
    linears = [(m.in_features, m.out_features) for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    first = [(m.in_features, m.out_features) for m in layers[0].modules() if isinstance(m, torch.nn.Linear)]
    return Shapes(
        layers=len(layers), hidden=text.hidden_size, intermediate=text.intermediate_size, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim, vocab=text.vocab_size,
        tied=bool(getattr(text, "tie_word_embeddings", False) or getattr(model_config, "tie_word_embeddings", False)),
        params=sum(p.numel() for p in model.parameters()), linear_params=sum(i * o for i, o in linears),
        linears=linears, linear_inputs=sum(i for i, _ in first),
        head_norms=any(name.endswith(("q_norm", "k_norm")) for name, _ in layers[0].named_modules()),
    )  # fmt: skip


@dataclass
class Plan:
    """Per phase, its components in bytes; `peak(phase)`, `peak()` (the largest), `fits(gpu_bytes)`."""

    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)  # the micro-batch, KV blocks and loss chunk planned with

    def peak(self, phase: str | None = None) -> int:
        if phase is not None:
            return sum(self.phases[phase].values())
        return max(self.peak(p) for p in self.phases)

    def fits(self, gpu_bytes: int) -> bool:
        return self.peak() <= usable(gpu_bytes)


def usable(gpu_bytes: int) -> int:
    """What of a device's memory live tensors may take: less the context and the allocator's slack."""
    return int(gpu_bytes * (1 - RESERVE_FRACTION)) - RESERVE_BYTES


def dtype_bytes(config: TrainConfig, device_type: str) -> int:
    return train_dtype(config, device_type).itemsize


def kv_bytes(config: TrainConfig, device_type: str) -> int:
    """Bytes of one value in the sampler's KV pages: 1 with kv_cache_dtype fp8, else the model dtype's."""
    return 1 if config.kv_cache_dtype == "fp8" else dtype_bytes(config, device_type)


def weight_bytes(s: Shapes, config: TrainConfig, b: int) -> int:
    """The policy's weights: every parameter in the training dtype, or with load_in_4bit the decoder layers' linear
    weights as NF4 (half a byte each, one uint8 scale per 64 weights and one fp32 scale per 256 scales)."""
    if not config.load_in_4bit:
        return s.params * b
    n = s.linear_params
    quantized = n // 2 + n // NF4_BLOCK + 4 * (n // (NF4_BLOCK * NF4_STATE_BLOCK))
    return (s.params - s.linear_params) * b + quantized


def lora_params(s: Shapes, config: TrainConfig) -> list[int]:
    """Every LoRA tensor's size: A [r, in] and B [out, r] per adapted linear layer ("all-linear": all of them)."""
    r = config.lora_r
    return [n for i, o in s.linears for n in (r * i, o * r)]


def optimizer_bytes(sizes: list[int], config: TrainConfig, b: int) -> int:
    """AdamW's two moments: in the parameters' dtype (PyTorch), or 8-bit with a fp32 scale per 256 values for
    tensors of at least 4096 values (bitsandbytes; smaller tensors keep fp32 moments)."""
    if config.optim == "adamw_8bit":
        return sum(2 * n + 2 * 4 * math.ceil(n / ADAM8_BLOCK) if n >= ADAM8_MIN else 2 * 4 * n for n in sizes)
    return sum(2 * b * n for n in sizes)


def loss_chunk(s: Shapes, config: TrainConfig, device_type: str, chunk_tokens: int | None) -> int:
    """The fused loss's chunk (fastgrpo.chunked.chunk_tokens): on CUDA ~2 GiB of fp32 logits + bf16 dZ, on a CPU
    32 MiB of fp32 logits and at least 256 tokens."""
    from fastgrpo.chunked import chunk_tokens as default

    return chunk_tokens or default(s.vocab, torch.device(device_type))


def _lora_dropout_bytes(config: TrainConfig) -> int:
    """Bytes of peft's dropout mask per LoRA input value: 1 with dropout (a bool mask), else 0."""
    return 1 if config.lora_dropout > 0 else 0


# torch's dropout off CUDA (at::_dropout_impl, what the fake-CPU traces run) multiplies its input by an fp32 noise
# tensor of the input's shape, alive with the dropped-out copy; CUDA's fused native_dropout writes a bool mask (1 byte)
# instead. The moments below take the traces' 4 bytes, the higher.
DROPOUT_NOISE_BYTES = 4
# RMSNorm's backward (transformers' Qwen2/Qwen3/Llama RMSNorm: x32 = x.float(); x32 * rsqrt(mean(x32^2) + eps)) at
# its PowBackward: besides the fp32 input its pow and mul keep, five fp32 [T, H] tensors: the mul's gradient to x32
# (held for the sum), mean's expanded gradient, x32^1 and 2 x32 of pow's derivative, and their product
RMSNORM_BACKWARD_FP32 = 5


def _norm_tile_rows(width: int, tokens: int) -> int:
    """Rows of one tile of a recomputed norm (recompute_norms) over `tokens` rows of `width` values: its backward
    (and a no-grad norm) runs tiling.norm_tile_rows(width) rows at a time (tiling._recomputed_norm), so its fp32 copy
    and temporaries exist for one tile only."""
    from fastgrpo.train.tiling import norm_tile_rows

    return min(tokens, norm_tile_rows(width))


def _lora_a_input_bytes(config: TrainConfig) -> int:
    """fp32 bytes per input value at an adapted layer's lora_A in a training forward: the input cast to the fp32
    adapter's dtype (peft's cast, or LoRAInput's) and, with dropout, the noise and the dropped-out copy."""
    return 4 + (2 * DROPOUT_NOISE_BYTES if config.lora_dropout > 0 else 0)


def layer_saved_per_token(s: Shapes, config: TrainConfig, b: int) -> int:
    """What a layer's recompute keeps for its backward, per token: attention_saved_per_token and mlp_saved_per_token."""
    return attention_saved_per_token(s, config, b) + mlp_saved_per_token(s, config, b)


def attention_saved_per_token(s: Shapes, config: TrainConfig, b: int) -> int:
    """What a recomputed layer keeps for the backward of its input norm and attention, per token: the normed input
    (q/k/v's input), the rotated q and SDPA's output (o_proj's input), v and the rotated k (b (H + 2 q + 2 kv)); the
    norms' inputs (_norms_saved_per_token); SDPA's fp32 logsumexp (4 per head); k and v repeated to every query head
    (2 q b: SDPA with a padding mask and GQA, so not with mask_free_attention). With LoRA the fp32 [r] outputs of
    q/k/v/o's lora_A (kept by lora_B), and without recompute_lora_inputs peft's fp32, dropped-out inputs of q, k, v
    (a copy each) and o, 4 + d bytes per value. (The residual is not kept: its add saves nothing.)"""
    q, kv, H = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    repeated = 2 * q if s.kv_heads < s.heads and not config.mask_free_attention else 0
    norms = _norms_saved_per_token(s, config, b)
    per_token = b * (H + 2 * q + 2 * kv + repeated) + norms + 4 * s.heads
    if config.use_peft:
        per_token += 4 * config.lora_r * 4
        if not config.recompute_lora_inputs:
            per_token += (4 + _lora_dropout_bytes(config)) * (3 * H + q)
    return per_token


def _norms_saved_per_token(s: Shapes, config: TrainConfig, b: int) -> int:
    """What a recomputed layer's input norm and (Qwen3) per-head q/k norms keep for their backward, per token.

    transformers' RMSNorm: the fp32 input (4 H, kept by its pow and mul: in bf16 a copy, in fp32 the input itself),
    with per-head q/k norms theirs (4 (q + kv)), and each norm's fp32 rsqrt per row (per head for q/k).

    recompute_norms (tiling._recomputed_norm): each keeps its input as it comes, nothing fp32. The q/k norms' inputs
    are q_proj's and k_proj's outputs ((q + kv) b; else freed once the fp32 copy is made). The input norm's is the
    layer's input (H b): with offload_activations the copy fetched back for the recompute, otherwise freed once the
    recompute is done (the prefetched next layer's is checkpointed layer inputs' own), and without checkpointing the
    previous layer's output; checkpointed without offload, the checkpoint's own kept input (counted there)."""
    q, kv, H = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    if not config.recompute_norms:
        return 4 * (H + 1) + (4 * (q + kv + s.heads + s.kv_heads) if s.head_norms else 0)  # fp32 inputs, rsqrt
    layer_input = not config.gradient_checkpointing or config.offload_activations
    return (H * b if layer_input else 0) + ((q + kv) * b if s.head_norms else 0)


def _post_attention_norm_saved_per_token(config: TrainConfig, H: int, b: int) -> int:
    """What the post-attention norm keeps, per token: its fp32 input and rsqrt (4 (H + 1)), or with recompute_norms
    its input as it comes, the residual sum (H b; the MLP's residual add saves nothing, so nothing else keeps it)."""
    return H * b if config.recompute_norms else 4 * (H + 1)


def mlp_saved_per_token(s: Shapes, config: TrainConfig, b: int) -> int:
    """What a recomputed layer keeps for its post-attention norm and MLP, per token: the norm's input
    (_post_attention_norm_saved_per_token) and its output, the MLP's input (H b: kept by the tiled MLP, or by
    gate/up); untiled also SwiGLU's gate, up, SiLU(gate) and product (4 I b: the product is down's input), and with
    LoRA the fp32 [r] outputs of gate/up/down's lora_A and without recompute_lora_inputs peft's fp32, dropped-out inputs
    of gate, up (a copy each) and down. Tiled, all the [T, I] terms live in one tile of the backward
    (layer_backward_bytes)."""
    H, inter = s.hidden, s.intermediate
    per_token = _post_attention_norm_saved_per_token(config, H, b) + b * H  # the norm's input, the MLP's input
    if config.mlp_tile_tokens is None:
        per_token += 4 * inter * b
        if config.use_peft:
            per_token += 4 * config.lora_r * 3
            if not config.recompute_lora_inputs:
                per_token += (4 + _lora_dropout_bytes(config)) * (2 * H + inter)
    return per_token


def layer_mask_bytes(config: TrainConfig, micro_batch: int, T: int, b: int) -> int:
    """The [m, 1, T, T] boolean padding mask and SDPA's additive copy of it, kept by a layer's attention for its
    backward: a padded micro-batch (more than one sequence, planned at its longest) without mask_free_attention."""
    if config.mask_free_attention or micro_batch == 1:
        return 0
    return micro_batch * T * T * (1 + b)


def layer_backward_bytes(s: Shapes, config: TrainConfig, b: int, tokens: int) -> int:
    """One layer's backward over `tokens` tokens besides the checkpointed inputs (with offload: the first layer's
    input, which peft's input gradient keeps, and the next layer's prefetched one; the recomputed input itself is
    kept by nothing once the recompute is done but a recomputed input norm, see _norms_saved_per_token), the largest
    of three moments. All hold the recomputed layer's attention_saved_per_token and the gradient of the layer's output
    (H b, held for the residual branch).

    MLP (down_proj's lora_A backward): mlp_saved_per_token and the gradient of the MLP's input (H b, the tiled MLP's
    grad_x or down's output gradient), then over the MLP's tokens (one tile's, tiled): the recomputed SwiGLU (tiled:
    gate, up, SiLU(gate) and product, 4 I b), the gradient of down's input (I b) and with LoRA lora_A's recomputed fp32
    input, its dropout noise and its gradient (8 + noise bytes per I; with recompute_lora_inputs, LoRAInput's
    _Recomputed); without it peft's fp32 inputs of gate, up and down in the tile (tiled); full fine-tuning the gate,
    up and down weights' gradients of a tile in the compute dtype. Past one tile, three [tile, H] tensors more: the
    tile's recomputed output and two gradients of it.

    Post-attention norm (its PowBackward): its fp32 input and RMSNORM_BACKWARD_FP32 fp32 [T, H] temporaries, the MLP
    done (its saved tensors freed). What a tiled layer peaks at past ~4 tiles (Qwen3-8B at 2 x 110K tokens). With
    recompute_norms (its _Recomputed backward) only over one tile of the norm (_norm_tile_rows): the norm's kept input,
    the MLP input's gradient it receives and the grad_x it fills (3 H b per token), then the tile's fp32 copy, its
    temporaries and its recomputed output (4 + 4 RMSNORM_BACKWARD_FP32 + b per value): under the MLP's moment but for
    a few thousand tokens (one norm tile, about an MLP tile).

    Attention (o_proj's lora_A backward, the first of the attention's backward: everything it saved still live):
    besides the output's gradient, the gradient of o_proj's base output waiting for its backward (peft sums the base
    output and the fp32 adapter's in fp32 and casts back, so its bf16 gradient is a cast copy; H b), then over o_proj's
    input (q) lora_A's gradient in fp32 (4), with recompute_lora_inputs LoRAInput's recomputed fp32 input (dropped
    out: the noise and the copy, or the cast itself; 4 + noise) and the grad_x it fills (b), without it the dropout's
    backward in fp32 (peft's input is saved already; 4) and the cast's gradient (b); full fine-tuning o_proj's weight
    gradient (H q b) and its input's (q b). Past ~4 tiles with recompute_norms (Qwen3-8B at 2 x 110K tokens) the
    peak."""
    H, inter = s.hidden, s.intermediate
    tile = tokens if config.mlp_tile_tokens is None else min(config.mlp_tile_tokens, tokens)
    tiled = config.mlp_tile_tokens is not None
    common = tokens * (attention_saved_per_token(s, config, b) + b * H)
    lora = (8 + (DROPOUT_NOISE_BYTES if config.lora_dropout > 0 else 0)) * inter if config.use_peft else 0
    if config.use_peft and tiled and not config.recompute_lora_inputs:
        lora += (4 + _lora_dropout_bytes(config)) * (2 * H + inter)
    mlp = common + tokens * (mlp_saved_per_token(s, config, b) + b * H) + tile * (
        (4 * b if tiled else 0) * inter + b * inter + lora)
    if tiled and tile < tokens:
        mlp += 3 * tile * H * b
    if not config.use_peft:
        mlp += 3 * H * inter * b
    if config.recompute_norms:
        norm = common + 3 * tokens * H * b + _norm_tile_rows(H, tokens) * (4 + 4 * RMSNORM_BACKWARD_FP32 + b) * H
    else:
        norm = common + tokens * (4 + 4 * RMSNORM_BACKWARD_FP32) * H
    q = s.heads * s.head_dim
    if config.use_peft:
        noise = DROPOUT_NOISE_BYTES if config.lora_dropout > 0 else 0
        attention = common + tokens * (H * b + q * (4 + (4 + noise if config.recompute_lora_inputs else 4) + b))
    else:
        attention = common + tokens * q * b + H * q * b
    return max(mlp, norm, attention)


def train_forward_bytes(s: Shapes, config: TrainConfig, b: int, tokens: int) -> int:
    """A layer's training forward (checkpointed: nothing saved) over `tokens` tokens besides the checkpointed inputs
    (which hold the layer's input, the residual), the larger of two moments:

    MLP: the residual sum and the MLP's input (2 H b per token), past one tile the tiled output and the previous
    tile's (held by _tiled_output's loop until the next is formed; H b per token, and per tile token); then per token
    of one tile (untiled: of all) the larger of down_proj's lora_A (SwiGLU's product, down's base output, and
    _lora_a_input_bytes per I) and up_proj's LoRA sum (SiLU(gate), up's base output, lora_B's scaled fp32 output and
    the fp32 sum: 2 I b + 8 I); without LoRA, SwiGLU's product formed beside SiLU(gate) and up (3 I b).

    Attention (o_proj's lora_A): the normed input, the rotated q, SDPA's output, o_proj's base output, v and the
    rotated k (b (2 H + 2 q + 2 kv)) and o_proj's fp32 input copies (_lora_a_input_bytes per q), the padding mask
    (layer_mask_bytes, not per token) aside."""
    q, kv, H, inter = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.intermediate
    tile = tokens if config.mlp_tile_tokens is None else min(config.mlp_tile_tokens, tokens)
    if config.use_peft:
        down = b * inter + b * H + _lora_a_input_bytes(config) * inter
        up = 2 * b * inter + 8 * inter
    else:
        down, up = b * inter + b * H, 3 * b * inter
    mlp = 2 * tokens * H * b + tile * max(down, up)
    if tile < tokens:
        mlp += tokens * H * b + tile * H * b
    attention = tokens * (b * (2 * H + 2 * q + 2 * kv) + (_lora_a_input_bytes(config) * q if config.use_peft else 0))
    return max(mlp, attention)


def layer_forward_bytes(s: Shapes, config: TrainConfig, b: int, tokens: int, training: bool) -> int:
    """A layer's forward over `tokens` tokens besides its input: a training one's (train_forward_bytes), or without
    grad the larger of the attention's moment at o_proj (attention_forward_per_token) and the MLP's
    (mlp_forward_bytes); logprobs_forward_bytes adds what the decoder holds around it."""
    if training:
        return train_forward_bytes(s, config, b, tokens)
    return max(tokens * attention_forward_per_token(s, config, b), mlp_forward_bytes(s, config, b, tokens))


def _fp32_copy_bytes(b: int) -> int:
    """Bytes per value of an input cast to the fp32 adapter (or norm) dtype: 4, or none in fp32 (`.to` copies
    nothing)."""
    return 4 if b < 4 else 0


def attention_forward_per_token(s: Shapes, config: TrainConfig, b: int) -> int:
    """Live in a layer's attention without grad at o_proj (with LoRA its adapter's sum), per token, besides the
    layer's input: the normed input (q/k/v's input, held by the decoder layer), the rotated q and k, v (held by the
    attention until it returns), SDPA's output and o_proj's base output (b (2 H + 2 q + 2 kv)); with LoRA lora_B's
    fp32 output and its scaled copy (then the fp32 sum; 8 H) and without recompute_lora_inputs peft's fp32 copy of
    o_proj's input, held through the sum (LoRAInput's is gone after lora_A). With LoRA the attention's other moments
    are lower (q/k/v's sums and the rotation hold fewer tensors; SDPA with a padding mask is logprobs_forward_bytes');
    without it q's rotation or Qwen3's fp32 q norm holds up to ~2 q b more, under the MLP's 2 H b + 3 I b (I > H)."""
    q, kv, H = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    per_token = b * (2 * H + 2 * q + 2 * kv)
    if config.use_peft:
        per_token += 8 * H + (_fp32_copy_bytes(b) * q if not config.recompute_lora_inputs else 0)
    return per_token


def mlp_forward_bytes(s: Shapes, config: TrainConfig, b: int, tokens: int) -> int:
    """A layer's MLP without grad over `tokens` tokens besides the layer's input: the residual sum (held for the
    layer's last add) and the MLP's input (2 H b per token); past one tile the tiled output and the previous tile's
    (held by _tiled_output's loop until the next is formed; H b per token, and per tile token); then per token of one
    tile (untiled: of all) the larger of
      up_proj's sum: SiLU(gate), up's base output (2 I b) and with LoRA lora_B's fp32 output and its scaled copy (8 I)
        and without recompute_lora_inputs peft's fp32 copy of up's input (held through the sum);
      down_proj's: SwiGLU's product and down's base output (I b + H b), with LoRA the fp32 cast of the product (lora_A's
        input, 4 I) and the fp32 lora_B output and its scaled copy (8 H): peft holds its cast through the sum,
        LoRAInput's is gone after lora_A.
    Without LoRA, SwiGLU's product formed beside SiLU(gate) and up (3 I b). (gate_proj's sum holds one [T, I] less
    than up_proj's.)"""
    H, inter = s.hidden, s.intermediate
    tile = tokens if config.mlp_tile_tokens is None else min(config.mlp_tile_tokens, tokens)
    if config.use_peft:
        cast = _fp32_copy_bytes(b)
        peft_cast = not config.recompute_lora_inputs
        up = 2 * b * inter + 8 * inter + (cast * H if peft_cast else 0)
        down = b * inter + b * H + (cast * inter + 8 * H if peft_cast else max(cast * inter, 8 * H))
    else:
        up, down = 3 * b * inter, b * inter + b * H
    mlp = 2 * tokens * H * b + tile * max(up, down)
    if tile < tokens:
        mlp += tokens * H * b + tile * H * b
    return mlp


def logprobs_forward_bytes(s: Shapes, config: TrainConfig, b: int, micro_batch: int, T: int) -> int:
    """The no-grad backbone's peak over a micro-batch of `micro_batch` sequences padded to T tokens, at its last
    layer: what the decoder holds through its layers, the embeddings' output (the decoder's inputs_embeds, kept to
    its end) and the layer's input (held by the decoder's loop while the layer runs; in a one-layer model the same
    tensor), the rotary cos and sin ([1, T, head_dim] each: the sequences share positions) and, for a padded
    micro-batch without mask_free_attention, the [m, 1, T, T] boolean mask; plus the larger of the layer's moments
    (layer_forward_bytes) and, with that mask, SDPA's: the normed input, the rotated q and k, v, K and V repeated to
    every query head (2 q b, with GQA), the mask's additive copy in the compute dtype (m T^2 b), SDPA's output and
    fp32 logsumexp (4 per head). (The final norm's moment, the last output and its fp32 copies, is lower.)"""
    q, kv, H = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    tokens = micro_batch * T
    padded = micro_batch > 1 and not config.mask_free_attention
    held = tokens * H * b * (2 if s.layers > 1 else 1) + 2 * T * s.head_dim * b + (micro_batch * T * T if padded else 0)
    layer = layer_forward_bytes(s, config, b, tokens, training=False)
    if padded:
        repeated = 2 * q if s.kv_heads < s.heads else 0
        sdpa = tokens * (b * (H + 2 * q + 2 * kv + repeated) + 4 * s.heads) + micro_batch * T * T * b
        layer = max(layer, sdpa)
    return held + layer


def layer_forward_per_token(s: Shapes, config: TrainConfig, b: int, training: bool) -> int:
    """Per token of the sampling engine's prefill forward (untiled): SwiGLU's four [T, I] tensors at the down
    projection, and with LoRA its input in fp32."""
    lora = (4 + (_lora_dropout_bytes(config) if training else 0)) if config.use_peft else 0
    return (4 * b + lora) * s.intermediate


def plan_memory(config: TrainConfig, model_config=None, *, device_type: str = "cuda", micro_batch: int | None = None,
                kv_blocks: int | None = None, chunk_tokens: int | None = None, shapes: Shapes | None = None,
                prompt_length: int | None = None) -> Plan:
    """The plan of `config` (its model's config read from model_name_or_path unless given), for prompts of
    `prompt_length` tokens (default max_prompt_length, or 512 without one)."""
    if shapes is None:
        if model_config is None:
            from fastgrpo.train.loading import model_config as read_model_config

            model_config = read_model_config(config)
        shapes = model_shapes(model_config)
    s, b = shapes, dtype_bytes(config, device_type)
    kv_blocks = config.kv_cache_blocks if kv_blocks is None else kv_blocks
    chunk_tokens = config.loss_chunk_tokens if chunk_tokens is None else chunk_tokens
    mb = micro_batch or config.per_device_train_batch_size
    prompt = prompt_length or config.max_prompt_length or 512
    T = prompt + config.max_completion_length
    tokens = mb * T
    chunk = min(loss_chunk(s, config, device_type, chunk_tokens), mb * config.max_completion_length)
    layer_input = tokens * s.hidden * b  # one decoder layer's input: what a checkpoint keeps

    weights = {"weights": weight_bytes(s, config, b)}
    if config.beta != 0 and not config.use_peft:
        weights["reference weights"] = s.params * b
    if config.use_peft:
        sizes = lora_params(s, config)
        trainable = {"LoRA weights (fp32)": 4 * sum(sizes), "optimizer states": optimizer_bytes(sizes, config, 4)}
        grads = 4 * sum(sizes)
    else:
        sizes = [s.params]  # one tensor per parameter in fact; the 8-bit rule counts per tensor, see optimizer_bytes
        trainable = {"optimizer states": optimizer_bytes(sizes, config, b)}
        grads = s.params * b
    resident = {**weights, **trainable}

    # sampling: the KV pool (pages of block_size tokens, prompts shared within a group, one scratch page): every
    # group at full length at once, or kv_blocks; auto_fit cuts it to what fits, down to one prompt's pages and one
    # completion's (the engine runs a group's completions one by one if it must). Then the larger of a prefill
    # forward (max_num_batched_tokens) and a decode step (a token per running sequence)
    G, P = config.num_generations, config.generation_batch_size // config.num_generations
    bs = config.block_size
    needed = P * most_pages(prompt, G, config.max_completion_length, bs)
    least = least_pages(prompt, G, config.max_completion_length, bs)
    blocks = needed if kv_blocks is None else kv_blocks  # the engine allocates kv_cache_blocks pages as given
    rows = min(ENGINE.max_num_seqs, config.generation_batch_size)
    kv = (blocks + 1) * kv_block_bytes(s, bs, kv_bytes(config, device_type))
    if config.kv_cache_dtype == "fp8":
        kv += s.layers * 2 * s.kv_heads * 4  # each layer's K and V scales, fp32 per KV head
    prefill_tokens = min(ENGINE.max_num_batched_tokens, P * prompt + rows)
    prefill = prefill_tokens * layer_forward_per_token(s, config, b, training=False)
    capacity = max(min(ENGINE.max_num_seqs, ENGINE.max_num_batched_tokens), G)  # the engine's DecodeBatch rows
    buffers = (config.generation_batch_size * config.max_completion_length * OUTPUT_BYTES_PER_TOKEN
               + capacity * (4 * blocks_for(T, bs) + DECODE_ROW_BYTES))
    sampling = {**resident, "KV pool": kv, "output buffers": buffers,
                "engine forward": max(prefill, rows * 2 * s.hidden * b), "sampler": sampler_bytes(s, rows)}

    # no-grad logprobs (eval mode): the larger of two moments, never live together. The backbone at its last layer
    # (logprobs_forward_bytes); then, the backbone returned, the head: the rows completion_hidden gathers (the final
    # norm's output and the embeddings are freed), the fp32 logprobs the chunks write, and one chunk's fp32 logits
    # (CUDA: one GEMM writing fp32; a CPU forms them a vocab block at a time, so this is its upper bound)
    completion_tokens = mb * config.max_completion_length
    forward_no_grad = logprobs_forward_bytes(s, config, b, mb, T)
    head_rows, head_chunk = completion_tokens * (s.hidden * b + 4), chunk * s.vocab * 4
    if forward_no_grad >= head_rows + head_chunk:
        logprobs = {**resident, "forward (no grad)": forward_no_grad}
    else:
        logprobs = {**resident, "final hidden states": head_rows, "loss chunk": head_chunk}

    # train: the checkpointed layer inputs (offloaded: the last one's, which the next layer's prefetched input
    # replaces in the backward, and with LoRA the first one's, which peft's input gradient keeps alive), then the
    # largest of the forward's last layer (train_forward_bytes), the fused loss and the backward of one layer
    # (layer_backward_bytes: the final hidden states are freed by then)
    if not config.gradient_checkpointing:
        kept = 0
    elif config.offload_activations:
        kept = 2 if config.use_peft else 1
    else:
        kept = s.layers
    stored = {**resident, "gradients": grads, "checkpointed layer inputs": kept * layer_input}
    mask = layer_mask_bytes(config, mb, T, b)
    if not config.gradient_checkpointing:
        stored["layer activations"] = s.layers * (tokens * layer_saved_per_token(s, config, b) + mask)
    backward = layer_backward_bytes(s, config, b, tokens) + mask
    # the loss: the final norm's input in fp32 (kept by its pow and mul: a copy in bf16, the input itself in fp32;
    # its bf16 input and output are freed), with recompute_norms its input as it comes (the last layer's output, b
    # bytes), and over the completion tokens the rows completion_hidden gathers, the fused loss's selected rows x and
    # its dX (grpo_head.grpo_head_loss, HeadGrads); then a chunk's fp32 logits and bf16 dZ, and GEMM 2's dX of the
    # chunk (fastgrpo/chunked.py)
    final_norm = b if config.recompute_norms else 4
    final = final_norm * tokens * s.hidden + 3 * completion_tokens * s.hidden * b
    loss_bytes = chunk * (s.vocab * (CUDA_LOSS_BYTES_PER_LOGIT if device_type == "cuda" else 8) + s.hidden * b)
    if not config.use_peft:
        loss_bytes += s.vocab * s.hidden * 4  # dW accumulated in fp32
    forward = layer_forward_bytes(s, config, b, tokens, training=True) + mask
    phases = {"sampling": sampling, "logprobs": logprobs,
              "train: forward": {**stored, "layer forward": forward},
              "train: loss": {**stored, "final hidden states": final, "loss chunk": loss_bytes},
              "train: backward": {**stored, "layer backward": backward},
              "train: optimizer step": {**resident, "gradients": grads, "update temporaries": grads}}
    return Plan(phases, {"per_device_train_batch_size": mb, "kv_blocks": blocks, "kv_blocks_needed": needed,
                         "kv_blocks_least": least, "kv_cache_dtype": config.kv_cache_dtype,
                         "mlp_tile_tokens": config.mlp_tile_tokens,
                         "loss_chunk_tokens": chunk, "chunk_override": chunk_tokens,
                         "samples_per_step": config.per_device_train_batch_size * config.gradient_accumulation_steps})


def kv_block_bytes(s: Shapes, block_size: int, b: int) -> int:
    """One page of the paged KV pool: K and V of block_size tokens in every layer."""
    return 2 * s.layers * block_size * s.kv_heads * s.head_dim * b


def check_kv_cache_blocks(config: TrainConfig, shapes: Shapes, device: torch.device, prompt_lengths: list[int],
                          eval_prompt_lengths: list[int]) -> None:
    """kv_cache_blocks, when given, against what sampling needs and the memory there is, before anything is
    allocated: the engine would refuse too few pages only at its first call (the first evaluation), and a pool larger
    than memory grows the process (its page lists first, 48 bytes a page: 48 GB for 1e9) until the kernel kills it."""
    blocks = config.kv_cache_blocks
    if blocks is None:
        return
    bs, G, m = config.block_size, config.num_generations, config.max_completion_length
    needed = max([least_pages(t, G, m, bs) for t in set(prompt_lengths)]
                 + [least_pages(t, 1, m, bs) for t in set(eval_prompt_lengths)])  # evaluation: one completion each
    if blocks < needed:
        raise ValueError(f"kv_cache_blocks {blocks} is too few: sampling needs a prompt's pages and one completion's "
                         f"(of up to max_completion_length {m} tokens; the num_generations {G} completions can run one "
                         f"after another), {needed} pages of {bs} tokens; give at least {needed}, or leave it unset to "
                         "size the pool from sampling_memory_fraction")
    page = kv_block_bytes(shapes, bs, kv_bytes(config, device.type))
    available = available_memory(device)
    if available is not None and (blocks + 1) * page > available:  # one scratch page past the pool
        where = f"free on {device}" if device.type == "cuda" else "MemAvailable in /proc/meminfo"
        raise ValueError(f"kv_cache_blocks {blocks} is too many: the KV pool would take "
                         f"{(blocks + 1) * page / GiB:.1f} GiB ({page} bytes a page), and {available / GiB:.1f} GiB "
                         f"is available ({where}); at most {available // page - 1} pages fit there, before the model "
                         "and the training step take theirs; or leave it unset to size the pool from "
                         "sampling_memory_fraction")


def sampler_bytes(s: Shapes, rows: int) -> int:
    """The sampler's [rows, V] passes: fp32 logits, their exp and the fp64 cumulative sum."""
    return rows * s.vocab * SAMPLER_BYTES_PER_LOGIT


# Tiles auto_fit tries, largest first: a [tile, I] tensor of Qwen2.5-7B (I 18944) in bf16 is 0.6 GiB at 16384 tokens.
# None under 1024: a smaller micro-batch is preferred to them (each tile launches its own kernels, ~20 per MLP with
# LoRA, and GEMMs of fewer rows than the hidden size; 520 tiles a layer at 4 x 33K tokens and tiles of 256).
MLP_TILES = (16384, 8192, 4096, 2048, 1024)
LOSS_CHUNKS = (None, 4096, 1024, 256)  # None: fastgrpo.chunked's default (~2 GiB of logits on CUDA)


def auto_fit(config: TrainConfig, gpu_bytes: int, shapes: Shapes, device_type: str = "cuda",
             prompt_length: int | None = None) -> Plan:
    """The fastest settings whose plan fits, tried in this order of preference (each later choice costs less speed
    than an earlier one, so it is given up first):

    1. the largest micro-batch (a divisor of the samples per optimizer step, so the update is the same);
    2. the MLP untiled (or config.mlp_tile_tokens when given), else the largest tile of MLP_TILES (smaller ones after;
       tiling recomputes nothing more under checkpointing, but small tiles run small GEMMs and more launches);
    3. the default loss chunk, else 4096, 1024, 256 tokens;
    4. the KV pool of a whole round (every completion at full length at once); if sampling is over budget, as many
       pages as fit (the engine runs the round in waves, preempting by recompute), down to the least pool, a prompt's
       pages and one completion's (completions one after another).

    ValueError, naming what would fit, when even micro-batch 1 with the smallest tile and chunk does not."""
    import dataclasses

    step = config.per_device_train_batch_size * config.gradient_accumulation_steps
    limit = usable(gpu_bytes)
    given = config.mlp_tile_tokens
    tiles = (given, *(t for t in MLP_TILES if given is not None and t < given)) if given else (None, *MLP_TILES)
    for mb in sorted((d for d in range(1, step + 1) if step % d == 0), reverse=True):
        for tile in tiles:
            trial = config if tile == given else dataclasses.replace(config, mlp_tile_tokens=tile)
            for chunk in LOSS_CHUNKS:
                plan = plan_memory(trial, device_type=device_type, micro_batch=mb, chunk_tokens=chunk, shapes=shapes,
                                   prompt_length=prompt_length)
                if max(plan.peak(p) for p in plan.phases if p != "sampling") > limit:
                    continue
                over = plan.peak("sampling") - limit
                if over > 0:  # fewer KV pages: the engine then runs the round in waves (preemption by recompute)
                    per_block = plan.phases["sampling"]["KV pool"] // (plan.settings["kv_blocks"] + 1)
                    blocks = plan.settings["kv_blocks"] - math.ceil(over / per_block)
                    if blocks < plan.settings["kv_blocks_least"]:
                        continue
                    plan = plan_memory(trial, device_type=device_type, micro_batch=mb, chunk_tokens=chunk,
                                       kv_blocks=blocks, shapes=shapes, prompt_length=prompt_length)
                return plan
    smallest = plan_memory(dataclasses.replace(config, mlp_tile_tokens=tiles[-1]), device_type=device_type,
                           micro_batch=1, chunk_tokens=256, shapes=shapes, prompt_length=prompt_length)
    raise ValueError(
        f"gpu_memory: {gpu_bytes / GiB:.1f} GiB ({limit / GiB:.1f} GiB for tensors) cannot fit even "
        f"per_device_train_batch_size 1: it needs {smallest.peak() / GiB:.1f} GiB ({describe_peak(smallest)}); "
        + what_would_fit(config, shapes, device_type, gpu_bytes))


def plan_run(config: TrainConfig, shapes: Shapes, device_type: str, gpu_bytes: int | None,
             prompt_length: int | None = None) -> Plan:
    """The plan `fastgrpo train` and `fastgrpo plan` act on: auto_fit's with config.auto_fit (which needs
    gpu_bytes), else the plan of the config as it is."""
    if not config.auto_fit:
        return plan_memory(config, shapes=shapes, device_type=device_type, prompt_length=prompt_length)
    if gpu_bytes is None:
        raise ValueError("auto_fit: give gpu_memory (e.g. --gpu-memory 24GiB), the device memory to fit")
    return auto_fit(config, gpu_bytes, shapes, device_type, prompt_length=prompt_length)


def fitted(config: TrainConfig, plan: Plan) -> dict:
    """The options an auto_fit plan sets: the micro-batch (accumulation and steps per generation scaled to keep the
    samples per optimizer step and per round), and the KV pages, loss chunk and MLP tile where it cut them."""
    mb, step = plan.settings["per_device_train_batch_size"], plan.settings["samples_per_step"]
    changes = {"per_device_train_batch_size": mb, "gradient_accumulation_steps": step // mb,
               "steps_per_generation": config.generation_batch_size // mb}
    if plan.settings["kv_blocks"] != plan.settings["kv_blocks_needed"]:  # cut, or the user's own pool size
        changes["kv_cache_blocks"] = plan.settings["kv_blocks"]
    if plan.settings["chunk_override"]:
        changes["loss_chunk_tokens"] = plan.settings["chunk_override"]
    if plan.settings["mlp_tile_tokens"] != config.mlp_tile_tokens:
        changes["mlp_tile_tokens"] = plan.settings["mlp_tile_tokens"]
    return changes


def what_would_fit(config: TrainConfig, shapes: Shapes, device_type: str, gpu_bytes: int) -> str:
    """The memory options not yet on, added one by one until one fits, with the micro-batch-1 peak of each (and
    whether it fits)."""
    import dataclasses

    steps = [{"use_peft": True}, {"load_in_4bit": True}, {"offload_activations": config.gradient_checkpointing},
             {"mlp_tile_tokens": min(config.mlp_tile_tokens or MLP_TILES[-1], MLP_TILES[-1])},
             {"max_completion_length": max(1, config.max_completion_length // 2)}]
    changes, said = {}, []
    for step in steps:
        if all(getattr(config, k) == v for k, v in step.items()):
            continue
        changes |= step
        trial = dataclasses.replace(config, **changes)
        peak = plan_memory(trial, device_type=device_type, micro_batch=1, chunk_tokens=256, shapes=shapes).peak()
        flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in changes.items())
        said.append(f"{flags}: {peak / GiB:.1f} GiB" + (" (fits)" if peak <= usable(gpu_bytes) else ""))
        if peak <= usable(gpu_bytes):
            break
    return "with " + "; with ".join(said) if said else "no memory option is left to try: a larger GPU is needed"


def describe_peak(plan: Plan) -> str:
    phase = max(plan.phases, key=plan.peak)
    parts = sorted(plan.phases[phase].items(), key=lambda kv: -kv[1])[:3]
    return f"{phase}: " + ", ".join(f"{name} {n / GiB:.1f}" for name, n in parts)


def format_plan(plan: Plan, gpu_bytes: int | None = None) -> str:
    """The plan as a table: one column per phase, one row per component (GiB)."""
    names = list(dict.fromkeys(name for parts in plan.phases.values() for name in parts))
    phases = list(plan.phases)
    widths = [max(len(p), 6) + 2 for p in phases]  # each column as wide as its phase's name
    lines = [f"{'GiB':<28}" + "".join(f"{p:>{w}}" for p, w in zip(phases, widths, strict=True))]
    for name in names:
        cells = [plan.phases[p].get(name) for p in phases]
        lines.append(f"{name:<28}" + "".join(f"{'':>{w}}" if c is None else f"{c / GiB:>{w}.2f}"
                                             for c, w in zip(cells, widths, strict=True)))
    lines.append(f"{'peak':<28}" + "".join(f"{plan.peak(p) / GiB:>{w}.2f}" for p, w in zip(phases, widths,
                                                                                         strict=True)))
    shown = ("per_device_train_batch_size", "kv_blocks", "kv_blocks_needed", "loss_chunk_tokens", "mlp_tile_tokens")
    settings = ", ".join(f"{k} {plan.settings[k]}" for k in shown)
    lines.append(f"planned with {settings}")
    blocks, needed, least = (plan.settings[k] for k in ("kv_blocks", "kv_blocks_needed", "kv_blocks_least"))
    if blocks < needed:
        lines.append(f"KV pool: {blocks} of the {needed} pages a whole round takes at full length: the engine runs as "
                     f"many completions as fit and preempts the rest (they recompute), at least {least} pages (one "
                     "completion at a time)" + ("" if plan.settings["kv_cache_dtype"] == "fp8" else
                                                "; --kv-cache-dtype fp8 holds twice the pages in the same bytes"))
    if gpu_bytes is not None:
        verdict = "fits" if plan.fits(gpu_bytes) else "does NOT fit"
        lines.append(f"{verdict} in {gpu_bytes / GiB:.1f} GiB ({usable(gpu_bytes) / GiB:.1f} GiB for tensors after "
                     f"the CUDA context and allocator slack); peak {plan.peak() / GiB:.2f} GiB ({describe_peak(plan)})")
    return "\n".join(line.rstrip() for line in lines)
