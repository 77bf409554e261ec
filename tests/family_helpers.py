"""Tiny random models of the 2026 model families, built from transformers' own configs (fp32, hidden 64, 2 layers)
with the arithmetic task's character tokenizer: what the family tests train and check.

Windows are 8 tokens, shorter than the built-in task's prompts (9-13 tokens) plus completions, so sliding-window
layers really drop old positions. MoE models have 4 experts, 2 per token.
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from fastgrpo.train import arithmetic

WINDOW = 8
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# model_type -> the options on top of COMMON (each family's own defaults otherwise: Gemma ties its head, gpt-oss and
# Mixtral name their experts num_local_experts, Gemma 2 caps its attention scores).
FAMILIES = {
    "gemma": dict(),
    "gemma2": dict(sliding_window=WINDOW),  # final_logit_softcapping 30 by default
    "gemma3_text": dict(sliding_window=WINDOW, final_logit_softcapping=30.0),  # Gemma 3 270M has none; 1B-27B 30
    "gemma4_text": dict(sliding_window=WINDOW, final_logit_softcapping=30.0, hidden_size_per_layer_input=8,
                        global_head_dim=32),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=WINDOW,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mistral": dict(sliding_window=WINDOW),
    "qwen3_moe": dict(EXPERTS),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(EXPERTS, shared_expert_intermediate_size=32),
    "cohere": dict(logit_scale=0.25),  # Command-R's 0.0625 bends the probe's logits too little to tell apart
}
MOE = ("gpt_oss", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
# Hybrid models (recurrent state beside the pages), 4 layers each: 3 recurrent and 1 attention as Qwen3.5 and
# Granite-4.0-H mix them, Nemotron-H's Mamba / attention / Mamba / MoE, LFM2's convolutions between attention.
# Mamba-2 scans in chunks of 8 (128-256 in the released models) so that prompts cross chunks.
_GDN = dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8)
HYBRIDS = {
    "qwen3_5_text": _GDN,
    "qwen3_5_moe_text": dict(_GDN, **EXPERTS, shared_expert_intermediate_size=32),
    "qwen3_next": dict(_GDN, **EXPERTS, shared_expert_intermediate_size=32),
    "nemotron_h": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "full_attention",
                                                               "linear_attention", "moe"],
                       mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32),
    "granitemoehybrid": dict(_MAMBA, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                             num_local_experts=4, num_experts_per_tok=2),
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2),
}
FAMILIES.update(HYBRIDS)
# Gemma 4's other layer kinds: its MoE block (26B-A4B), and layers that read an earlier layer's keys and values (E2B,
# E4B): with 4 layers, the last two share the first two's.
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
GEMMA4_KV_SHARED = dict(num_hidden_layers=4, num_kv_shared_layers=2, layer_types=["sliding_attention",
                                                                                  "full_attention"] * 2)


def tiny_model(family: str, **options) -> PreTrainedModel:
    """A random `family` model (seed 0) sized for the arithmetic tokenizer, in fp32."""
    tokenizer = arithmetic.build_tokenizer()
    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **options}, vocab_size=len(tokenizer),
                                  bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    return model


def save_tiny_model(family: str, folder, **options) -> str:
    """tiny_model(family) and the arithmetic tokenizer saved in `folder`, for model_name_or_path."""
    tiny_model(family, **options).save_pretrained(folder)
    arithmetic.build_tokenizer().save_pretrained(folder)
    return str(folder)
