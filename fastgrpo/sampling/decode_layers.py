"""The engine's own forward for Llama/Qwen2/Qwen3 models: one GEMM for q/k/v, one for gate/up, fused elementwise ops.

transformers' decoder layer runs about 39 kernels per layer in decode (RMSNorm ~8, rotary ~10, the residual adds,
three q/k/v GEMMs, two gate/up GEMMs, SiLU, multiply, the cache stores). Here a layer is

    add_rms_norm -> qkv GEMM -> rope_store (q/k norms, rotary, K/V into their pages) -> paged attention -> o_proj
    -> add_rms_norm -> gate_up GEMM -> silu_mul -> down_proj

with the model's own parameters: q/k/v and gate/up of each layer are fused in place, once, into one buffer each,
the trained parameters becoming row slices of it (their identity, gradients and optimizer states are unchanged; a
GEMM over the buffer computes all of them; save_pretrained clones such slices when it writes). There is no copy of
any weight.

Two sets of ops compute the same layer. "triton" (CUDA, or Triton's interpreter): the kernels of
fastgrpo.kernels.decode_ops, 5 kernels besides the GEMMs and attention. "torch" (CPU): the very PyTorch ops
transformers' modules run, over the fused GEMMs' outputs, so a CPU samples the tokens it sampled before.

Models of another architecture, or whose projections are not plain nn.Linear (LoRA, 4-bit), carry hooks, or are
sharded (FSDP), keep transformers' modules with the paged attention function (`unsupported` says why).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fastgrpo.sampling.attention import FP8_MAX, PagedBatch, attend, layer_kv, store_kv

FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _linears(layer) -> dict[str, nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return dict(q_proj=attn.q_proj, k_proj=attn.k_proj, v_proj=attn.v_proj, o_proj=attn.o_proj,
                gate_proj=mlp.gate_proj, up_proj=mlp.up_proj, down_proj=mlp.down_proj)


def unsupported(hf_model) -> str | None:
    """Why the fused forward cannot run this model; None when it can."""
    name = type(hf_model).__name__
    if name not in FAMILIES:
        return f"{name} is not one of {', '.join(FAMILIES)}"
    config = hf_model.config.get_text_config()
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act is {config.hidden_act!r}, not 'silu'"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1 splits the MLP differently"
    inner = hf_model.model
    for index, layer in enumerate(inner.layers):
        attn = layer.self_attn
        if attn.head_dim & (attn.head_dim - 1):
            return f"head_dim {attn.head_dim} is not a power of 2"
        for proj, module in _linears(layer).items():
            where = f"layers[{index}].{proj}"
            if type(module) is not nn.Linear:
                return f"{where} is a {type(module).__name__}, not a plain nn.Linear (LoRA, quantized)"
            for param in module.parameters(recurse=False):
                if isinstance(param, DTensor) or isinstance(param.data, DTensor):
                    return f"{where} holds a DTensor (sharded parameters)"
        for module in layer.modules():
            if module._forward_hooks or module._forward_pre_hooks:
                return f"layers[{index}] has forward hooks"
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if len({_linears(layer)[p].bias is None for p in group}) > 1:
                return f"layers[{index}]: {', '.join(group)} do not all have a bias, or all lack one"
    return None


def fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) buffers of `linears` stacked by rows, each module's parameters made row slices of them (in
    place: the same Parameter objects). Already-fused modules are returned as they are."""
    weight, bias = _stacked(linears)
    if weight is None:
        with torch.no_grad():
            weight = torch.cat([m.weight.detach() for m in linears])
            bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
            start = 0
            for m in linears:
                rows = m.weight.shape[0]
                m.weight.data = weight[start : start + rows]
                if bias is not None:
                    m.bias.data = bias[start : start + rows]
                start += rows
    return weight, bias


def _stacked(linears: list[nn.Linear]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The buffers when the modules' parameters already are consecutive row slices of one; (None, None) otherwise.
    (Storages and offsets, not data pointers: fake tensors, which traces run on, have none.)"""
    buffers = []
    for name in ("weight", "bias"):
        params = [getattr(m, name) for m in linears]
        if params[0] is None:
            buffers.append(None)
            continue
        first = params[0]
        storage, expected = _storage(first), first.storage_offset()
        for p in params:
            if (_storage(p) != storage or p.storage_offset() != expected or not p.is_contiguous()
                    or p.dtype != first.dtype):
                return None, None
            expected += p.numel()
        rows = sum(p.shape[0] for p in params)
        buffers.append(first.data.as_strided((rows, *first.shape[1:]), first.stride()))
    return buffers[0], buffers[1]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedLayer:
    """One decoder layer's fused buffers and the modules it reads its other parameters from."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.attn, self.mlp = layer, attn, mlp
        self.qkv_modules = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.gate_up_modules = [mlp.gate_proj, mlp.up_proj]
        self.qkv_weight, self.qkv_bias = fuse_rows(self.qkv_modules)
        self.gate_up_weight, self.gate_up_bias = fuse_rows(self.gate_up_modules)
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)

    def stale(self) -> bool:
        """Whether a parameter stopped being a slice of the buffers (replaced by `.to()`, a load with assign=True)."""
        for modules, buffer in ((self.qkv_modules, self.qkv_weight), (self.gate_up_modules, self.gate_up_weight)):
            stacked = _stacked(modules)[0]
            if stacked is None or _storage(stacked) != _storage(buffer) or stacked.storage_offset() != \
                    buffer.storage_offset():
                return True
        return False


class FusedDecoder:
    """logits = decoder(input_ids [T], positions [T], batch, keep): the engine's forward over its packed tokens."""

    def __init__(self, hf_model, ops: str):
        assert ops in ("torch", "triton"), ops
        reason = unsupported(hf_model)
        if reason is not None:
            raise ValueError(f"the fused decode layers cannot run this model: {reason}")
        self.hf_model, self.ops = hf_model, ops
        if ops == "triton":
            from fastgrpo.kernels import decode_ops  # noqa: F401  (registers torch.ops.fastgrpo.*)
        self.refresh()

    def refresh(self) -> None:
        """Fuse (again) where a layer's parameters are no longer slices of its buffers; called by every generate."""
        inner = self.hf_model.model
        layers = getattr(self, "layers", None)
        if layers is None or len(layers) != len(inner.layers) or any(layer.stale() for layer in layers):
            self.layers = [FusedLayer(layer) for layer in inner.layers]

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        batch: PagedBatch,
        keep: torch.Tensor | int = 0,  # 0: every token's logits; else the packed indices of the rows to keep
    ) -> torch.Tensor:  # [rows kept, V]
        inner = self.hf_model.model
        hidden = inner.embed_tokens(input_ids)  # [T, H]
        cos, sin = (t[0] for t in inner.rotary_emb(hidden[None], positions[None]))  # [T, D] each
        residual = None
        for index, layer in enumerate(self.layers):
            kv = layer_kv(batch, index)  # k_cache, v_cache, and their scales (fp8) or None
            normed, residual = self._add_norm(hidden, residual, layer.layer.input_layernorm)
            queries = self._qkv(layer, normed, cos, sin, *kv, batch.slot_mapping)  # [T, Hq, D]
            out = attend(queries, kv[0], kv[1], batch, layer.attn.scaling, kv[2], kv[3])
            hidden = layer.attn.o_proj(out.flatten(1))
            normed, residual = self._add_norm(hidden, residual, layer.layer.post_attention_layernorm)
            gate_up = F.linear(normed, layer.gate_up_weight, layer.gate_up_bias)
            hidden = layer.mlp.down_proj(self._silu_mul(gate_up, layer.mlp))
        if not isinstance(keep, int) or keep:  # the final norm is per row: only the kept rows need it
            hidden, residual = hidden[keep], residual[keep]
        normed, _ = self._add_norm(hidden, residual, inner.norm)
        return self.hf_model.lm_head(normed)

    def _add_norm(self, x, residual, norm) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops == "triton":
            return torch.ops.fastgrpo.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
        summed = x if residual is None else residual + x
        return norm(summed), summed

    def _qkv(self, layer: FusedLayer, x, cos, sin, k_cache, v_cache, k_scale, v_scale, slots) -> torch.Tensor:
        qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)  # [T, (Hq + 2 Hkv) D]
        num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
        num_heads = qkv.shape[1] // head_dim - 2 * num_kv
        if self.ops == "triton":
            norm_weights = (None, None) if layer.q_norm is None else (layer.q_norm.weight, layer.k_norm.weight)
            eps = 0.0 if layer.q_norm is None else layer.q_norm.variance_epsilon
            return torch.ops.fastgrpo.rope_store(qkv, cos, sin, *norm_weights, k_cache, v_cache, slots, num_heads,
                                                 eps, k_scale, v_scale)  # fmt: skip
        q, k, v = qkv.split([num_heads * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
        q, k, v = q.view(-1, num_heads, head_dim), k.view(-1, num_kv, head_dim), v.view(-1, num_kv, head_dim)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = cos[:, None], sin[:, None]
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        store_kv(k_cache, v_cache, slots, k, v, k_scale, v_scale)
        return q.to(qkv.dtype)

    def _silu_mul(self, gate_up, mlp) -> torch.Tensor:
        if self.ops == "triton":
            return torch.ops.fastgrpo.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return mlp.act_fn(gate) * up


# -- fp8 KV cache: per-head scales from a bound on the keys and values --


# The families whose layers kv_scales reads: an RMSNorm before k_proj / v_proj (nn.Linear, LoRA or 4-bit), optional
# per-head RMSNorm on keys, none on values, rotary over halves of each head (transformers' rotate_half).
FP8_FAMILIES = (*FAMILIES, "MistralForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")


def kv_scales_unsupported(hf_model) -> str | None:
    """Why kv_scales cannot bound this model's keys and values; None when it can."""
    name = type(hf_model).__name__
    if name not in FP8_FAMILIES:
        return f"{name} is not one of {', '.join(FP8_FAMILIES)}"
    for index, layer in enumerate(hf_model.model.layers):
        if "RMSNorm" not in type(layer.input_layernorm).__name__:
            return f"layers[{index}].input_layernorm is a {type(layer.input_layernorm).__name__}, not an RMSNorm"
        for proj in ("k_proj", "v_proj"):
            reason = _linear_unsupported(getattr(layer.self_attn, proj))
            if reason is not None:
                return f"layers[{index}].{proj} is {reason}"
    return None


def _norm_gain(norm: nn.Module) -> torch.Tensor:
    """fp32 [dim]: what an RMSNorm multiplies the normalised input by: its weight, or 1 + weight for Gemma's."""
    weight = _dense(norm.weight).float()
    return 1.0 + weight if type(norm).__name__.startswith("Gemma") else weight


def _is_lora(module) -> bool:
    return all(hasattr(module, name) for name in ("base_layer", "lora_A", "get_delta_weight", "active_adapters"))


def _linear_unsupported(module) -> str | None:
    if _is_lora(module):
        if any(module.use_dora.get(adapter, False) for adapter in module.active_adapters):
            return "a DoRA layer"
        return _linear_unsupported(module.base_layer)
    if type(module) is nn.Linear or type(getattr(module, "weight", None)).__name__ in ("Params4bit", "Int8Params"):
        return None
    return f"a {type(module).__name__}, not an nn.Linear, a peft LoRA layer or a bitsandbytes-quantized Linear"


def _dense(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (FSDP2: an all-gather, which every rank makes in the same order)."""
    t = t.data if isinstance(t, nn.Parameter) and isinstance(t.data, DTensor) else t
    return t.full_tensor() if isinstance(t, DTensor) else t


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 (weight [out, in], bias [out] or None) of the linear map `module` computes: an nn.Linear's parameters; a
    peft LoRA layer's base plus its active adapters' deltas (peft's own get_delta_weight, as a merge adds them); a
    bitsandbytes base dequantized by peft."""
    if _is_lora(module):
        weight, bias = linear_weight(module.base_layer)
        if not (module.disable_adapters or module.merged):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + _dense(module.get_delta_weight(adapter)).float()
        return weight, bias
    if type(module) is nn.Linear:
        weight = module.weight
    else:
        from peft.utils.integrations import dequantize_module_weight

        weight = dequantize_module_weight(module)
    bias = None if module.bias is None else _dense(module.bias).float()
    return _dense(weight).float(), bias


def kv_scales(hf_model) -> torch.Tensor:  # [layers, 2, Hkv] fp32
    """Per layer, for K and for V, per KV head: the power of two s = 2^ceil(log2(bound / 448)), where `bound` bounds
    |k| (|v|) over every possible input, so that k / s never passes e4m3's largest value 448. No calibration data, no
    overflow, and the same weights give the same scales whatever is sampled (the tokens do not depend on the batch).

    The input of k_proj / v_proj is u = g * xn, g the input RMSNorm's weight [H] and xn the normalised residual, whose
    norm is at most sqrt(H) (rms(xn) <= 1). By Cauchy-Schwarz, for output row j of W [out, H] with bias b:

        |v_j| <= B_j = sqrt(H) ||W_j * g||_2 + |b_j|
        |k_j| <= B_j as well; Qwen3's per-head k_norm (weight w) makes it sqrt(D) |w_j| instead
        rotary mixes j with j + D/2 (times the rotary's attention_scaling a):  |k'_j| <= a sqrt(B_j^2 + B_{j+D/2}^2)

    and bound = the largest over the head's D values. The bound is reached only by an input aligned with a weight
    row, so typical values sit well below 448 (a factor ~sqrt(H) for random directions): e4m3's relative precision
    (3 mantissa bits) is the same over its normal range [2^-6, 448], so the headroom costs precision only for values
    more than 2^15 below the bound. Powers of two make k / s and k8 * s exact, so the torch path, the Triton kernels
    and a GPU round the same values the same way. A value can pass the bound only by the rounding of the model's
    dtype (< 1% in bf16); it is then clamped to +-448 (attention.quantize_kv, the rope_store kernel)."""
    inner = hf_model.model
    # (YaRN scales cos and sin; Gemma 3 keeps one rotary per layer type, each with its own `<type>_attention_scaling`)
    rotary_gain = max([float(v) for k, v in vars(inner.rotary_emb).items() if k.endswith("attention_scaling")] or [1.0])
    per_layer = []
    for layer in inner.layers:
        attn = layer.self_attn
        head_dim = attn.head_dim
        gamma = _norm_gain(layer.input_layernorm)  # [H]
        bounds = []
        for proj in (attn.k_proj, attn.v_proj):
            weight, bias = linear_weight(proj)
            bound = gamma.numel() ** 0.5 * (weight * gamma).norm(dim=1)  # [Hkv * D]
            bounds.append((bound if bias is None else bound + bias.abs()).view(-1, head_dim))  # [Hkv, D]
        k_bound, v_bound = bounds
        k_norm = getattr(attn, "k_norm", None)
        if k_norm is not None:
            k_bound = head_dim**0.5 * _norm_gain(k_norm).abs().expand_as(k_bound)
        half = head_dim // 2
        rotated = rotary_gain * (k_bound[:, :half] ** 2 + k_bound[:, half:] ** 2).sqrt()  # [Hkv, D / 2]
        per_layer.append(torch.stack([rotated.amax(-1), v_bound.amax(-1)]))  # [2, Hkv]
    bound = torch.stack(per_layer)  # [layers, 2, Hkv]
    # (an all-zero layer's bound of 0 gets the scale 2^-126, fp32's smallest normal power of two)
    return torch.exp2(torch.ceil(torch.log2(bound / FP8_MAX))).clamp(min=2.0**-126)
