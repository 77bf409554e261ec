"""The memory plan: each phase's peak device memory predicted from the model's config alone, and the settings that fit.

`fastgrpo plan` prints it, `fastgrpo train` logs it at the start, and `fastgrpo train --auto-fit` applies it: the
largest micro-batch, the KV pool and the loss chunk that fit `gpu_memory`. The model is built on the meta device
(no weights read or allocated) and read layer by layer (fastgrpo/train/shapes.py: each layer's heads, head dims,
window, shared KV, MLP or experts; LoRA as load_policy adds it); the rest are formulas over the shapes
(fastgrpo/train/layer_bytes.py), written out with their derivations in benchmarks/NOTES.md ("Memory plan") and
checked against live-tensor traces of real runs (fastgrpo/bench/memory_trace.py, `fastgrpo bench memory-plan`).

Phases (bytes of live tensors; the CUDA context and allocator slack are the `RESERVE` left out of gpu_memory):
    sampling   weights + trainable state + the KV pools (kv_pool_bytes: the logical pool of the full-attention layers
               and one smaller pool per sliding window) + one engine forward (a token budget) and the sampler
    logprobs   weights + trainable state + the larger of a no-grad micro-batch forward's last layer and the head's
               no-grad chunk with the final hidden states
    train      weights + trainable state + gradients + one micro-batch's checkpointed layer inputs, the recompute of
               one layer in the backward and the fused loss's chunk and gradients, + the optimizer step's states
A layer's terms follow the layer memory options (mlp_tile_tokens, recompute_lora_inputs, mask_free_attention,
recompute_norms: fastgrpo/train/tiling.py), the KV pool kv_cache_dtype (fp8: a byte per value); `auto_fit` states its
order of preference. Each moment of a layer is evaluated for every kind of layer the model has (Gemma 3's sliding and
full layers, Gemma 4's KV-shared ones) and the largest taken.
Sequences are planned at their longest, as a micro-batch pads to its longest: the training data's longest prompt
(`fastgrpo train`) or max_prompt_length (`fastgrpo plan`, which reads no data), plus max_completion_length.
"""

import math
from dataclasses import dataclass, field

import torch

from fastgrpo.sampling.block_pool import blocks_for, least_pages, most_pages
from fastgrpo.sampling.params import EngineConfig
from fastgrpo.sampling.state import slots_for
from fastgrpo.sizes import GiB
from fastgrpo.train.config import TrainConfig, train_dtype
from fastgrpo.train.layer_bytes import (
    engine_forward_bytes,
    held_masks_bytes,
    layer_backward_bytes,
    layer_mask_bytes,
    layer_saved_per_token,
    logprobs_forward_bytes,
    shared_kv_bytes,
    train_forward_bytes,
)
from fastgrpo.train.shapes import LayerShape, Shapes, model_shapes

__all__ = ["Plan", "Shapes", "auto_fit", "check_kv_cache_blocks", "format_plan", "model_shapes", "plan_memory",
           "plan_run", "window_group_pages"]

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
# DecodeBatch's int64 context, last token, output row, count and state slot per row (+ its page tables)
DECODE_ROW_BYTES = 5 * 8
KV_POOL = "KV pool"  # the sampling phase's component of the logical pool (full-attention layers' pages)
PAGE_TABLE_BYTES = 4  # DecodeBatch's int32 page table entries: [pools, rows, pages]


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
    """The policy's weights: every parameter in the training dtype, or with load_in_4bit every linear layer's weight
    but the output head's (nn.Linear and GPT-2's Conv1D, as transformers' bitsandbytes loading replaces them) as NF4
    (half a byte each, one uint8 scale per 64 weights and one fp32 scale per 256 scales). Experts' 3-D weights are not
    linear layers: bitsandbytes leaves them in the training dtype (gpt-oss-20b: 19.1 of its 20.9B parameters)."""
    if not config.load_in_4bit:
        return s.params * b
    n = s.linear_params
    quantized = n // 2 + n // NF4_BLOCK + 4 * (n // (NF4_BLOCK * NF4_STATE_BLOCK))
    return (s.params - s.linear_params) * b + quantized


def lora_params(s: Shapes, config: TrainConfig) -> list[int]:
    """Every LoRA tensor's size, as peft makes them for load_policy (Shapes.lora): A [r, in] and B [out, r] per
    adapted linear layer, and on an MoE's experts one adapter per expert ([E r, in] and [out, E r])."""
    return list(s.lora(config).lora_sizes)


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




# -- the sampling engine's KV pages ----------------------------------------------------------------------------------


def window_group_pages(window: int, logical_pages: int, block_size: int, sequence_pages: int, seats: int) -> int:
    """Pages of the pool of the sliding-window layers of one window (a window group; pages outside each sequence's
    window go back to it): the engine's own rule, pages.window_pool_pages, for a round whose longest sequence takes
    `sequence_pages` pages and that runs at most `seats` sequences at once. The scratch page past each pool is not
    counted here (kv_pool_bytes adds it)."""
    from fastgrpo.sampling.pages import window_pool_pages

    return window_pool_pages(window, block_size, logical_pages, sequence_pages, seats, ENGINE.max_num_batched_tokens)


def round_sizing(config: TrainConfig, longest_prompt: int) -> tuple[int, int]:
    """(sequence_pages, seats) of a sampling round, as the engine sizes its window pools from them: the pages of the
    longest sequence (prompt and completion), and the most sequences running at once."""
    return (blocks_for(longest_prompt + config.max_completion_length, config.block_size),
            min(ENGINE.max_num_seqs, config.generation_batch_size))


def page_groups(s: Shapes, logical_pages: int, block_size: int,
                sizing: tuple[int, int]) -> list[tuple[int | None, int, list[LayerShape]]]:
    """The engine's page pools: (window, pages, the layers keeping their K/V there), the logical pool (window None:
    the full-attention layers; none, and no bytes, in a model of sliding layers only) first, then one pool per
    window, smallest first. KV-shared layers keep no pages. `sizing`: round_sizing's."""
    own = [layer for layer in s.per_layer if not layer.kv_shared]
    groups = [(None, logical_pages, [layer for layer in own if layer.window is None])]
    for window in s.windows:
        pages = window_group_pages(window, logical_pages, block_size, *sizing)
        groups.append((window, pages, [layer for layer in own if layer.window == window]))
    return groups


def page_bytes(layers: list[LayerShape], block_size: int, value_bytes: int) -> int:
    """One page of a pool: block_size positions of each layer's keys and values, kv_heads x (key dim + value dim)
    values a position (1 byte each with fp8)."""
    return sum(block_size * layer.page_values() * value_bytes for layer in layers)


def kv_pool_bytes(s: Shapes, logical_pages: int, block_size: int, value_bytes: int, fp8: bool = False, *,
                  sizing: tuple[int, int]) -> dict[str, int]:
    """Bytes of the sampling engine's KV cache by pool, each pool with its scratch page
    (fastgrpo/sampling/kv_cache.py): KV_POOL for the logical pool, "KV pool, window w" for each window's; with fp8
    each page-keeping layer's fp32 scales per K/V head ([2, kv_heads]) in KV_POOL."""
    out = {}
    for window, pages, layers in page_groups(s, logical_pages, block_size, sizing):
        out[KV_POOL if window is None else f"KV pool, window {window}"] = (pages + 1) * page_bytes(layers, block_size,
                                                                                                   value_bytes)
    if fp8:
        out[KV_POOL] += sum(2 * layer.kv_heads * 4 for layer in s.per_layer if not layer.kv_shared)
    return out


def recurrent_state_bytes(s: Shapes, rows: int, num_prompts: int, n: int) -> int:
    """The engine's recurrent state (hybrid models: fastgrpo/sampling/state.py): a slot per row and per running
    group's prompt, and a scratch slot, each one sequence's state in every recurrent layer. (The engine cuts the rows
    when these would take more than half its memory; the plan counts them whole.)"""
    per_seq = sum(layer.mixer.state for layer in s.per_layer if layer.mixer is not None)
    return (slots_for(rows, num_prompts, n) + 1) * per_seq if per_seq else 0


def route_record_bytes(s: Shapes, positions: int) -> int:
    """The engine's route records (MoE: fastgrpo/sampling/routes.py): k expert ids per position and MoE layer, one
    byte each (two past 254 experts), for `positions` (every prompt and completion position of a call)."""
    routed = [layer for layer in s.per_layer if layer.experts]
    if not routed:
        return 0
    itemsize = 1 if max(layer.experts for layer in routed) < 255 else 2
    return positions * sum(layer.top_k for layer in routed) * itemsize


def kv_block_bytes(s: Shapes, block_size: int, b: int) -> int:
    """One page of the logical pool: K and V of block_size tokens in every full-attention layer that keeps its own."""
    return page_bytes([layer for layer in s.per_layer if layer.window is None and not layer.kv_shared], block_size, b)


def least_pool_error(config: TrainConfig, blocks: int, needed: int) -> ValueError:
    """The one line for a kv_cache_blocks too few to sample one prompt group, said alike by `fastgrpo plan` and
    `fastgrpo train` (check_kv_cache_blocks)."""
    bs, G, m = config.block_size, config.num_generations, config.max_completion_length
    return ValueError(f"kv_cache_blocks {blocks} is too few: sampling needs a prompt's pages and one completion's "
                      f"(of up to max_completion_length {m} tokens; the num_generations {G} completions can run one "
                      f"after another), {needed} pages of {bs} tokens; give at least {needed}, or leave it unset to "
                      "size the pool from sampling_memory_fraction")


def fp8_refusal(shapes: Shapes) -> str | None:
    """Why the engine refuses kv_cache_dtype fp8 for this model (its Engine._check_fp8, on the meta build); None when
    it takes it."""
    from fastgrpo.sampling.decode_layers import kv_scales_unsupported

    reason = kv_scales_unsupported(shapes.model)
    if reason is None:
        return None
    return f"kv_cache_dtype='fp8' bounds the keys and values of Llama/Qwen2/Qwen3 layers from their weights: {reason}"


def check_plannable(config: TrainConfig, shapes: Shapes, prompt_length: int) -> None:
    """What `fastgrpo train` refuses before its first step, refused here too with the same line: a kv_cache_blocks
    below the least pool, kv_cache_dtype fp8 for a model the engine cannot bound, mlp_tile_tokens for a model with no
    MLP to tile (tiling.tile_mlps), LoRA options peft or load_policy refuse (Shapes.lora)."""
    if config.kv_cache_blocks is not None:
        needed = least_pages(prompt_length, config.num_generations, config.max_completion_length, config.block_size)
        if config.kv_cache_blocks < needed:
            raise least_pool_error(config, config.kv_cache_blocks, needed)
    if config.kv_cache_dtype == "fp8" and (reason := fp8_refusal(shapes)) is not None:
        raise ValueError(reason)
    if config.mlp_tile_tokens is not None and not shapes.tileable:
        raise ValueError(f"mlp_tile_tokens: {shapes.name} has no MLP with gate_proj, up_proj, down_proj")
    if config.use_peft:
        shapes.lora(config)


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
    s, b = (shapes.lora(config) if config.use_peft else shapes), dtype_bytes(config, device_type)
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
        sizes = list(s.lora_sizes)
        trainable = {"LoRA weights (fp32)": 4 * sum(sizes), "optimizer states": optimizer_bytes(sizes, config, 4)}
        grads = 4 * sum(sizes)
    else:
        sizes = [s.params]  # one tensor per parameter in fact; the 8-bit rule counts per tensor, see optimizer_bytes
        trainable = {"optimizer states": optimizer_bytes(sizes, config, b)}
        grads = s.params * b
    resident = {**weights, **trainable}

    # sampling: the KV pools (pages of block_size tokens, prompts shared within a group, one scratch page each): every
    # group at full length at once, or kv_blocks; auto_fit cuts it to what fits, down to one prompt's pages and one
    # completion's (the engine runs a group's completions one by one if it must); each window's pool at most
    # window_group_pages. Then the larger of a prefill forward (max_num_batched_tokens) and a decode step (a token per
    # running sequence; a dense layer's MLP there holds less than the hidden states: 2 H b a row)
    G, P = config.num_generations, config.generation_batch_size // config.num_generations
    bs = config.block_size
    needed = P * most_pages(prompt, G, config.max_completion_length, bs)
    least = least_pages(prompt, G, config.max_completion_length, bs)
    blocks = needed if kv_blocks is None else kv_blocks  # the engine allocates kv_cache_blocks pages as given
    rows = min(ENGINE.max_num_seqs, config.generation_batch_size)
    sizing = round_sizing(config, prompt)
    kv = kv_pool_bytes(s, blocks, bs, kv_bytes(config, device_type), config.kv_cache_dtype == "fp8", sizing=sizing)
    prefill_tokens = min(ENGINE.max_num_batched_tokens, P * prompt + rows)
    segment = min(ENGINE.max_num_batched_tokens, prompt)  # the longest prefill segment (a recurrent layer's call)
    prefill = max(engine_forward_bytes(s, layer, config, b, prefill_tokens, segment) for layer in s.kinds)
    decode = rows * 2 * s.hidden * b + max(engine_forward_bytes(s, layer, config, b, rows, decode=True)
                                           for layer in s.kinds)
    capacity = max(min(ENGINE.max_num_seqs, ENGINE.max_num_batched_tokens), G)  # the engine's DecodeBatch rows
    pools = len(kv)
    buffers = (config.generation_batch_size * config.max_completion_length * OUTPUT_BYTES_PER_TOKEN
               + capacity * (PAGE_TABLE_BYTES * pools * blocks_for(T, bs) + DECODE_ROW_BYTES))
    sampling = {**resident, **kv, "output buffers": buffers,
                "engine forward": max(prefill, decode),
                "sampler": sampler_bytes(s, rows)}
    state = recurrent_state_bytes(s, rows, P, G)
    if state:
        sampling["recurrent state"] = state
    routes = route_record_bytes(s, P * prompt + config.generation_batch_size * config.max_completion_length)
    if routes:
        sampling["route records"] = routes

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
    # replaces in the backward, and with LoRA the first one's, which peft's input gradient keeps alive), Gemma 4's
    # per-layer inputs and shared K/V, the attention masks (every checkpointed layer's saved inputs hold them), then
    # the largest of the forward's last layer (train_forward_bytes), the fused loss and the backward of one layer
    # (layer_backward_bytes: the final hidden states are freed by then), over every kind of layer
    if not config.gradient_checkpointing:
        kept = 0
    elif config.offload_activations:
        kept = 2 if config.use_peft else 1
    else:
        kept = s.layers
    stored = {**resident, "gradients": grads, "checkpointed layer inputs": kept * layer_input}
    # Gemma 4's per-layer inputs twice (the inputs and their norm's kept input: the model-level projection is adapted)
    beside = tokens * (2 * s.per_layer_inputs * b + shared_kv_bytes(s, b, training=True))
    if beside:
        stored["per-layer inputs, shared K/V"] = beside
    masks = held_masks_bytes(s, config, mb, T, b)
    if masks:
        stored["attention masks"] = masks
    if not config.gradient_checkpointing:
        stored["layer activations"] = sum(tokens * layer_saved_per_token(s, layer, config, b, T)
                                          + layer_mask_bytes(s, layer, config, mb, T, b) for layer in s.per_layer)
    backward = max(layer_backward_bytes(s, layer, config, b, mb, T) for layer in s.kinds)
    # the loss: the final norm's input in fp32 (kept by its pow and mul: a copy in bf16, the input itself in fp32;
    # its bf16 input and output are freed), with recompute_norms its input as it comes (the last layer's output, b
    # bytes), and over the completion tokens the rows completion_hidden gathers, the fused loss's selected rows x and
    # its dX (grpo_head.grpo_head_loss, HeadGrads); then a chunk's fp32 logits and bf16 dZ, and GEMM 2's dX of the
    # chunk (fastgrpo/chunked.py). A final-logit softcap (Gemma 2/4) is applied in place in those: no bytes
    final_norm = b if config.recompute_norms else 4
    final = final_norm * tokens * s.hidden + 3 * completion_tokens * s.hidden * b
    loss_bytes = chunk * (s.vocab * (CUDA_LOSS_BYTES_PER_LOGIT if device_type == "cuda" else 8) + s.hidden * b)
    if not config.use_peft:
        loss_bytes += s.vocab * s.hidden * 4  # dW accumulated in fp32
    forward = max(train_forward_bytes(s, layer, config, b, mb, T) for layer in s.kinds)
    phases = {"sampling": sampling, "logprobs": logprobs,
              "train: forward": {**stored, "layer forward": forward},
              "train: loss": {**stored, "final hidden states": final, "loss chunk": loss_bytes},
              "train: backward": {**stored, "layer backward": backward},
              "train: optimizer step": {**resident, "gradients": grads, "update temporaries": grads}}
    return Plan(phases, {"per_device_train_batch_size": mb, "kv_blocks": blocks, "kv_blocks_needed": needed,
                         "kv_blocks_least": least, "kv_cache_dtype": config.kv_cache_dtype,
                         "mlp_tile_tokens": config.mlp_tile_tokens,
                         "loss_chunk_tokens": chunk, "chunk_override": chunk_tokens,
                         "samples_per_step": config.per_device_train_batch_size * config.gradient_accumulation_steps,
                         "page_groups": [(w, pages, len(layers), page_bytes(layers, bs, kv_bytes(config, device_type)))
                                         for w, pages, layers in page_groups(s, blocks, bs, sizing)],
                         "round_sizing": sizing})


def check_kv_cache_blocks(config: TrainConfig, shapes: Shapes, device: torch.device, prompt_lengths: list[int],
                          eval_prompt_lengths: list[int]) -> None:
    """kv_cache_blocks, when given, against what sampling needs and the memory there is, before anything is
    allocated: the engine would refuse too few pages only at its first call (the first evaluation), and a pool larger
    than memory grows the process (its page lists first, 48 bytes a page: 48 GB for 1e9) until the kernel kills it.
    The pool's bytes are kv_pool_bytes' (each window's pool too)."""
    from fastgrpo.sampling.engine import available_memory

    blocks = config.kv_cache_blocks
    if blocks is None:
        return
    bs, G, m = config.block_size, config.num_generations, config.max_completion_length
    needed = max([least_pages(t, G, m, bs) for t in set(prompt_lengths)]
                 + [least_pages(t, 1, m, bs) for t in set(eval_prompt_lengths)])  # evaluation: one completion each
    if blocks < needed:
        raise least_pool_error(config, blocks, needed)
    sizing = round_sizing(config, max([*prompt_lengths, *eval_prompt_lengths]))
    total = sum(kv_pool_bytes(shapes, blocks, bs, kv_bytes(config, device.type), sizing=sizing).values())
    available = available_memory(device)
    if available is not None and total > available:
        where = f"free on {device}" if device.type == "cuda" else "MemAvailable in /proc/meminfo"
        fit = _most_pages(lambda n: sum(kv_pool_bytes(shapes, n, bs, kv_bytes(config, device.type),
                                                      sizing=sizing).values()) <= available, blocks)
        page = sum(page_bytes(layers, bs, kv_bytes(config, device.type))
                   for _, _, layers in page_groups(shapes, 1, bs, sizing))
        raise ValueError(f"kv_cache_blocks {blocks} is too many: the KV pool would take {total / GiB:.1f} GiB ({page} "
                         f"bytes a page), and {available / GiB:.1f} GiB is available ({where}); at most {fit} pages "
                         "fit there, before "
                         "the model and the training step take theirs; or leave it unset to size the pool from "
                         "sampling_memory_fraction")


def _most_pages(fits, most: int, least: int = 0) -> int:
    """The largest page count in [least, most] for which `fits` holds (it holds for every smaller count); least - 1
    when none."""
    low, high = least - 1, most
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


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
       pages and one completion's (completions one after another). A window's pool follows the logical pool
       (window_group_pages).
    A model with no MLP to tile (experts, GPT-2's) keeps its MLP whole: only the micro-batch, chunk and pool vary.

    ValueError, naming what would fit, when even micro-batch 1 with the smallest tile and chunk does not."""
    import dataclasses

    step = config.per_device_train_batch_size * config.gradient_accumulation_steps
    limit = usable(gpu_bytes)
    given = config.mlp_tile_tokens
    if not shapes.tileable:  # no MLP to tile (gpt-oss, Qwen3-MoE, GPT-2): tiles would be refused
        tiles = (given,)
    elif given:
        tiles = (given, *(t for t in MLP_TILES if t < given))
    else:
        tiles = (None, *MLP_TILES)
    for mb in sorted((d for d in range(1, step + 1) if step % d == 0), reverse=True):
        for tile in tiles:
            trial = config if tile == given else dataclasses.replace(config, mlp_tile_tokens=tile)
            for chunk in LOSS_CHUNKS:
                plan = plan_memory(trial, device_type=device_type, micro_batch=mb, chunk_tokens=chunk, shapes=shapes,
                                   prompt_length=prompt_length)
                if max(plan.peak(p) for p in plan.phases if p != "sampling") > limit:
                    continue
                if plan.peak("sampling") > limit:  # fewer KV pages: the engine runs the round in waves (preemption)
                    blocks = _pages_that_fit(plan, trial, shapes, device_type, limit)
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
        + what_would_fit(config, shapes, device_type, gpu_bytes, micro_batch=1))


def _pages_that_fit(plan: Plan, config: TrainConfig, shapes: Shapes, device_type: str, limit: int) -> int:
    """The most logical pages (at most the plan's) whose pools (kv_pool_bytes: windows' pools follow the logical
    pool's size, window_group_pages) keep the sampling phase within `limit` bytes."""
    s = shapes.lora(config) if config.use_peft else shapes
    value_bytes, fp8 = kv_bytes(config, device_type), config.kv_cache_dtype == "fp8"
    sizing = plan.settings["round_sizing"]
    pools = kv_pool_bytes(s, plan.settings["kv_blocks"], config.block_size, value_bytes, fp8, sizing=sizing)
    rest = plan.peak("sampling") - sum(pools.values())
    return _most_pages(lambda n: rest + sum(kv_pool_bytes(s, n, config.block_size, value_bytes, fp8,
                                                          sizing=sizing).values()) <= limit, plan.settings["kv_blocks"])


def plan_run(config: TrainConfig, shapes: Shapes, device_type: str, gpu_bytes: int | None,
             prompt_length: int | None = None) -> Plan:
    """The plan `fastgrpo train` and `fastgrpo plan` act on: auto_fit's with config.auto_fit (which needs
    gpu_bytes), else the plan of the config as it is. What train refuses before its first step is refused here too,
    in the same line (check_plannable)."""
    check_plannable(config, shapes, prompt_length or config.max_prompt_length or 512)
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


def what_would_fit(config: TrainConfig, shapes: Shapes, device_type: str, gpu_bytes: int,
                   micro_batch: int | None = None) -> str:
    """The memory options not yet on, added one by one until one fits, with the peak of each (and whether it fits),
    at `micro_batch` (default the configured per_device_train_batch_size, which the line names) and the default loss
    chunk; when none fits there, the same options at micro-batch 1 and the smallest loss chunk (what --auto-fit can
    reach)."""
    import dataclasses

    mb = micro_batch or config.per_device_train_batch_size
    steps = [{"use_peft": True}, {"load_in_4bit": True}, {"offload_activations": config.gradient_checkpointing},
             {"max_completion_length": max(1, config.max_completion_length // 2)}]
    if shapes.tileable:
        steps.insert(3, {"mlp_tile_tokens": min(config.mlp_tile_tokens or MLP_TILES[-1], MLP_TILES[-1])})
    if any(layer.experts for layer in shapes.per_layer):  # LoRA on experts takes no dropout (fastgrpo.train.lora)
        steps[0] = {"use_peft": True, "lora_dropout": 0.0}
    changes, said = {}, []
    limit = usable(gpu_bytes)

    def peak(trial: TrainConfig, micro: int, chunk: int | None) -> int:
        return plan_memory(trial, device_type=device_type, micro_batch=micro, chunk_tokens=chunk, shapes=shapes).peak()

    def flags(values: dict) -> str:
        return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in values.items())

    fits = False
    for step in steps:
        if all(getattr(config, k) == v for k, v in step.items()):
            continue
        changes |= step
        value = peak(dataclasses.replace(config, **changes), mb, None)
        fits = value <= limit
        said.append(f"{flags(changes)}: {value / GiB:.1f} GiB" + (" (fits)" if fits else ""))
        if fits:
            break
    if not said:
        return "no memory option is left to try: a larger GPU is needed"
    text = f"at --per-device-train-batch-size {mb}, with " + "; with ".join(said)
    if not fits and mb > 1:
        value = peak(dataclasses.replace(config, **changes), 1, 256)
        text += (f"; with {flags(changes)} --per-device-train-batch-size 1 --loss-chunk-tokens 256: "
                 f"{value / GiB:.1f} GiB" + (" (fits)" if value <= limit else ""))
    return text


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
    groups = plan.settings["page_groups"]
    if len(groups) > 1 or any(layers == 0 for _, _, layers, _ in groups):  # windows, or no full-attention layer
        said = [f"{'logical' if w is None else f'window {w}'}: {pages} pages x {size / 2**10:.0f} KiB ({layers} layers)"
                for w, pages, layers, size in groups]
        lines.append("KV pools (pages + a scratch page each): " + "; ".join(said))
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
