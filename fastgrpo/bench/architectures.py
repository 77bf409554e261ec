"""The architecture sweep: every causal-LM type in transformers, tiny and random, sampled by the engine and checked
against the model's own answers; each one matches, or the engine refuses it in one line.

    fastgrpo bench architectures          # every type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: ~90 s of one core

Per model type: a tiny fp32 config from transformers' own config class (2-4 layers covering every layer kind the
type mixes, hidden 64, 4 heads on 2 KV heads of 16, 4 experts top-2, every window 8), then
- greedy: the engine's tokens equal `model.generate(do_sample=False)`'s, eos off, on prompts of 3, 17 and 33 tokens
  with 24 new tokens (so prompt + completion outgrow the window);
- sampled: at temperature 1 with a seed, each token's logprob equals a full forward's log_softmax within 1e-4.
A row is `match`, `refused` (the engine's one-line ValueError), `mismatch` (where they first differ), `crash` (any
other exception: a bug) or `not buildable` (why no tiny model or no reference could be had).

Writes <out-dir>/architectures-<date>.md.
"""

import argparse
import contextlib
import datetime
import io
import math
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

WINDOW = 8  # every sliding window, attention chunk and local span: prompts of 17 and 33 tokens outgrow it
PROMPT_LENGTHS = (3, 17, 33)
NEW_TOKENS = 24
LOGPROB_TOLERANCE = 1e-4  # fp32: the types that match differ from one full forward by 8e-6 at most (2026-11-28)
STATUSES = ("match", "refused", "mismatch", "crash", "not buildable")
MIN_LAYERS, MAX_LAYERS = 2, 4

# Sizes by transformers' standard attribute names (a config's attribute_map resolves its own: GPT-2's n_embd), set
# wherever the config class has the field: None there means "derive it" (head_dim from hidden / heads).
SIZES = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "vocab_size": 256,
    # encoder-decoder families whose decoder alone is a causal LM (BART's BartForCausalLM)
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
}  # fmt: skip
# Set only where the default sets them: None there switches the feature off (DeepSeek-V2-Lite's q_lora_rank).
OPTIONAL_SIZES = {
    # MoE: 4 experts, top-2, one shared expert, one expert group
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "num_experts_per_token": 2, "moe_topk": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "num_expert_group": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,  # then MoE from the 2nd layer on
    "moe_layer_start_index": 1,
    # MLA (DeepSeek-V2/V3 and kin): compressed latents, K and V of different head dims
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    # linear attention / Gated DeltaNet
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16,
    # partial rotary of GPT-J / CodeGen (64 of 256 there)
    "rotary_dim": 8,
    # Gemma 3n / 4 per-layer inputs
    "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,
}  # fmt: skip
WINDOWS = ("sliding_window", "attention_chunk_size", "sliding_window_size", "attention_window_size",
           "local_attention_window_len")  # fmt: skip
MAX_POSITIONS = 512  # prompts + completions reach 57; learned position tables of 128K rows would dwarf the model
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
FIRST_WORD = 3  # prompts draw ids from [3, vocab): clear of the special tokens above

_MAMBA = {"mamba_n_heads": 8}  # mamba_d_head = expand 2 x hidden 64 / 8 heads = 16
_ALTERNATING = ["sliding_attention", "full_attention"] * 2
_DOTS3_SLIDING = {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 32,
                  "swa_kv_lora_rank": 32, "swa_head_dim": 24, "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 16}
_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
            "indexer_compress_ratio": 4}
# Where the generic shrink breaks a config: model type -> (config kwargs, why).
OVERRIDES: dict[str, tuple[dict, str]] = {
    "bamba": ({**_MAMBA, "attn_layer_indices": [1]}, "its attention layers are listed by index (10 of 32 there)"),
    "granitemoehybrid": ({**_MAMBA, "layer_types": ["linear_attention", "full_attention"]},
                         "the default layer_types is all Mamba: Granite-4.0-H mixes in attention"),
    "falcon_h1": (_MAMBA, "mamba_n_heads must divide expand x hidden"),
    "jamba": ({"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
              "attention every 8th layer from the 4th: in 2 layers, every 2nd from the 1st"),
    "zamba": ({"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
              "its shared transformer block is tied across hybrid layers: two of them at least"),
    "qwen4_exp": (_INDEXER, "the default leaves the indexer's sizes None: the model cannot build"),
    "qwen4_exp_text": (_INDEXER, "the default leaves the indexer's sizes None: the model cannot build"),
    "blt": ({"encoder_hash_byte_group_vocab": 1024}, "500K hash-embedding rows take 20 s to initialise"),
    "recurrent_gemma": ({"num_hidden_layers": 3}, "block_types repeat (recurrent, recurrent, attention): all 3 kinds"),
    "mamba2": ({"num_heads": 8, "n_groups": 1}, "num_heads x head_dim must equal expand x hidden"),
    "xlstm": ({"embedding_dim": 64, "num_heads": 4, "qk_dim_factor": 1.0},
              "embedding_dim is the width too; its recurrent step keeps a state of the value head dim on both sides"),
    "xlnet": ({"d_head": 16}, "d_head must equal d_model / n_head"),
    "zaya": ({"num_experts_per_tok": 1}, "ZAYA routes each token to one expert only"),
    "dbrx": ({"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
              "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
             "its sub-configs hold heads and experts; the default attn_config lacks the rope_theta and clip_qkv the "
             "model reads"),
    "deepseek_v2": ({"num_experts_per_tok": 2}, "the default leaves num_experts_per_tok None: the model cannot route"),
    "dots1": ({"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1},
              "the default leaves the expert counts None, which the model cannot build"),
    "lfm2": ({"full_attn_idxs": [1, 3], "layer_types": None},
             "the default config is attention only; LFM2's released models mix short convolutions and attention"),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
                 "the default layer_types is None: the model cannot build (LFM2-8B-A1B mixes conv and attention)"),
    "cohere_compass_text": ({"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        "the model reads rope_parameters per layer type, which the default does not key"),
    "dory": ({"num_hidden_layers": 4, "layer_types": _ALTERNATING, "n_input_layers": 1, "n_recurrent_layers": 2,
              "n_output_layers": 1}, "8 input + 8 output layers around a looped middle: 1 + 2 + 1 here"),
    "inkling2_text": ({"unpadded_vocab_size": 256}, "the unembedding's unpadded size must fit the vocab"),
    "inkling2_loop_text": ({"unpadded_vocab_size": 256}, "the unembedding's unpadded size must fit the vocab"),
    "reformer": ({"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 8], "max_position_embeddings": 64},
                 "axial position embeddings: their dims sum to hidden, their shape multiplies to the positions"),
    "prophetnet": ({"num_encoder_layers": 2, "num_decoder_layers": 2},
                   "num_hidden_layers cannot be set: encoder and decoder layers are separate"),
    "xmod": ({"default_language": "en_XX"}, "its adapters need a language"),
    "flint": ({"mlp_only_layers": [0]}, "its first 2 layers are dense: the 1st here, then MoE"),
    "longcat_flash": ({"num_layers": 1, "expert_ffn_hidden_size": 64, "zero_expert_num": 2},
                      "num_layers counts pairs of sublayers (num_hidden_layers = 2 x num_layers)"),
    "hrm_text": ({"num_layers_per_stack": 2, "num_hidden_layers": 16},
                 "num_hidden_layers counts cycled layers: 2 per stack x 2 H-cycles x (3 L-cycles + 1)"),
    "dots3_note_text": (_DOTS3_SLIDING, "its sliding layers take their MLA sizes from swa_* arguments, 64 heads there"),
    "dots3_note": (_DOTS3_SLIDING, "its sliding layers take their MLA sizes from swa_* arguments, 64 heads there"),
}  # fmt: skip
# Gemma 4's E-sizes share the last layers' K/V (with global layers of twice the head dim): the text type keeps both.
OVERRIDES["gemma4_text"] = ({"num_hidden_layers": 4, "layer_types": _ALTERNATING, "num_kv_shared_layers": 2,
                             "global_head_dim": 32}, "4 layers, the last 2 reading the first 2's K/V, as Gemma 4 E2B")
_GLOBAL_HEAD_DIM = ({"global_head_dim": 32}, "global layers of twice the head dim, as in Gemma 4 (256 / 512)")
OVERRIDES["gemma4_unified_text"] = _GLOBAL_HEAD_DIM
for _type in ("gemma4", "gemma4_unified"):
    OVERRIDES[_type] = ({"text_config": _GLOBAL_HEAD_DIM[0]}, _GLOBAL_HEAD_DIM[1])
OVERRIDES["gemma3n_text"] = ({"num_hidden_layers": 4, "layer_types": _ALTERNATING, "num_kv_shared_layers": 2},
                             "15 of 35 layers share K/V there: the last 2 of 4 here, each kind shared")

# Types that no config alone turns into a model the sweep can run: model type -> why.
NOT_BUILDABLE: dict[str, str] = {
    "gemma4_assistant": "a speculative-decoding draft: its forward takes the target model's embeddings and KV states",
    "gemma4_unified_assistant": "a speculative-decoding draft: its forward takes the target model's embeddings and KV "
                                "states",
    "gemma3n": "its vision tower needs the timm package",
    "blt": "transformers cannot generate with it: its cache reads num_hidden_layers, which BltConfig does not have",
    "musicgen": "its input_ids are audio codes, num_codebooks rows per sequence, not a token prompt",
    "musicgen_melody": "its input_ids are audio codes, num_codebooks rows per sequence, not a token prompt",
}


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal-LM class, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# -- tiny configs --------------------------------------------------------------------------------------------------


def tiny_config(model_type: str):
    """(a tiny fp32 config of `model_type`, None), or (None, why it cannot be built from a config).

    Built by transformers' own config class with the sizes above; a multimodal type whose causal-LM class takes
    only the text config (Mllama, Llama 4, Qwen3.5) gets that text config."""
    from huggingface_hub.errors import StrictDataclassError

    if model_type in NOT_BUILDABLE:
        return None, NOT_BUILDABLE[model_type]
    config_class = _config_class(model_type)
    overrides = OVERRIDES.get(model_type, ({}, ""))[0]
    try:
        return _shrunk(config_class, overrides), None
    except (ValueError, TypeError, NotImplementedError, RuntimeError, StrictDataclassError) as error:  # validation
        return None, f"config: {one_line(error)}"


def causal_lm_class(model_type: str):
    """The class transformers maps `model_type` to for causal LM."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class, takes = CONFIG_MAPPING[model_type], causal_lm_class(model_type).config_class
    if takes is not config_class and takes in config_class.sub_configs.values():
        return takes  # the causal LM is the text half of a multimodal model
    return config_class


def _shrunk(config_class, overrides: dict):
    """config_class built with SIZES, WINDOWS, few layers and in-vocab special tokens; sub-configs (text, vision,
    audio) shrunk the same way."""
    from transformers import PreTrainedConfig

    default = config_class()
    # the class's own fields: attributes its __post_init__ derives (DeepSeek's head_dim = qk_rope_head_dim) are not
    fields = set(getattr(config_class, "__dataclass_fields__", None) or vars(default))

    def has(name: str) -> bool:
        return name in fields or name in config_class.attribute_map

    def set_by_default(name: str) -> bool:
        return has(name) and _default(default, name) is not None

    kwargs = {}
    for name in config_class.sub_configs:
        sub = getattr(default, name, None)
        if isinstance(sub, PreTrainedConfig):
            kwargs[name] = _shrunk(type(sub), overrides.get(name, {}))
    kwargs |= {name: value for name, value in SIZES.items() if has(name)}
    kwargs |= {name: value for name, value in OPTIONAL_SIZES.items() if set_by_default(name)}
    kwargs |= {name: WINDOW for name in WINDOWS if set_by_default(name)}
    if set_by_default("max_position_embeddings") and _default(default, "max_position_embeddings") > MAX_POSITIONS:
        kwargs["max_position_embeddings"] = MAX_POSITIONS
    kwargs |= {name: value for name, value in TOKEN_IDS.items() if set_by_default(name)}
    if set_by_default("kv_lora_rank"):  # MLA decompresses K and V per query head; its rotary runs on qk_rope_head_dim
        kwargs |= {"num_key_value_heads": SIZES["num_attention_heads"], "head_dim": OPTIONAL_SIZES["qk_rope_head_dim"]}
    kwargs["dtype"] = "float32"
    if "is_decoder" in fields:  # BERT-style encoders are causal LMs only as decoders
        kwargs["is_decoder"] = True
    kwargs |= _fewer_layers(default, overrides.get("num_hidden_layers"))
    kwargs |= {name: value for name, value in overrides.items() if name not in config_class.sub_configs}
    # by the class's own field names: its __post_init__ reads those (DBRX copies d_model into its ffn_config)
    return config_class(**{config_class.attribute_map.get(name, name): value for name, value in kwargs.items()})


def _default(config, name: str):
    """config.<name>; for an attribute that varies per layer (transformers' heterogeneous configs refuse to read it
    globally) its first layer's value."""
    from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

    try:
        return getattr(config, name)
    except AmbiguousGlobalPerLayerAttributeError:
        return getattr(config.per_layer_config[0], name)


def _fewer_layers(default, wanted: int | None) -> dict:
    """num_hidden_layers of `wanted` (default 2-4) and every per-layer list (layer_types, mlp_layer_types, ...) cut to
    the layers kept: the fewest that show each kind every list holds (Gemma 3's 5 sliding + 1 full -> [sliding,
    full])."""
    layers = getattr(default, "num_hidden_layers", None)
    if isinstance(getattr(type(default), "num_hidden_layers", None), property):
        return {}  # derived from other counts (ProphetNet's encoder + decoder layers): the overrides set those
    if not isinstance(layers, int) or layers <= (wanted or MIN_LAYERS):
        return {} if wanted is None else {"num_hidden_layers": wanted}
    per_layer = {name: value for name, value in vars(default).items()
                 if isinstance(value, (list, tuple)) and len(value) == layers and not name.startswith("_")
                 and name != "per_layer_config"}  # fmt: skip
    kept = _cover(per_layer, layers, wanted)
    return {"num_hidden_layers": len(kept), **{name: [value[i] for i in kept] for name, value in per_layer.items()
                                               if name not in SIZES}}  # Gemma 3n's per-layer intermediate_size: 128


def _cover(per_layer: dict[str, list], layers: int, wanted: int | None) -> list[int]:
    """Layer indices, greedily: each next one shows the most (list, value) pairs not yet shown; at most `wanted`
    (default MAX_LAYERS), then the first others up to `wanted` (default MIN_LAYERS)."""
    pairs = [{(name, repr(value[i])) for name, value in per_layer.items()} for i in range(layers)]
    kept, shown = [], set()
    while len(kept) < (wanted or MAX_LAYERS):
        best = max(range(layers), key=lambda i: (len(pairs[i] - shown), -i))
        if not pairs[best] - shown:
            break
        kept.append(best)
        shown |= pairs[best]
    kept += [i for i in range(layers) if i not in kept][: max(0, (wanted or MIN_LAYERS) - len(kept))]
    return sorted(kept)


# -- one model type ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    model_type: str
    status: str  # one of STATUSES
    detail: str = ""
    seconds: float = 0.0


def sweep_one(model_type: str, *, attention: str = "torch", block_size: int = 4, new_tokens: int = NEW_TOKENS,
              prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 0) -> Row:
    """The engine on a tiny random `model_type` against the model's own greedy generate and full forward."""
    with _quiet_single_thread():
        return _sweep_one(model_type, attention, block_size, new_tokens, prompt_lengths, seed)


def _sweep_one(model_type: str, attention: str, block_size: int, new_tokens: int, prompt_lengths: tuple[int, ...],
               seed: int) -> Row:
    begin = time.perf_counter()

    def row(status: str, detail: str = "") -> Row:
        return Row(model_type, status, detail, time.perf_counter() - begin)

    config, reason = tiny_config(model_type)
    if config is None:
        return row("not buildable", reason)
    try:
        model = build_model(model_type, config, seed)
        vocab = config.get_text_config().vocab_size
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(FIRST_WORD, vocab, (n,), generator=g).tolist() for n in prompt_lengths]
        with contextlib.redirect_stdout(io.StringIO()):  # Reformer prints a warning per step
            want = [hf_greedy(model, prompt, new_tokens) for prompt in prompts]
    except Exception as error:  # noqa: BLE001 - no reference, nothing to hold the engine to
        return row("not buildable", f"reference: {one_line(error)}")
    try:
        from fastgrpo.sampling import Engine, SamplingParams

        engine = Engine(model, attention=attention, block_size=block_size)
        greedy = engine.generate(prompts, params=SamplingParams(temperature=0, max_new_tokens=new_tokens,
                                                                stop_token_ids=()))
        sampled = engine.generate(prompts, n=2, params=SamplingParams(temperature=1.0, max_new_tokens=new_tokens,
                                                                      stop_token_ids=(), seed=seed))
    except ValueError as error:
        if not raised_by_fastgrpo(error):
            return row("crash", f"{one_line(error)} (at {last_frame(error)})")
        message = str(error)
        if "\n" in message.strip():
            return row("crash", f"refusal of {len(message.strip().splitlines())} lines: {one_line(error)}")
        return row("refused", message)
    except Exception as error:  # noqa: BLE001 - every other exception is a bug the row records
        return row("crash", f"{one_line(error)} (at {last_frame(error)})")
    malformed = malformed_output(prompts, greedy, 1, new_tokens) or malformed_output(prompts, sampled, 2, new_tokens)
    if malformed:
        return row("mismatch", malformed)
    try:
        status, detail = compare(model, prompts, want, greedy, sampled, new_tokens)
    except Exception as error:  # noqa: BLE001 - the full forward of the reference failed
        return row("not buildable", f"reference forward: {one_line(error)}")
    return row(status, detail)


def build_model(model_type: str, config, seed: int):
    """The causal LM of `config` in fp32, eager attention, each Linear redrawn at std 1/sqrt(fan_in) so that
    attention weighs in the residual stream (a window of 8 against none moves tiny Mistral's logprobs by 11 at
    most, against 0.47 at transformers' std 0.02), lm_head at std 0.3 to peak the outputs (greedy then never
    hangs on a near tie)."""
    torch.manual_seed(seed)
    model = causal_lm_class(model_type)._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
        head = model.get_output_embeddings()
        if head is not None and getattr(head, "weight", None) is not None:
            head.weight.normal_(0.0, 0.3)
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens of model.generate, eos off."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, forced_eos_token_id=None,
                         forced_bos_token_id=None)
    tokens = out[0, len(prompt) :].tolist()
    if len(tokens) != new_tokens:
        raise RuntimeError(f"model.generate returned {len(tokens)} of {new_tokens} tokens")
    return tokens


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion), V] fp32 log_softmax of the logits that predicted each completion token, one full forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    if not torch.isfinite(logits).all():
        raise RuntimeError("the full forward's logits are not finite")
    return logits[len(prompt) - 1 : -1].log_softmax(-1)


def malformed_output(prompts, outputs, n: int, new_tokens: int) -> str | None:
    """What is wrong with the engine's output's shape (stops are off: every completion runs to new_tokens), or
    None."""
    if not isinstance(outputs, list) or len(outputs) != len(prompts):
        return f"the engine returned {type(outputs).__name__} for {len(prompts)} prompts"
    for group in outputs:
        if not isinstance(group, list) or len(group) != n:
            return f"the engine returned {group!r:.80} for a group of {n}"
        for c in group:
            if not len(c.token_ids) == len(c.logprobs) == new_tokens:
                return f"{len(c.token_ids)} tokens and {len(c.logprobs)} logprobs of {new_tokens} with stops off"
    return None


def compare(model, prompts, want, greedy, sampled, new_tokens: int) -> tuple[str, str]:
    """('match', max logprob error) or ('mismatch', where the engine first leaves the reference). A mismatch says
    too whether the engine's greedy tokens and generate's are each the argmax of the model's full forward (Moshi's
    generate is not: the engine follows the forward there)."""

    def follows(prompt: list[int], tokens: list[int]) -> bool:
        return forward_logprobs(model, prompt, tokens).argmax(-1).tolist() == tokens

    generate_follows = all(follows(prompt, tokens) for prompt, tokens in zip(prompts, want, strict=True))
    note = "" if generate_follows else "; model.generate is not the argmax of the model's full forward"
    for prompt, tokens, (got,) in zip(prompts, want, greedy, strict=True):
        if got.token_ids != tokens:
            first = next((k for k, (a, b) in enumerate(zip(got.token_ids, tokens, strict=False)) if a != b),
                         min(len(got.token_ids), len(tokens)))  # fmt: skip
            engine = "follows" if follows(prompt, got.token_ids) else "leaves"
            return "mismatch", (f"greedy: prompt of {len(prompt)} tokens, first differing new token {first} of "
                                f"{new_tokens}; the engine {engine} the full forward's argmax{note}")
    worst, where = 0.0, ""
    for prompt, group in zip(prompts, sampled, strict=True):
        for c in group:
            want_logprobs = forward_logprobs(model, prompt, c.token_ids)  # [new_tokens, V]
            want_logprobs = want_logprobs.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)  # [new_tokens]
            error = (torch.tensor(c.logprobs) - want_logprobs).abs().nan_to_num(math.inf)  # [new_tokens]
            if error.max() > worst:
                worst, where = float(error.max()), f"prompt of {len(prompt)} tokens, new token {int(error.argmax())}"
    if worst > LOGPROB_TOLERANCE:
        return "mismatch", f"logprobs: max error {worst:.1e} > {LOGPROB_TOLERANCE:.0e} ({where}; greedy matched{note})"
    return "match", f"max logprob error {worst:.1e}"


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def _frames(error: BaseException) -> list:
    return traceback.extract_tb(error.__traceback__)


def raised_by_fastgrpo(error: BaseException) -> bool:
    """A deliberate refusal is raised by fastgrpo's own code, not by transformers or torch beneath it."""
    frames = _frames(error)
    return bool(frames) and "/fastgrpo/" in frames[-1].filename


def last_frame(error: BaseException) -> str:
    frames = _frames(error)
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno}"


# -- the sweep -----------------------------------------------------------------------------------------------------


def sweep(model_types: list[str] | None = None, *, progress=None, **options) -> list[Row]:
    """sweep_one over `model_types` (default: every causal-LM type); `progress(row)` after each."""
    rows = []
    for model_type in causal_lm_types() if model_types is None else model_types:
        rows.append(sweep_one(model_type, **options))
        if progress is not None:
            progress(rows[-1])
    return rows


@contextlib.contextmanager
def _quiet_single_thread():
    """transformers' warnings off, and one thread: models this small gain nothing from a second, and on a shared
    2-core machine (load 6) two threads did not finish the sweep in 400 s, where one takes 138 s."""
    from transformers.utils import logging

    verbosity, threads = logging.get_verbosity(), torch.get_num_threads()
    logging.set_verbosity_error()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)


def sweep_table(rows: list[Row]) -> str:
    """Counts per status, then one markdown row per model type."""
    counts = ", ".join(f"{sum(r.status == s for r in rows)} {s}" for s in STATUSES)
    lines = [f"{len(rows)} architectures: {counts}", "", "| architecture | status | detail |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model_type} | {r.status} | {r.detail.replace('|', '/')} |")
    return "\n".join(lines)


# -- `fastgrpo bench architectures` --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--types", nargs="+", help="model types to sweep (default: every causal-LM type)")
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .md results go")
    parser.add_argument("--out-name", help="file name (default: architectures-<date>.md)")


def run(args: argparse.Namespace) -> list[Row]:
    import transformers

    from fastgrpo import bench as harness

    harness.check_out_dir(args.out_dir)
    unknown = sorted(set(args.types or ()) - set(causal_lm_types()))
    if unknown:
        raise SystemExit(f"--types: not causal-LM model types in transformers {transformers.__version__}: {unknown}")
    rows = sweep(args.types, progress=lambda r: print(f"{r.model_type}: {r.status} {r.detail} ({r.seconds:.1f} s)",
                                                        flush=True))
    env = harness.environment(torch.device("cpu"))
    header = ", ".join(f"{key} {value}" for key, value in env.items() if value is not None)
    table = sweep_table(rows)
    date = datetime.date.today().isoformat()
    path = Path(args.out_dir) / (args.out_name or f"architectures-{date}.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# Architecture sweep ({date})\n\n{header}; engine attention='torch', block_size 4; "
                    f"{sum(r.seconds for r in rows):.0f} s\n\n{table}\n")
    print(table)
    print(f"wrote {path}")
    return rows
