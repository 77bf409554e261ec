"""What one decoder layer holds, in bytes, at each moment of a training micro-batch and of a no-grad forward: the
memory plan's layer terms (fastgrpo/train/plan.py sums them into phases).

Every function takes the model's Shapes `s`, one layer's LayerShape `l` (fastgrpo/train/shapes.py), the TrainConfig
and `b`, the compute dtype's bytes; the plan evaluates each moment for every kind of layer and takes the largest.
The terms were derived from the code (transformers' layers, peft, fastgrpo/train/tiling.py) and each moment was found
in fake-tensor traces of the real thing (fastgrpo/bench/memory_trace.py): Llama/Qwen's in benchmarks/NOTES.md
("Memory plan"), the 2026 families' (windows, sinks, eager attention, experts, Gemma's norms and per-layer inputs) in
benchmarks/results/memory-plan-families-2026-11-28.md. Notation, per token: H hidden, q = heads x head_dim, k and
v the K/V widths, o_in the attention's output (o_proj's input), I the MLP's intermediate width; per sequence T tokens,
m sequences in a micro-batch.
"""

from fastgrpo.train.config import TrainConfig
from fastgrpo.train.shapes import LayerShape, Shapes

# torch's dropout off CUDA (at::_dropout_impl, what the fake-CPU traces run) multiplies its input by an fp32 noise
# tensor of the input's shape, alive with the dropped-out copy; CUDA's fused native_dropout writes a bool mask (1 byte)
# instead. The moments below take the traces' 4 bytes, the higher.
DROPOUT_NOISE_BYTES = 4
# RMSNorm's backward (transformers' Qwen2/Qwen3/Llama RMSNorm: x32 = x.float(); x32 * rsqrt(mean(x32^2) + eps)) at
# its PowBackward: besides the fp32 input its pow and mul keep, five fp32 [T, H] tensors: the mul's gradient to x32
# (held for the sum), mean's expanded gradient, x32^1 and 2 x32 of pow's derivative, and their product
RMSNORM_BACKWARD_FP32 = 5
# Eager attention (transformers' eager_attention_forward; gpt-oss's with its sink column): [m, heads, T, T (+1)]
# score tensors of the compute dtype. Its forward holds three at once (the masked scores, the scores with the sink
# column and their max subtracted, then their softmax); the softmax (the probabilities) is what the backward keeps,
# and what the attention returns beside its output (alive through the layer's MLP); the backward of its two matmuls
# and the softmax holds the kept probabilities, the sliced gradient and the softmax's input gradient.
EAGER_FORWARD_SCORES = 3
EAGER_SAVED_SCORES = 1
EAGER_BACKWARD_SCORES = 2
# Routed experts (transformers' grouped_mm experts, one row per (token, expert) pair): the int64 expert ids, sort
# permutation and its inverse, the fp32 histogram input, and the routing weight, per pair
EXPERT_PAIR_INDEX_BYTES = 3 * 8 + 4 + 4


# -- small rules -----------------------------------------------------------------------------------------------------


def lora_dropout_bytes(config: TrainConfig) -> int:
    """Bytes of peft's dropout mask per LoRA input value: 1 with dropout (a bool mask), else 0."""
    return 1 if config.lora_dropout > 0 else 0


def lora_a_input_bytes(config: TrainConfig) -> int:
    """fp32 bytes per input value at an adapted layer's lora_A in a training forward: the input cast to the fp32
    adapter's dtype (peft's cast, or LoRAInput's) and, with dropout, the noise and the dropped-out copy."""
    return 4 + (2 * DROPOUT_NOISE_BYTES if config.lora_dropout > 0 else 0)


def fp32_copy_bytes(b: int) -> int:
    """Bytes per value of an input cast to the fp32 adapter (or norm) dtype: 4, or none in fp32 (`.to` copies
    nothing)."""
    return 4 if b < 4 else 0


def norm_tile_rows(width: int, tokens: int) -> int:
    """Rows of one tile of a recomputed norm (recompute_norms) over `tokens` rows of `width` values: its backward
    (and a no-grad norm) runs tiling.norm_tile_rows(width) rows at a time (tiling._recomputed_norm), so its fp32 copy
    and temporaries exist for one tile only."""
    from fastgrpo.train.tiling import norm_tile_rows as rows

    return min(tokens, rows(width))


def attention_kind(s: Shapes, config: TrainConfig) -> str:
    """How the training forward attends: "eager" (transformers' eager attention: score tensors in memory; gpt-oss's
    own choice, having no SDPA path), "sdpa", or "flash" (any other implementation: no scores, no masks)."""
    name = config.attn_implementation or s.attention
    if "sdpa" in name:  # transformers' SDPA, or tiling.MASK_FREE_SDPA (its masks but a right-padded batch's)
        return "sdpa"
    return "eager" if name == "eager" else "flash"


def window_masked(layer: LayerShape, T: int | None) -> bool:
    """A sliding layer's SDPA gets a [m, 1, T, T] mask once the sequence reaches its window (below it, transformers
    skips the mask: every key is in the window)."""
    return layer.window is not None and T is not None and T >= layer.window


def sdpa_masked(s: Shapes, layer: LayerShape, config: TrainConfig, T: int | None) -> bool:
    """Whether this layer's SDPA gets a mask: without mask_free_attention (a padded micro-batch's; planned for any
    micro-batch, the larger), or a window's."""
    kind = attention_kind(s, config)
    return kind == "eager" or kind == "sdpa" and (not config.mask_free_attention or window_masked(layer, T))


def scores(layer: LayerShape, micro_batch: int, T: int) -> int:
    """Values of one eager attention score tensor: [m, heads, T, T], a column more with sinks (gpt-oss)."""
    return micro_batch * layer.heads * T * (T + (1 if layer.sinks else 0))


def mask_kinds(s: Shapes, config: TrainConfig, micro_batch: int, T: int) -> set:
    """The [m, 1, T, T] masks transformers builds for a forward, one per kind of layer that gets one (its window; None
    for full attention): with SDPA a padded micro-batch's (more than one sequence, planned at its longest) without
    mask_free_attention, and a sliding window's once the sequence reaches it; with eager attention every kind's."""
    kind = attention_kind(s, config)
    if kind == "flash":
        return set()
    if kind == "eager":
        return {layer.window for layer in s.per_layer}
    padded = micro_batch > 1 and not config.mask_free_attention
    return {layer.window for layer in s.per_layer if padded or window_masked(layer, T)}


def mask_entry_bytes(s: Shapes, config: TrainConfig, b: int) -> int:
    """Bytes of one entry of a mask the decoder holds: SDPA's boolean (1), eager attention's additive (b)."""
    return b if attention_kind(s, config) == "eager" else 1


def held_masks_bytes(s: Shapes, config: TrainConfig, micro_batch: int, T: int, b: int) -> int:
    """The masks the decoder builds once per forward and holds to its end (mask_kinds: SDPA's boolean ones, eager
    attention's additive ones); under checkpointing every layer's saved inputs keep them through the loss and the
    backward too."""
    return len(mask_kinds(s, config, micro_batch, T)) * micro_batch * T * T * mask_entry_bytes(s, config, b)


def layer_mask_bytes(s: Shapes, layer: LayerShape, config: TrainConfig, micro_batch: int, T: int, b: int) -> int:
    """SDPA's additive copy of this layer's boolean mask ([m, 1, T, T] in the compute dtype), made by its call and
    kept for its backward; 0 for a layer without a mask (mask_kinds), and with eager attention (whose mask is added
    to the scores: EAGER_FORWARD_SCORES)."""
    if attention_kind(s, config) != "sdpa" or layer.window not in mask_kinds(s, config, micro_batch, T):
        return 0
    return micro_batch * T * T * b


def norm_keeps(config: TrainConfig, H: int, b: int, layer_norm: bool = False) -> int:
    """Per token, what a hidden-width norm whose input nothing else keeps holds for its backward: transformers'
    RMSNorm its fp32 input and rsqrt (4 (H + 1)), with recompute_norms its input as it comes (H b); a LayerNorm
    (GPT-2; not recomputed) its input and fp32 mean and rstd (H b + 8)."""
    if layer_norm:
        return H * b + 8
    return H * b if config.recompute_norms else 4 * (H + 1)


# -- what a recomputed layer keeps for its backward, per token -----------------------------------------------------


def layer_saved_per_token(s: Shapes, layer: LayerShape, config: TrainConfig, b: int, T: int | None = None) -> int:
    """What a layer's recompute keeps for its backward, per token: attention_saved_per_token and
    mlp_saved_per_token."""
    return attention_saved_per_token(s, layer, config, b, T) + mlp_saved_per_token(s, layer, config, b)


def attention_saved_per_token(s: Shapes, layer: LayerShape, config: TrainConfig, b: int, T: int | None = None) -> int:
    """What a recomputed layer keeps for the backward of its input norm and attention, per token: the normed input
    (q/k/v's input), the rotated q, SDPA's output (o_proj's input), v and the rotated k (b (H + q + o_in + k + v); a
    KV-shared layer reads another's k and v); the norms' inputs (_norms_saved_per_token); SDPA's fp32 logsumexp (4 per
    head; eager attention keeps its probabilities instead, per layer: scores); k and v repeated to every query head
    (SDPA with a mask and GQA, so not with mask_free_attention unless a window masks; eager attention always); Gemma's
    norm of the attention's output. With LoRA the fp32 [r] outputs of each adapted attention linear's lora_A (kept by
    lora_B), and without recompute_lora_inputs peft's fp32, dropped-out inputs (a copy each), 4 + d bytes per value.
    (The residual is not kept: its add saves nothing.)"""
    H = s.hidden
    if layer.mixer is not None:  # a recurrent mixer: its input (the normed input) and what it keeps (measured), and
        # one [T, H] more that the recomputed layer keeps beside what the mixer alone keeps (found in traces of
        # Qwen3.5-9B, 4 and 32 layers, 4K-33K tokens a sequence: every moment of its backward 1 [T, H] under without)
        per_token = 2 * b * H + _norms_saved_per_token(s, layer, config, b) + layer.mixer.saved[0]
        return per_token + _lora_saved_per_token(layer.attention_linears, config)
    kv = 0 if layer.kv_shared else layer.k + layer.v
    grouped = layer.kv_heads < layer.heads and sdpa_masked(s, layer, config, T)
    repeated = layer.heads * (layer.head_dim + layer.v_head_dim) if grouped else 0
    lse = 0 if attention_kind(s, config) == "eager" else 4 * layer.heads
    per_token = b * (H + layer.q + layer.o_in + kv + repeated) + _norms_saved_per_token(s, layer, config, b) + lse
    if layer.norms >= 4:
        per_token += norm_keeps(config, H, b)
    return per_token + _lora_saved_per_token(layer.attention_linears, config)


def _lora_saved_per_token(linears: tuple[tuple[int, int], ...], config: TrainConfig) -> int:
    """With LoRA, per token: the fp32 [r] outputs of each adapted linear's lora_A (kept by lora_B), and without
    recompute_lora_inputs peft's fp32, dropped-out inputs (a copy each), 4 + d bytes per value."""
    if not config.use_peft:
        return 0
    per_token = 4 * config.lora_r * len(linears)
    if not config.recompute_lora_inputs:
        per_token += (4 + lora_dropout_bytes(config)) * sum(i for i, _ in linears)
    return per_token


def _norms_saved_per_token(s: Shapes, layer: LayerShape, config: TrainConfig, b: int) -> int:
    """What a recomputed layer's input norm and per-head q/k norms keep for their backward, per token.

    transformers' RMSNorm: the fp32 input (4 H, kept by its pow and mul: in bf16 a copy, in fp32 the input itself),
    with per-head q/k norms theirs (4 (q + k)), and each norm's fp32 rsqrt per row (per head for q/k); Gemma 4's
    unweighted v norm (which recompute_norms leaves: it has no weight) its fp32 input and rsqrt.

    recompute_norms (tiling._recomputed_norm): each keeps its input as it comes, nothing fp32. The q/k norms' inputs
    are q_proj's and k_proj's outputs ((q + k) b; else freed once the fp32 copy is made). The input norm's is the
    layer's input (H b): with offload_activations the copy fetched back for the recompute, otherwise freed once the
    recompute is done (the prefetched next layer's is checkpointed layer inputs' own), and without checkpointing the
    previous layer's output; checkpointed without offload, the checkpoint's own kept input (counted there). A
    LayerNorm (GPT-2) keeps that same input and its fp32 mean and rstd (8 bytes a row)."""
    H = s.hidden
    k = 0 if layer.kv_shared else layer.k
    heads = (layer.q + k + layer.heads + (0 if layer.kv_shared else layer.kv_heads)) if layer.head_norms else 0
    v_norm = 0 if layer.kv_shared or not layer.v_norm else 4 * (layer.v + layer.kv_heads)
    layer_input = not config.gradient_checkpointing or config.offload_activations
    if layer.layer_norm:
        return (H * b if layer_input else 0) + 8
    if not config.recompute_norms:
        return 4 * (H + 1) + 4 * heads + v_norm  # fp32 inputs, rsqrt
    return (H * b if layer_input else 0) + ((layer.q + k) * b if layer.head_norms else 0) + v_norm


def mlp_input_norm_keeps(config: TrainConfig, H: int, b: int, layer_norm: bool = False) -> int:
    """What the MLP's input norm (Llama's post-attention norm, Gemma's pre-feedforward norm) keeps, per token: its
    fp32 input and rsqrt (4 (H + 1)), or with recompute_norms its input as it comes, the residual sum (H b; the MLP's
    residual add saves nothing, so nothing else keeps it)."""
    return norm_keeps(config, H, b, layer_norm)


def mlp_saved_per_token(s: Shapes, layer: LayerShape, config: TrainConfig, b: int) -> int:
    """What a recomputed layer keeps for its post-attention norm and MLP, per token: the norm's input
    (mlp_input_norm_keeps) and its output, the MLP's input (H b: kept by the tiled MLP, or by gate/up; by the
    experts' router); Gemma's norm of the MLP's output; Gemma 4's per-layer input (per_layer_input_saved_per_token).
    A dense MLP untiled also keeps SwiGLU's gate, up, SiLU(gate) and product (4 I b: the product is down's input;
    GPT-2's GELU its input, tanh, 1 + tanh, x / 2 and product: 5 I b), and with LoRA the fp32 [r] outputs of each
    adapted linear's lora_A and without recompute_lora_inputs peft's fp32, dropped-out inputs. Tiled, all the [T, I]
    terms live in one tile of the backward (layer_backward_bytes). Experts: expert_saved_per_token."""
    H, inter = s.hidden, layer.intermediate
    per_token = mlp_input_norm_keeps(config, H, b, layer.layer_norm) + b * H  # the norm's input, the MLP's input
    if layer.norms >= 4:
        per_token += norm_keeps(config, H, b)
    per_token += per_layer_input_saved_per_token(layer, config, b, H)
    if inter and (config.mlp_tile_tokens is None or not layer.tileable):
        per_token += (4 if layer.gated else 5) * inter * b
        if config.use_peft:
            per_token += 4 * config.lora_r * len(layer.mlp_linears)
            if not config.recompute_lora_inputs:
                per_token += (4 + lora_dropout_bytes(config)) * sum(i for i, _ in layer.mlp_linears)
    return per_token + expert_saved_per_token(layer, b, H)


def expert_saved_per_token(layer: LayerShape, b: int, H: int) -> int:
    """What a layer's routed experts keep for their backward, per token (top_k pairs of a token and an expert, each a
    row of transformers' grouped_mm experts): the row's gathered input (up's input: H b), the gate/up projection's
    output [2I] (kept by the gate: SiLU's, or gpt-oss's two clamps'), the gate's kept values (expert_gate_values x I:
    SiLU(gate) and the product, down's input; gpt-oss's clamped gate, sigmoid, glu, up + 1 and product) and down's
    output (H b, kept by the routing weight's multiply), with EXPERT_PAIR_INDEX_BYTES of indices; and per token the
    router's fp32 probabilities over the experts."""
    if not layer.experts:
        return 0
    width = layer.expert_intermediate
    pair = b * (H + 2 * width + layer.expert_gate_values * width + H) + EXPERT_PAIR_INDEX_BYTES
    return layer.top_k * pair + 4 * layer.experts


def per_layer_input_saved_per_token(layer: LayerShape, config: TrainConfig, b: int, H: int) -> int:
    """Gemma 4's per-layer input (hidden_size_per_layer_input P): its gate's input (the residual stream, H b, kept
    by its adapter), the gate's output, GELU's, their product with the per-layer input (3 P b: GELU's input, the
    product's operands, the projection's input), the projection's output (H b, its norm's input), and one [T, H]
    more that its backward holds beside the layer's (found in traces of Gemma 4 E2B: -2.2% at 2 x 33K tokens
    without it)."""
    if not layer.per_layer_input:
        return 0
    lora = 4 * config.lora_r * len(layer.other_linears) if config.use_peft else 0
    return b * (3 * H + 3 * layer.per_layer_input) + lora


def experts_forward_bytes(layer: LayerShape, b: int, H: int, tokens: int) -> int:
    """A layer's experts in a forward that keeps nothing (no grad, or checkpointed) over `tokens` tokens, the larger
    of two moments (top_k pairs a token): the gate, the pairs' gathered input, the gate/up output [2I] (and its
    gathered bias) and the gate's values (b (H + (2 + gate values) I)), with gate_up's effective weight under LoRA;
    and the pairs put back in token order, four [H] rows a pair (the gathered input, down's output, its weighted
    copy, that copy reordered) and down's gathered bias, with both effective weights under LoRA."""
    if not layer.experts:
        return 0
    pairs, width, weights = tokens * layer.top_k, layer.expert_intermediate, expert_weight_bytes(layer, b)
    bias = 1 if layer.expert_bias else 0
    gate = pairs * (b * (H + (2 + 2 * bias + layer.expert_gate_values) * width) + EXPERT_PAIR_INDEX_BYTES)
    down = pairs * (b * H * (4 + bias) + EXPERT_PAIR_INDEX_BYTES) + weights
    return max(gate + weights * 2 // 3, down)


def expert_weight_bytes(layer: LayerShape, b: int) -> int:
    """With LoRA on the experts (peft's ParamWrapper), what each forward of the layer forms: the whole effective
    weight W + B A of gate_up and of down (b bytes a value), held through the experts' call; 0 otherwise."""
    return layer.expert_weights * b if layer.expert_lora else 0


# -- moments ---------------------------------------------------------------------------------------------------------


def layer_backward_bytes(s: Shapes, layer: LayerShape, config: TrainConfig, b: int, micro_batch: int, T: int) -> int:
    """One layer's backward over a micro-batch of `micro_batch` x T tokens besides the checkpointed inputs (with
    offload: the first layer's input, which peft's input gradient keeps, and the next layer's prefetched one; the
    recomputed input itself is kept by nothing once the recompute is done but a recomputed input norm, see
    _norms_saved_per_token), the largest of three moments. All hold the recomputed layer's attention_saved_per_token
    and the gradient of the layer's output (H b, held for the residual branch), SDPA's copy of its mask
    (layer_mask_bytes) and eager attention's kept probabilities.

    MLP (down_proj's lora_A backward): mlp_saved_per_token and the gradient of the MLP's input (H b, the tiled MLP's
    grad_x or down's output gradient), then over the MLP's tokens (one tile's, tiled): the recomputed SwiGLU (tiled:
    gate, up, SiLU(gate) and product, 4 I b), the gradient of down's input (I b) and with LoRA lora_A's recomputed fp32
    input, its dropout noise and its gradient (8 + noise bytes per I; with recompute_lora_inputs, LoRAInput's
    _Recomputed); without it peft's fp32 inputs of gate, up and down in the tile (tiled); full fine-tuning the gate,
    up and down weights' gradients of a tile in the compute dtype. Past one tile, three [tile, H] tensors more: the
    tile's recomputed output and two gradients of it. Experts instead: per pair the gradients of down's input, the
    gate/up output and the gathered input (b (I + 2I + H)), and with LoRA on them their effective weights
    (expert_weight_bytes, formed by the recompute and kept for their gradients) and a third more (down's gradient
    beside both, or gate_up's beside its own). The attention's moments come before the MLP's recompute or after its
    backward: no effective weights then.

    Post-attention norm (its PowBackward): its fp32 input and RMSNORM_BACKWARD_FP32 fp32 [T, H] temporaries, the MLP
    done (its saved tensors freed). What a tiled layer peaks at past ~4 tiles (Qwen3-8B at 2 x 110K tokens). With
    recompute_norms (its _Recomputed backward) only over one tile of the norm (norm_tile_rows): the norm's kept input,
    the MLP input's gradient it receives and the grad_x it fills (3 H b per token), then the tile's fp32 copy, its
    temporaries and its recomputed output (4 + 4 RMSNORM_BACKWARD_FP32 + b per value): under the MLP's moment but for
    a few thousand tokens (one norm tile, about an MLP tile).

    Attention (o_proj's lora_A backward, the first of the attention's backward: everything it saved still live):
    besides the output's gradient, the gradient of o_proj's base output waiting for its backward (peft sums the base
    output and the fp32 adapter's in fp32 and casts back, so its bf16 gradient is a cast copy; H b), then over o_proj's
    input (o_in) lora_A's gradient in fp32 (4), with recompute_lora_inputs LoRAInput's recomputed fp32 input (dropped
    out: the noise and the copy, or the cast itself; 4 + noise) and the grad_x it fills (b), without it the dropout's
    backward in fp32 (peft's input is saved already; 4) and the cast's gradient (b); full fine-tuning o_proj's weight
    gradient (H o_in b) and its input's (o_in b). Past ~4 tiles with recompute_norms (Qwen3-8B at 2 x 110K tokens)
    the peak. Eager attention adds the scores' backward (EAGER_BACKWARD_SCORES score tensors)."""
    H, inter = s.hidden, layer.intermediate
    tokens = micro_batch * T
    tiled = config.mlp_tile_tokens is not None and layer.tileable
    tile = min(config.mlp_tile_tokens, tokens) if tiled else tokens
    eager = attention_kind(s, config) == "eager"
    common = (tokens * (attention_saved_per_token(s, layer, config, b, T) + b * H)
              + layer_mask_bytes(s, layer, config, micro_batch, T, b)
              + (EAGER_SAVED_SCORES * scores(layer, micro_batch, T) * b if eager else 0)
              + (layer.mixer.saved[1] if layer.mixer else 0))
    mlp = common + tokens * (mlp_saved_per_token(s, layer, config, b) + b * H)
    if inter:
        lora = (8 + (DROPOUT_NOISE_BYTES if config.lora_dropout > 0 else 0)) * inter if config.use_peft else 0
        if config.use_peft and tiled and not config.recompute_lora_inputs:
            lora += (4 + lora_dropout_bytes(config)) * (2 * H + inter)
        mlp += tile * ((4 * b if tiled else 0) * inter + b * inter + lora)
        if tiled and tile < tokens:
            mlp += 3 * tile * H * b
        if not config.use_peft:
            mlp += sum(i * o for i, o in layer.mlp_linears) * b
    if layer.experts:
        mlp += tokens * layer.top_k * b * (3 * layer.expert_intermediate + H)
        # the effective weights the recompute formed (kept for their gradients), and down's [E, H, I] weight
        # gradient beside them, or after down's backward (its weight released) gate_up's [E, 2I, H] beside its own:
        # both 4/3 of the two weights
        mlp += expert_weight_bytes(layer, b) * 4 // 3
    if layer.layer_norm:
        norm = common + tokens * 3 * H * b
    elif config.recompute_norms:
        norm = common + 3 * tokens * H * b + norm_tile_rows(H, tokens) * (4 + 4 * RMSNORM_BACKWARD_FP32 + b) * H
    else:
        norm = common + tokens * (4 + 4 * RMSNORM_BACKWARD_FP32) * H
    o_in = layer.o_in
    if config.use_peft:
        noise = DROPOUT_NOISE_BYTES if config.lora_dropout > 0 else 0
        attention = common + tokens * (H * b + o_in * (4 + (4 + noise if config.recompute_lora_inputs else 4) + b))
    else:
        attention = common + tokens * o_in * b + H * o_in * b
    if eager:
        attention += EAGER_BACKWARD_SCORES * scores(layer, micro_batch, T) * b
    if layer.mixer is not None:  # its backward's own moment (measured), beside what it kept and its output's gradient
        attention = common + layer.mixer.at(layer.mixer.backward, tokens)
    return max(mlp, norm, attention)


def train_forward_bytes(s: Shapes, layer: LayerShape, config: TrainConfig, b: int, micro_batch: int, T: int) -> int:
    """A layer's training forward (checkpointed: nothing saved) over micro_batch x T tokens besides the checkpointed
    inputs (which hold the layer's input, the residual), the larger of two moments:

    MLP: the residual sum and the MLP's input (2 H b per token), past one tile the tiled output and the previous
    tile's (held by _tiled_output's loop until the next is formed; H b per token, and per tile token); then per token
    of one tile (untiled: of all) the larger of down_proj's lora_A (SwiGLU's product, down's base output, and
    lora_a_input_bytes per I) and up_proj's LoRA sum (SiLU(gate), up's base output, lora_B's scaled fp32 output and
    the fp32 sum: 2 I b + 8 I); without LoRA, SwiGLU's product formed beside SiLU(gate) and up (3 I b). Experts: per
    pair the gathered input, the gate/up output and the gate's values (b (H + 2I + gate values I)) with the effective
    weights under LoRA.

    Attention (o_proj's lora_A): the normed input, the rotated q, SDPA's output, o_proj's base output, v and the
    rotated k (b (2 H + q + o_in + k + v)) and o_proj's fp32 input copies (lora_a_input_bytes per o_in); eager
    attention its scores and their softmax. With a mask (a window's), SDPA's own moment (sdpa_moment_bytes: its copy
    of the mask, freed before o_proj); the decoder's masks are plan_memory's (held_masks_bytes)."""
    H, inter = s.hidden, layer.intermediate
    tokens = micro_batch * T
    tiled = config.mlp_tile_tokens is not None and layer.tileable
    tile = min(config.mlp_tile_tokens, tokens) if tiled else tokens
    mlp = 2 * tokens * H * b
    if inter:
        if config.use_peft:
            down = b * inter + b * H + lora_a_input_bytes(config) * inter
            up = 2 * b * inter + 8 * inter
        else:
            down, up = b * inter + b * H, 3 * b * inter
        mlp += tile * max(down, up)
        if tile < tokens:
            mlp += tokens * H * b + tile * H * b
    mlp += experts_forward_bytes(layer, b, H, tokens)
    if attention_kind(s, config) == "eager":  # the probabilities the attention returned
        mlp += EAGER_SAVED_SCORES * scores(layer, micro_batch, T) * b
    kv = 0 if layer.kv_shared else layer.k + layer.v
    lora = lora_a_input_bytes(config) * layer.o_in if config.use_peft else 0
    attention = tokens * (b * (2 * H + layer.q + layer.o_in + kv) + lora)
    if attention_kind(s, config) == "eager":
        attention += EAGER_FORWARD_SCORES * scores(layer, micro_batch, T) * b
    # SDPA with a mask (a window's): its additive copy, the repeated K/V, its output and logsumexp; freed (nothing is
    # saved in a checkpointed forward) before o_proj runs
    sdpa = sdpa_moment_bytes(s, layer, config, b, micro_batch, T)
    if layer.mixer is not None:  # the residual and the normed input, and the mixer's no-grad forward (measured)
        attention = 2 * tokens * H * b + layer.mixer.at(layer.mixer.forward, tokens)
    return max(mlp, attention, sdpa)


def attention_forward_per_token(s: Shapes, layer: LayerShape, config: TrainConfig, b: int) -> int:
    """Live in a layer's attention without grad at o_proj (with LoRA its adapter's sum), per token, besides the
    layer's input: the normed input (q/k/v's input, held by the decoder layer), the rotated q and k, v (held by the
    attention until it returns), SDPA's output and o_proj's base output (b (2 H + q + o_in + k + v)); with LoRA lora_B's
    fp32 output and its scaled copy (then the fp32 sum; 8 H) and without recompute_lora_inputs peft's fp32 copy of
    o_proj's input, held through the sum (LoRAInput's is gone after lora_A). With LoRA the attention's other moments
    are lower (q/k/v's sums and the rotation hold fewer tensors; SDPA with a padding mask is logprobs_forward_bytes');
    without it q's rotation or Qwen3's fp32 q norm holds up to ~2 q b more, under the MLP's 2 H b + 3 I b (I > H)."""
    H = s.hidden
    kv = 0 if layer.kv_shared else layer.k + layer.v
    per_token = b * (2 * H + layer.q + layer.o_in + kv)
    if config.use_peft:
        per_token += 8 * H + (fp32_copy_bytes(b) * layer.o_in if not config.recompute_lora_inputs else 0)
    return per_token


def mlp_forward_bytes(s: Shapes, layer: LayerShape, config: TrainConfig, b: int, tokens: int) -> int:
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
    than up_proj's.) Experts: per pair the gathered input, the gate/up output and the gate's temporaries (b (H + 2I +
    gate values I)), with the effective weights under LoRA."""
    H, inter = s.hidden, layer.intermediate
    tiled = config.mlp_tile_tokens is not None and layer.tileable
    tile = min(config.mlp_tile_tokens, tokens) if tiled else tokens
    mlp = 2 * tokens * H * b
    if inter:
        if config.use_peft:
            cast = fp32_copy_bytes(b)
            peft_cast = not config.recompute_lora_inputs
            up = 2 * b * inter + 8 * inter + (cast * H if peft_cast else 0)
            down = b * inter + b * H + (cast * inter + 8 * H if peft_cast else max(cast * inter, 8 * H))
        else:
            up, down = 3 * b * inter, b * inter + b * H
        mlp += tile * max(up, down)
        if tile < tokens:
            mlp += tokens * H * b + tile * H * b
    return mlp + experts_forward_bytes(layer, b, H, tokens)


def layer_forward_bytes(s: Shapes, layer: LayerShape, config: TrainConfig, b: int, micro_batch: int, T: int) -> int:
    """A layer's no-grad forward over micro_batch x T tokens besides its input: the larger of the attention's moment
    at o_proj (attention_forward_per_token; eager attention's scores and softmax with it) and the MLP's
    (mlp_forward_bytes); logprobs_forward_bytes adds what the decoder holds around it."""
    tokens = micro_batch * T
    attention = tokens * attention_forward_per_token(s, layer, config, b)
    if layer.mixer is not None:  # the layer's input, the normed input and the mixer's no-grad forward (measured)
        attention = 2 * tokens * s.hidden * b + layer.mixer.at(layer.mixer.forward, tokens)
    mlp = mlp_forward_bytes(s, layer, config, b, tokens)
    if attention_kind(s, config) == "eager":
        attention += EAGER_FORWARD_SCORES * scores(layer, micro_batch, T) * b
        mlp += EAGER_SAVED_SCORES * scores(layer, micro_batch, T) * b  # the probabilities the attention returned
    return max(attention, mlp)


def logprobs_forward_bytes(s: Shapes, config: TrainConfig, b: int, micro_batch: int, T: int) -> int:
    """The no-grad backbone's peak over a micro-batch of `micro_batch` sequences padded to T tokens, at its last
    layer: what the decoder holds through its layers, the embeddings' output (the decoder's inputs_embeds, kept to
    its end) and the layer's input (held by the decoder's loop while the layer runs; in a one-layer model the same
    tensor), the rotary cos and sin ([1, T, head_dim] each per table: the sequences share positions; Gemma has one
    table per kind of layer), Gemma 4's per-layer inputs ([m, T, layers, P]) and the K/V its KV-shared layers read,
    and the [m, 1, T, T] masks (a padded micro-batch's boolean without mask_free_attention, a window's, eager's
    additive ones); plus the largest of each kind of layer's moments (layer_forward_bytes) and, with a mask, SDPA's:
    the normed input, the rotated q and k, v, K and V repeated to every query head (with GQA), the mask's additive copy
    in the compute dtype (m T^2 b), SDPA's output and fp32 logsumexp (4 per head). (The final norm's moment, the last
    output and its fp32 copies, is lower.)"""
    H = s.hidden
    tokens = micro_batch * T
    held = tokens * H * b * (2 if s.layers > 1 else 1) + sum(2 * T * d * b for d in s.rotary_dims)
    held += tokens * (s.per_layer_inputs * b + shared_kv_bytes(s, b, training=False))
    held += held_masks_bytes(s, config, micro_batch, T, b)
    peak = max(max(layer_forward_bytes(s, layer, config, b, micro_batch, T),
                   sdpa_moment_bytes(s, layer, config, b, micro_batch, T)) for layer in s.kinds)
    return held + peak


def sdpa_moment_bytes(s: Shapes, layer: LayerShape, config: TrainConfig, b: int, micro_batch: int, T: int) -> int:
    """A layer's SDPA call with a mask (mask_kinds), besides the decoder's masks: the normed input, the rotated q and
    k, v, K and V repeated to every query head (with GQA), the mask's additive copy in the compute dtype (m T^2 b),
    SDPA's output and fp32 logsumexp (4 per head); 0 for a layer without a mask."""
    if attention_kind(s, config) != "sdpa" or layer.window not in mask_kinds(s, config, micro_batch, T):
        return 0
    repeated = layer.heads * (layer.head_dim + layer.v_head_dim) if layer.kv_heads < layer.heads else 0
    kv = 0 if layer.kv_shared else layer.k + layer.v
    return (micro_batch * T * (b * (s.hidden + layer.q + kv + repeated + layer.o_in) + 4 * layer.heads)
            + layer_mask_bytes(s, layer, config, micro_batch, T, b))


def shared_kv_bytes(s: Shapes, b: int, training: bool) -> int:
    """Bytes per token of the K/V that KV-shared layers read (Gemma 4's shared_kv_states: the last layer of each
    kind that keeps its own, held from its forward to the decoder's end), and in training, with Gemma 4's unweighted
    v norm, its fp32 input, which their graph keeps."""
    if not any(layer.kv_shared for layer in s.per_layer):
        return 0
    sources = {layer.window: layer for layer in s.per_layer if not layer.kv_shared}
    return sum((layer.k + layer.v) * b + (4 * layer.v if layer.v_norm and training else 0)
               for layer in sources.values())


def engine_forward_bytes(s: Shapes, layer: LayerShape, config: TrainConfig, b: int, tokens: int,
                         segment: int | None = None, decode: bool = False) -> int:
    """The sampling engine's forward of `tokens` tokens (its own attention: no scores, no masks) at one layer, untiled:
    SwiGLU's four [T, I] tensors at the down projection, with LoRA its input in fp32; experts their no-grad moment
    (experts_forward_bytes, with the effective weights LoRA on them forms every forward). A recurrent layer runs each
    prefill segment alone (at most `segment` tokens: its no-grad forward's moment over those, beside the layer's
    input, normed input and the segments' outputs joined, 3 H b per token), and a decode step's rows together (its
    measured decode moment: their states gathered, stepped and written back)."""
    lora = 4 if config.use_peft else 0
    mlp = tokens * (4 * b + lora) * layer.intermediate + experts_forward_bytes(layer, b, s.hidden, tokens)
    mixer = layer.mixer
    if mixer is None:
        return mlp
    if decode:
        return max(mlp, 2 * tokens * s.hidden * b + mixer.at(mixer.decode, tokens))
    alone = tokens if segment is None else min(tokens, segment)
    return max(mlp, 3 * tokens * s.hidden * b + mixer.at(mixer.forward, alone))
