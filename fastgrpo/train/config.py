"""The trainer's options: one dataclass, validated on construction, loadable from YAML, overridable from the CLI.

Names follow TRL's `GRPOConfig` (and `ModelConfig` / `ScriptArguments`) where the concept is the same. One
difference: a *step* here is one generation round (sample, score, then `num_iterations` passes of updates), so
`max_steps`, `save_steps`, `eval_steps` and `logging` count rounds. With TRL's defaults
(`steps_per_generation = gradient_accumulation_steps`, `num_iterations = 1`) a round is one optimizer step, as in TRL.
"""

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from fastgrpo.loss_config import LOSS_TYPES, LossConfig
from fastgrpo.sizes import parse_size

BUILTIN = "builtin"  # model_name_or_path / dataset_name of the built-in arithmetic task
DEFAULT_RECIPE = Path(__file__).parent / "default.yaml"
REWARD_FUNCS = ("accuracy", "format", "length")
OPTIMIZERS = ("adamw_torch", "adamw_8bit")  # TRL's / transformers' names
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL 1.16's
# dynamic_sampling's cap on the prompts drawn per round, in rounds' worth: a round draws them in waves, so the cap
# bounds time, not memory (1e9 once made P x 1e9 candidate indices up front).
MAX_NUM_GEN_BATCHES = 1000
SEED_LIMIT = 2**32  # numpy's seeding takes [0, 2**32), as does transformers' set_seed that TRL recipes call
# The keys of TRL's generation_kwargs that the sampler honours (they override the options of the same names) -> what
# the value must be, and its check (a number, not a bool, that passes it; min_p may be None). TRL hands the dict to
# transformers' GenerationConfig or vLLM's SamplingParams, which take many more; fastgrpo refuses the others rather
# than ignore them (max_completion_length and seed are options of their own).
GENERATION_KWARGS = {
    "temperature": ("a number >= 0", lambda v: v >= 0),
    "top_p": ("a number in (0, 1]", lambda v: 0 < v <= 1),
    "top_k": ("an int >= 0", lambda v: isinstance(v, int) and v >= 0),
    "min_p": ("None or a number in [0, 1]", lambda v: 0 <= v <= 1),
    "repetition_penalty": ("a number in (0, inf)", lambda v: 0 < v < math.inf),
}


_IN_PROCESS = "fastgrpo samples in-process with its own paged engine, on the policy's weights: there is no vLLM"
# TRL GRPOConfig options that fastgrpo train does not take, and why (a YAML key or flag naming one is refused so).
TRL_ONLY = {
    **dict.fromkeys(("use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_server_base_url",
                     "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
                     "vllm_tensor_parallel_size"), _IN_PROCESS),
    "vllm_gpu_memory_utilization": _IN_PROCESS + "; sampling_memory_fraction sizes its KV pool",
    "vllm_max_model_length": _IN_PROCESS + "; a prompt with max_completion_length must fit the model's window",
    "vllm_structured_outputs_regex": "the engine has no guided (regex-constrained) decoding",
    "vllm_importance_sampling_correction": "named importance_sampling_correction here (default off: the sampler is "
                                           "the policy itself)",
    "vllm_importance_sampling_mode": "named importance_sampling_mode here",
    "vllm_importance_sampling_clip_min": "named importance_sampling_clip_min here",
    "vllm_importance_sampling_clip_max": "named importance_sampling_clip_max here",
    "vllm_importance_sampling_cap": "TRL's old name of importance_sampling_clip_max",
    **dict.fromkeys(("use_transformers_paged", "use_transformers_continuous_batching",
                     "transformers_continuous_batching_config", "cache_implementation"),
                    "the engine always runs a paged KV cache with continuous batching"),
    "ds3_gather_for_generation": "no DeepSpeed: under FSDP2 the engine samples on the gathered weights",
    "generation_batch_size": "it is per_device_train_batch_size x steps_per_generation here (set those)",
    "model_init_kwargs": "the model's loading options are options here: bf16, attn_implementation, "
                         "trust_remote_code, load_in_4bit",
    "shuffle_dataset": "the data is always shuffled, a seeded permutation per epoch (a stream is read in order)",
    "cast_lm_head_to_fp32": "always in effect: the fused head accumulates each chunk's logits in fp32",
    "pad_to_multiple_of": "micro-batches are packed (flash-attn) or bucketed by length, not padded to a multiple",
    "remove_unused_columns": "every dataset column reaches the reward functions (TRL's default, False)",
    **dict.fromkeys(("num_completions_to_print", "log_unique_prompts"),
                    "log_completions writes every prompt and completion to completions.jsonl"),
    "log_completions_hub_repo": "fastgrpo uploads nothing to the hub",
    "log_multimodal": "vision-language models are not supported",
}


def is_local_path(name: str) -> bool:
    """Whether a model or dataset name can only be a path: hub ids are 'name' or 'org/name' and never start with '.',
    '/' or '~', so such a name that does not exist is a misspelled path, not something to ask the hub for."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def read_utf8(path: Path, what: str) -> str:
    """The text of a config or data file; a file that is not UTF-8 is named with the line of its first bad byte."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(f"{what} {path}, line {line}: not UTF-8 text (byte {e.object[e.start]:#04x})") from None


def option(default, help: str, *, aliases: tuple[str, ...] = (), choices: tuple | None = None):
    """A config field carrying its --help text (and extra CLI spellings)."""
    metadata = {"help": help, "aliases": aliases, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class TrainConfig:
    # -- model --
    model_name_or_path: str | None = option(
        None, f"hub id or local path of a causal LM; '{BUILTIN}' is the tiny arithmetic model shipped with fastgrpo")
    bf16: bool | None = option(None, "train in bfloat16 (default: on CUDA yes, on CPU no)")
    gradient_checkpointing: bool = option(True, "recompute activations in the backward pass (saves memory)")
    offload_activations: bool = option(
        False, "keep each decoder layer's checkpointed input in host memory (pinned, copied on a side stream) until "
               "its recompute; the last layer's stays on the device. Needs gradient_checkpointing")
    attn_implementation: str | None = option(
        None, "transformers attention for training, e.g. sdpa or flash_attention_2 (which packs micro-batches "
              "padding-free); default: transformers' choice")
    router_aux_loss_coef: float | None = option(
        None, "weight of a mixture-of-experts model's router load-balancing loss, added to the GRPO loss as TRL adds "
              "it; None: the model config's own (Qwen3-MoE 0.001, OLMoE 0.01); 0: none")
    routing_replay: bool = option(
        False, "mixture-of-experts models: route every token of the training forwards (old, reference and the loss) "
               "through the experts the sampler chose for it (R3), the routing weights recomputed from the current "
               "router at those experts; the routes the sampler recorded and the trainer's own choices are compared "
               "(routing/mismatch) with it on or off. TRL has no such option")
    use_liger_kernel: bool = option(
        False, "swap in liger-kernel's RMSNorm, RoPE and SwiGLU kernels (needs liger-kernel)", aliases=("--liger",))
    trust_remote_code: bool = option(False, "allow model code from the hub")
    use_peft: bool = option(False, "train LoRA adapters (peft); the reference model is then the base, adapters off")
    disable_dropout: bool = option(False, "set every dropout of the policy and the reference (LoRA's too) to 0")
    load_in_4bit: bool = option(
        False, "QLoRA: the base's linear layers in 4-bit NF4 with double quantization (bitsandbytes), computing in the "
               "training dtype; embeddings and lm_head stay in it. Needs use_peft (pip install 'fastgrpo[quant]')")
    lora_r: int = option(16, "LoRA rank")
    lora_alpha: int = option(32, "LoRA alpha")
    lora_dropout: float = option(0.05, "LoRA dropout")
    lora_target_modules: list[str] = option(
        ["all-linear"], "modules that get LoRA adapters; all-linear: every linear layer but the output head and an "
                        "MoE's routers")
    lora_experts: bool = option(
        True, "LoRA on the experts of a mixture-of-experts model (peft's target_parameters on their fused 3-D weights: "
              "Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss, Gemma 4); such adapters take no dropout, so it needs "
              "lora_dropout 0. --no-lora-experts leaves the experts frozen")
    lora_target_parameters: list[str] | None = option(
        None, "parameters that get LoRA adapters (peft's target_parameters, e.g. mlp.experts.gate_up_proj); None: the "
              "experts' weights with lora_experts")
    # -- data --
    dataset_name: str | None = option(
        None, f"a .jsonl/.json/.parquet file, a `datasets` hub name, or '{BUILTIN}' (the synthetic arithmetic task)")
    dataset_config: str | None = option(None, "the dataset's configuration name (hub datasets)")
    dataset_streaming: bool = option(
        False, "read the data as a stream (`datasets` streaming: a hub dataset is not downloaded whole): rows in the "
               "stream's order, not shuffled, read again at its end; the held-out prompts are the test split's first "
               "eval_num_samples")
    dataset_train_split: str = option("train", "split to train on")
    dataset_test_split: str | None = option("test", "held-out split for evaluation; a file for file datasets")
    prompt_column: str = option("prompt", "column holding the prompt: a string, or a list of {role, content} "
                                          "messages (TRL's conversational format) that goes through the chat template")
    answer_column: str | None = option(
        "answer", "column holding the reference answer, read by the built-in accuracy reward and the held-out "
                  "evaluation; with the default, data that has no 'answer' but TRL's 'solution' column uses that; "
                  "data with neither trains with other rewards and without evaluation")
    answer_delimiter: str | None = option(None, "keep only the answer column's text after the last occurrence of "
                                                "this string (GSM8K: '####')")
    system_prompt: str | None = option(
        None, "system prompt, prepended through the chat template (or as text); a system message in the data wins")
    chat_template_kwargs: dict | None = option(
        None, "extra keywords for the chat template, as JSON on the command line (e.g. {\"enable_thinking\": false})")
    max_prompt_length: int | None = option(512, "prompts are cut to their last this many tokens; None keeps all")
    # -- sampling --
    num_generations: int = option(8, "completions per prompt (G)", aliases=("-G",))
    max_completion_length: int = option(256, "new tokens per completion at most")
    temperature: float = option(1.0, "sampling temperature (also divides the logits in the loss)")
    top_p: float = option(1.0, "nucleus sampling mass")
    top_k: int = option(0, "top-k sampling; 0 is off")
    min_p: float | None = option(
        None, "min-p sampling: keep the tokens of probability >= min_p x the most likely one's (after temperature, "
              "top-k and top-p, transformers' order); None or 0 is off")
    repetition_penalty: float = option(
        1.0, "divide the positive logits (multiply the negative ones) of the tokens in the prompt or the completion "
             "so far, tool tokens included, before temperature (transformers' rule); 1 is off, > 1 discourages repeats")
    generation_kwargs: dict | None = option(
        None, "TRL's generation_kwargs: a JSON object whose keys override the sampling options of the same names "
              f"({', '.join(GENERATION_KWARGS)}); any other key is refused")
    block_size: int = option(16, "tokens per page of the paged KV cache")
    sampling_memory_fraction: float = option(0.8, "fraction of free memory the KV cache may take while sampling")
    kv_cache_blocks: int | None = option(
        None, "pages in the sampler's KV pool; None sizes it from sampling_memory_fraction (--auto-fit sets it)")
    kv_cache_dtype: str = option(
        "auto", "the sampler's KV cache: the model's dtype, or fp8 (e4m3, per-head scales bounded from the weights: "
                "half of bf16's bytes; the sampler's logprobs then differ more from the training forward's, see "
                "--importance-sampling-correction)", choices=("auto", "fp8"))
    loss_chunk_tokens: int | None = option(
        None, "tokens per chunk of the fused loss; None: ~2 GiB of logits on a GPU, 32 MiB on a CPU (--auto-fit may "
              "lower it)")
    # -- rewards --
    reward_funcs: list[str] = option(
        ["accuracy"], f"built-ins {REWARD_FUNCS}, 'module:function' or 'file.py:function' with TRL's signature "
                      "(prompts, completions, **kwargs) -> list[float | None], or a reward model's hub id or path")
    reward_weights: list[float] | None = option(None, "one weight per reward function; default all 1")
    scale_rewards: str = option("group", "divide advantages by the reward std of the group, the batch, or none",
                                choices=("group", "batch", "none"))
    mask_truncated_completions: bool = option(False, "leave completions that hit max_completion_length out of the loss")
    multi_objective_aggregation: str = option(
        "sum_then_normalize", "several reward functions: sum the weighted rewards, then scale_rewards; or (GDPO) "
                              "normalise each function's rewards within the group, sum them weighted, then normalise "
                              "the sums over the batch", choices=("sum_then_normalize", "normalize_then_sum"))
    dynamic_sampling: bool = option(
        False, "DAPO's dynamic sampling: drop prompt groups whose rewards do not differ (zero advantage) and draw "
               "more prompts, in data order, until the round holds prompts_per_step groups that do")
    max_num_gen_batches: int = option(
        10, "dynamic_sampling: prompts drawn per round at most, in rounds' worth (verl's name); a round that reaches "
            "it trains with the groups it has, filled up with dropped ones (zero advantage)")
    # -- agents: tools, environments, rollout_func (docs/agents.md) --
    tools: list[str] = option(
        [], "tool functions, 'module:function' or 'file.py:function' (def or async def, a type hint on every argument "
            "and a Google-style docstring): shown to the model through the chat template, called when it writes a "
            "tool call, their results appended to the completion and left out of the loss")
    environment_factory: str | dict | None = option(
        None, "'module:Class' (or 'file.py:Class'): one instance per rollout, reset(**row) before it (a returned "
              "string is appended to the last user message), its public methods the rollout's tools, an optional "
              "get_reward() one more reward; or (YAML, or JSON here) {name: 'module:Class'}, the data's environment "
              "column picking one per row. Without dataset_name the environment writes the prompts")
    rollout_func: str | None = option(
        None, "'module:function' called as rollout_func(prompts, trainer) in place of fastgrpo's sampling; returns "
              "{prompt_ids, completion_ids, logprobs, env_mask?, ...}: one entry per sample, the other fields go to "
              "the reward functions (TRL's rollout_func)")
    max_tool_calling_iterations: int | None = option(
        None, "tool-calling turns per rollout at most; None: until a turn calls no tool or max_completion_length")
    tool_timeout: float | None = option(
        60.0, "seconds a tool call may take; one past it is reported to the model as an error and counted a failure")
    chat_template_path: str | None = option(
        None, "a Jinja file whose chat template replaces the tokenizer's (tools need a prefix-preserving one: TRL "
              "ships them, trl/chat_templates/*_training.jinja)")
    # -- loss --
    loss_type: str = option("dapo", "normalisation of the token losses", choices=tuple(LOSS_TYPES))
    beta: float = option(0.0, "k3 KL coefficient; 0 loads no reference model")
    epsilon: float = option(0.2, "clip range below 1 (and above, unless epsilon_high is set)")
    epsilon_high: float | None = option(
        None, "clip range above 1 (DAPO's clip-higher); for cispo the cap of the importance weight (ScaleRL: 5.0)")
    delta: float | None = option(None, "upper cap of the ratio on negative advantages (two-sided clipping)")
    importance_sampling_level: str = option("token", "ratio per token or per sequence (GSPO)",
                                            choices=("token", "sequence"))
    use_bias_correction_kl: bool = option(True, "multiply the KL term by the importance ratio")
    sapo_temperature_pos: float = option(1.0, "sapo: the gate's temperature on positive advantages")
    sapo_temperature_neg: float = option(1.05, "sapo: the gate's temperature on negative advantages")
    vespo_k_pos: float = option(2.0, "vespo: the power k of the sequence weight w^k e^(lambda (1 - w)), advantages "
                                     ">= 0; larger down-weights sequences with ratio w < 1 more")
    vespo_lambda_pos: float = option(3.0, "vespo: the decay lambda of the sequence weight, advantages >= 0; larger "
                                          "down-weights sequences with ratio w > 1 more")
    vespo_k_neg: float = option(3.0, "vespo: the power k of the sequence weight, advantages < 0")
    vespo_lambda_neg: float = option(2.0, "vespo: the decay lambda of the sequence weight, advantages < 0")
    num_iterations: int = option(1, "passes over each generation batch (mu); > 1 computes old logprobs")
    sync_ref_model: bool = option(
        False, "move the reference model towards the policy every ref_model_sync_steps optimizer steps: ref = "
               "alpha * policy + (1 - alpha) * ref (TR-DPO's update; needs beta > 0 and full fine-tuning)")
    ref_model_mixup_alpha: float = option(0.6, "sync_ref_model's alpha")
    ref_model_sync_steps: int = option(512, "sync_ref_model's period, in optimizer steps")
    entropy_coef: float = option(
        0.0, "entropy bonus: the loss minus entropy_coef times the mean token entropy of each micro-batch (TRL's "
             "static entropy_coef; never divided by the loss type's normaliser); 0 is off")
    top_entropy_quantile: float = option(
        1.0, "keep the policy term only on the tokens whose entropy is in this top share of each micro-batch's loss "
             "tokens (Beyond the 80/20 Rule's rho, 0.2 there); the entropy bonus then averages over those tokens too; "
             "1 keeps all")
    off_policy_mask_threshold: float | None = option(
        None, "drop the sequences with a negative advantage whose mean KL(sampling || current) over their tokens "
              "exceeds this (DeepSeek-V3.2's off-policy sequence mask, e.g. 0.5); None is off")
    use_adaptive_entropy: bool = option(
        False, "adaptive entropy control (Skywork-OR1): entropy_coef is the starting coefficient, raised by "
               "entropy_coef_delta after each optimizer step whose entropy is at or below entropy_target, else "
               "lowered; applied only while the last step's entropy is at or below the target")
    entropy_coef_min: float = option(0.0, "use_adaptive_entropy: the lowest coefficient")
    entropy_coef_max: float = option(1.0, "use_adaptive_entropy: the highest coefficient")
    entropy_coef_delta: float = option(0.005, "use_adaptive_entropy: the change of the coefficient per optimizer step")
    entropy_target: float = option(
        0.2, "use_adaptive_entropy: the mean token entropy (nats) to hold, measured over the bonus's tokens (all loss "
             "tokens, or the top_entropy_quantile ones); language models start at 2-10, so set it near the logged "
             "entropy")
    importance_sampling_correction: bool = option(
        False, "weight the policy term by the truncated ratio of training to sampler probabilities (TRL's "
               "vllm_importance_sampling_correction, on in TRL); off here because fastgrpo samples with the policy "
               "itself, so the two differ by kernel rounding only, and on costs a no-grad forward per on-policy round")
    importance_sampling_mode: str = option(
        "sequence_mask", "the ratio per token or per sequence (its log summed over the tokens); truncate clamps it "
                         "to [clip_min, clip_max], mask sets it to 0 outside", choices=IMPORTANCE_SAMPLING_MODES)
    importance_sampling_clip_max: float | None = option(3.0, "C_max of importance_sampling_mode; None: no upper bound")
    importance_sampling_clip_min: float | None = option(None, "C_min of importance_sampling_mode; None: no lower bound")
    # -- optimisation --
    optim: str = option("adamw_torch", "optimizer: adamw_torch (PyTorch's AdamW) or adamw_8bit (bitsandbytes' AdamW "
                                       "with 8-bit blockwise states, for full fine-tuning or LoRA)",
                        choices=OPTIMIZERS)
    learning_rate: float = option(1e-6, "AdamW peak learning rate", aliases=("--lr",))
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.999, "AdamW beta2")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this; 0 is off")
    lr_scheduler_type: str = option("linear", "transformers schedule name (linear, cosine, constant_with_warmup, ...)")
    warmup_ratio: float = option(0.0, "share of the optimizer steps spent warming up")
    per_device_train_batch_size: int = option(8, "completions per forward/backward micro-batch")
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step")
    steps_per_generation: int | None = option(
        None, "micro-batches per generation batch; None = gradient_accumulation_steps. A round samples "
              "per_device_train_batch_size * steps_per_generation completions")
    max_steps: int = option(100, "generation rounds to train for")
    seed: int = option(42, "seed of the data order, the initial weights of adapters and the sampling")
    # -- several processes (torchrun) --
    parallelism: str | None = option(
        None, "with several processes (torchrun): fsdp (FSDP2: parameters, gradients and optimizer states sharded "
              "per decoder layer) or ddp (a whole model per process); default fsdp. Ignored by a process that "
              "torchrun did not start",
        choices=("fsdp", "ddp"))
    ddp_timeout: int = option(1800, "seconds any collective of several processes may wait before it fails")
    # -- memory plan --
    gpu_memory: str | None = option(
        None, "device memory to plan for, e.g. 24GiB (default: the GPU's own); the plan goes to "
              "<output_dir>/memory_plan.txt")
    auto_fit: bool = option(
        False, "pick the largest per_device_train_batch_size (gradient_accumulation_steps and steps_per_generation "
               "scaled to keep the update), the KV pool and the loss chunk that fit gpu_memory by the memory plan")
    mlp_tile_tokens: int | None = option(
        None, "run each decoder layer's MLP over the micro-batch this many tokens at a time, keeping only its input "
              "for the backward, which recomputes each tile: a layer's backward then holds [tile, intermediate] "
              "tensors instead of [tokens, intermediate] (e.g. 4096; checkpointed, the MLP runs no more often; "
              "without gradient_checkpointing, once more); None: the whole micro-batch at once")
    recompute_lora_inputs: bool = option(
        True, "LoRA adapters keep their input in the compute dtype (one tensor for q, k and v) and redo its fp32 cast "
              "and dropout mask in the backward, instead of keeping an fp32, dropped-out copy each; the gradients "
              "are peft's, bit for bit")
    recompute_norms: bool = option(
        True, "RMSNorms keep their input in the compute dtype for the backward, which recomputes them in tiles, "
              "instead of keeping an fp32 copy and making five fp32 temporaries of the input's size at once; "
              "the values and gradients are the norm's own")
    mask_free_attention: bool = option(
        True, "with sdpa attention, a right-padded micro-batch attends with is_causal and no [b, 1, T, T] mask "
              "(which also rules out the flash kernel and repeats K and V per query head); exact for every token "
              "but the pads, which nothing reads")
    # -- evaluation, checkpoints, logs --
    output_dir: str | None = option(None, "where the run goes (config, metrics.jsonl, checkpoints, plots); "
                                          "default runs/<date-time>")
    overwrite_output_dir: bool = option(False, "allow output_dir to hold an earlier run, which is deleted")
    resume: bool = option(False, "continue the run in output_dir from its newest checkpoint")
    save_steps: int = option(50, "checkpoint every this many steps (and at the end); 0 only at the end")
    save_total_limit: int | None = option(2, "keep this many newest checkpoints; None keeps all")
    eval_steps: int = option(0, "evaluate on the held-out split every this many steps; 0: only before and after")
    eval_num_samples: int = option(200, "held-out prompts per evaluation")
    eval_temperature: float = option(0.0, "evaluation sampling temperature; 0 is greedy (pass@1)")
    num_generations_eval: int | None = option(
        None, "completions per held-out prompt; None: one. With more (and eval_temperature > 0) the accuracy is "
              "their mean (pass@1 estimated from several samples)")
    report_to: list[str] = option(["tensorboard"], "metric sinks besides metrics.jsonl: tensorboard, wandb, none")
    log_completions: bool = option(
        False, "write every sample's prompt, completion, rewards and advantage to completions.jsonl each step, with "
               "the columns reward functions add through log_extra")
    disable_tqdm: bool = option(False, "no progress bar")

    def __post_init__(self):
        _to_floats(self)
        _check_types(self)
        if self.gpu_memory is not None:
            parse_size(self.gpu_memory)  # a size, or a ValueError naming gpu_memory
        for name in ("kv_cache_blocks", "loss_chunk_tokens", "mlp_tile_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (or None), got {getattr(self, name)}")
        positive = ("num_generations", "max_completion_length", "block_size", "num_iterations", "max_num_gen_batches",
                    "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "eval_num_samples",
                    "lora_r", "lora_alpha", "ddp_timeout")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2, got {self.num_generations}: a completion's advantage is "
                             "its reward minus its group's mean, zero for a group of one (TRL refuses it too)")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**32) (numpy's and transformers.set_seed's range), got {self.seed}")
        for name in ("save_steps", "eval_steps", "top_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_prompt_length", "steps_per_generation", "save_total_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be None or >= 1, got {getattr(self, name)!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        for name in ("weight_decay", "max_grad_norm", "eval_temperature"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("top_p", "sampling_memory_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("warmup_ratio", "lora_dropout", "adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices and getattr(self, f.name) is not None:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")
        if self.model_name_or_path is None:
            raise ValueError(f"model_name_or_path is required (a hub id, a local path or '{BUILTIN}')")
        if self.dataset_name is None and not isinstance(self.environment_factory, str):
            raise ValueError(f"dataset_name is required (a file, a hub dataset or '{BUILTIN}')" + (
                "; with several environments (environment_factory a dict) the data's environment column picks one "
                "per row" if self.environment_factory is not None else
                "; only an environment_factory can do without: its reset() writes the prompts"))
        if self.max_num_gen_batches > MAX_NUM_GEN_BATCHES:
            raise ValueError(f"max_num_gen_batches must be at most {MAX_NUM_GEN_BATCHES}, got "
                             f"{self.max_num_gen_batches}: a round that needs more rounds' worth of prompts than that "
                             "has a reward that scores nearly every group flat (verl's default is 10)")
        self._check_agents()
        self._check_reference_and_eval()
        if self.dataset_streaming and self.dataset_name in (None, BUILTIN):
            raise ValueError(f"dataset_streaming reads a dataset as a stream; dataset_name {self.dataset_name!r} is "
                             "not one (give a hub dataset or a file)")
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be None or >= 0, got {self.router_aux_loss_coef!r}")
        if self.lora_target_parameters and not self.lora_experts:
            raise ValueError("lora_target_parameters and lora_experts off contradict each other (the named "
                             "parameters would get LoRA); pass one")
        if self.load_in_4bit and not self.use_peft:
            raise ValueError("load_in_4bit needs use_peft: a 4-bit base is frozen, so train LoRA adapters on it "
                             "(--use-peft)")
        if self.offload_activations and not self.gradient_checkpointing:
            raise ValueError("offload_activations needs gradient_checkpointing: it offloads the checkpointed inputs "
                             "of the decoder layers")
        if not self.reward_funcs and self.environment_factory is None:
            raise ValueError("reward_funcs must name at least one reward function (or an environment_factory's "
                             "get_reward() scores the rollouts)")
        for name in self.reward_funcs:
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"reward_funcs: {name!r} is not a built-in {REWARD_FUNCS}, 'module:function' or a "
                                 "reward model's hub id or path")
        if self.reward_weights is not None:
            if len(self.reward_weights) != len(self.reward_funcs):
                raise ValueError(f"reward_weights has {len(self.reward_weights)} values but reward_funcs has "
                                 f"{len(self.reward_funcs)} functions; give one weight per function")
            if not all(math.isfinite(w) for w in self.reward_weights):
                raise ValueError(f"reward_weights must be finite, got {self.reward_weights}")
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.steps_per_generation % self.gradient_accumulation_steps:
            raise ValueError(f"steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                             f"gradient_accumulation_steps ({self.gradient_accumulation_steps})")
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size * steps_per_generation = {self.generation_batch_size} completions per "
                f"round must be a multiple of num_generations ({self.num_generations})")
        bad_sinks = set(self.report_to) - {"tensorboard", "wandb", "none"}
        if bad_sinks:
            raise ValueError(f"report_to: unknown sinks {sorted(bad_sinks)}; choose from tensorboard, wandb, none")
        self._check_importance_sampling()
        self._check_sampling()
        if self.resume and self.overwrite_output_dir:
            raise ValueError("resume and overwrite_output_dir contradict each other; pass one")
        self.loss_options()  # the loss options' checks

    def _check_reference_and_eval(self) -> None:
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("sync_ref_model needs beta > 0: with beta 0 there is no reference model to move")
        if self.sync_ref_model and self.use_peft:
            raise ValueError("sync_ref_model needs full fine-tuning: with use_peft the reference is the base model "
                             "with the adapters off, which no copy holds (TRL refuses it too)")
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise ValueError(f"ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha!r}")
        if self.ref_model_sync_steps < 1:
            raise ValueError(f"ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps!r}")
        if self.num_generations_eval is not None:
            if self.num_generations_eval < 1:
                raise ValueError(f"num_generations_eval must be None or >= 1, got {self.num_generations_eval!r}")
            if self.num_generations_eval > 1 and self.eval_temperature == 0:
                raise ValueError(f"num_generations_eval={self.num_generations_eval} with eval_temperature 0: greedy "
                                 "completions of one prompt are all the same; set eval_temperature > 0")

    def _check_agents(self) -> None:
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(f"max_tool_calling_iterations must be None or >= 0, got "
                             f"{self.max_tool_calling_iterations}")
        if self.tool_timeout is not None and not self.tool_timeout > 0:
            raise ValueError(f"tool_timeout must be None or > 0 seconds, got {self.tool_timeout!r}")
        if self.routing_replay and self.rollout_func is not None:
            raise ValueError("routing_replay replays the experts fastgrpo's engine recorded; rollout_func's rollouts "
                             "carry none: drop one of the two")
        if self.rollout_func is not None and (self.tools or self.environment_factory is not None):
            given = "tools" if self.tools else "environment_factory"
            raise ValueError(f"{given} does not apply with rollout_func, which returns whole rollouts (fastgrpo's own "
                             "tool loop does not run); run the tools inside rollout_func, or drop one of the two")
        template = Path(self.chat_template_path).expanduser() if self.chat_template_path is not None else None
        if template is not None and template.is_file() and not read_utf8(template, "chat_template_path").strip():
            raise ValueError(f"chat_template_path: {template} is empty; give a Jinja chat template, or drop the option "
                             "to keep the tokenizer's")
        if isinstance(self.environment_factory, dict):
            for name, spec in self.environment_factory.items():
                if not isinstance(name, str) or not isinstance(spec, str):
                    raise ValueError(f"environment_factory: {{{name!r}: {spec!r}}} must map an environment name "
                                     "(str) to 'module:Class'")

    def _check_sampling(self) -> None:
        """min_p, repetition_penalty, and generation_kwargs' keys and values (each by the rule of the option it
        overrides; temperature, top_p and top_k themselves are checked above)."""
        overrides = self.generation_kwargs or {}
        for key in overrides:
            if key not in GENERATION_KWARGS:
                hint = {"max_new_tokens": "max_completion_length", "max_tokens": "max_completion_length",
                        "seed": "seed"}.get(key)
                raise ValueError(f"generation_kwargs: {key!r} is not a sampling option fastgrpo has"
                                 + (f" (set {hint} instead)" if hint else "")
                                 + f"; it takes {', '.join(GENERATION_KWARGS)}")
        values = [("min_p", "min_p", self.min_p), ("repetition_penalty", "repetition_penalty", self.repetition_penalty)]
        values += [(f"generation_kwargs[{key!r}]", key, value) for key, value in overrides.items()]
        for where, key, value in values:
            what, check = GENERATION_KWARGS[key]
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (value is None and key == "min_p" or number and check(value)):
                raise ValueError(f"{where} must be {what}, got {value!r}")

    def _check_importance_sampling(self) -> None:
        """TRL's checks of its vllm_importance_sampling_clip_min / _max, plus: the bounds are ratios, so >= 0."""
        low, high = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        for name, value in (("importance_sampling_clip_min", low), ("importance_sampling_clip_max", high)):
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be None or >= 0, got {value!r}")
        if low is not None and high is not None and not low < high:
            raise ValueError(f"importance_sampling_clip_min ({low}) must be less than importance_sampling_clip_max "
                             f"({high})")
        if self.importance_sampling_correction and self.loss_type == "vespo" and (
                self.importance_sampling_mode.startswith("sequence")):
            raise ValueError(f"loss_type 'vespo' weighs each sequence by its own ratio, so importance_sampling_mode "
                             f"{self.importance_sampling_mode!r} (a per-sequence correction) does not apply; use "
                             "token_truncate or token_mask (TRL refuses it too)")
        if self.importance_sampling_correction and self.importance_sampling_mode.endswith("_truncate") and (
            low is None and high is None
        ):
            raise ValueError(f"importance_sampling_mode={self.importance_sampling_mode!r} needs "
                             "importance_sampling_clip_min or importance_sampling_clip_max")

    def loss_options(self) -> LossConfig:
        """The loss options (loss_type, epsilon, beta, temperature, ...) as fastgrpo.loss's LossConfig."""
        return LossConfig.from_trl(self)

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled per round."""
        return self.per_device_train_batch_size * self.steps_per_generation

    @property
    def prompts_per_step(self) -> int:
        return self.generation_batch_size // self.num_generations

    # -- YAML --

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def save_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "TrainConfig":
        """The options in a YAML mapping, then `overrides` on top."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        text = read_utf8(path, "config file")
        try:
            values = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        except yaml.YAMLError as e:
            raise ValueError(_yaml_error(path, text, e)) from None
        if not isinstance(values, dict):
            raise ValueError(f"config file {path} must hold a mapping of option: value, got {type(values).__name__}")
        unknown = sorted(map(str, set(values) - {f.name for f in dataclasses.fields(cls)}))
        trl = [name for name in unknown if name in TRL_ONLY]
        if trl:
            raise ValueError(f"config file {path}: {trl[0]}: a TRL option fastgrpo train does not take: "
                             f"{TRL_ONLY[trl[0]]}")
        if unknown:
            raise ValueError(f"config file {path}: unknown options {unknown}")
        return cls(**{**values, **overrides})


def flag(name: str) -> str:
    """The command-line flag of a TrainConfig field: model_name_or_path -> --model-name-or-path."""
    return "--" + name.replace("_", "-")


def train_dtype(config: TrainConfig, device_type: str) -> torch.dtype:
    """The dtype the policy trains and samples in: bf16 where config.bf16 says so, by default on CUDA; else fp32."""
    bf16 = config.bf16 if config.bf16 is not None else device_type == "cuda"
    return torch.bfloat16 if bf16 else torch.float32


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first on line {lines[key]})", key_node.start_mark)
                lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _yaml_error(path: Path, text: str, error: yaml.YAMLError) -> str:
    """PyYAML's error in one line, at its line and column: parser errors carry a mark, reader errors an offset."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    if mark is not None:
        line, column = mark.line + 1, mark.column + 1
    else:
        offset = getattr(error, "position", 0)
        line, column = text.count("\n", 0, offset) + 1, offset - text.rfind("\n", 0, offset)
    problem = getattr(error, "problem", None) or getattr(error, "reason", None) or " ".join(str(error).split())
    if not isinstance(error, yaml.constructor.ConstructorError):
        problem = f"not valid YAML ({problem})"
    return f"config file {path}, line {line}, column {column}: {problem}"


@functools.cache
def field_types() -> dict[str, tuple[type, bool]]:
    """Per TrainConfig field: (its type without None, whether None is allowed); `list[str] | None` ->
    (list[str], True)."""
    out = {}
    for name, annotation in typing.get_type_hints(TrainConfig).items():
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)] if union else [annotation]
        optional = union and type(None) in typing.get_args(annotation)
        out[name] = (kinds[0] if len(kinds) == 1 else typing.Union[tuple(kinds)]), optional  # noqa: UP007 - a list
    return out


def _check_types(config: TrainConfig) -> None:
    for f in dataclasses.fields(config):
        value, (kind, optional) = getattr(config, f.name), field_types()[f.name]
        if value is None:
            if not optional:
                raise ValueError(f"{f.name} must not be None")
            continue
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        if item is not None:
            ok = isinstance(value, list) and all(_is(x, item) for x in value)
        else:
            ok = _is(value, kind)
        if not ok:
            expected = _describe(kind) + (" | None" if optional else "")
            raise TypeError(f"{f.name} must be {expected}, got {value!r} ({type(value).__name__})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be finite, got {value!r}")


def _to_floats(config: TrainConfig) -> None:
    """Float options take ints (YAML's `learning_rate: 1`) and numeric strings (YAML 1.1 reads `1e-4`, without a dot,
    as a string; TRL's parser accepts it); anything else is left for _check_types to name."""
    for f in dataclasses.fields(config):
        value, (kind, _) = getattr(config, f.name), field_types()[f.name]
        if kind is float:
            setattr(config, f.name, _as_float(value))
        elif kind == list[float] and isinstance(value, list):
            setattr(config, f.name, [_as_float(x) for x in value])


def _as_float(value):
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return value
    try:
        return float(value)
    except ValueError:
        return value  # not a number: _check_types names the option
    except OverflowError:
        return math.inf  # an int past float's range: _check_types calls it not finite


def _is(value, kind: type) -> bool:
    """isinstance, except that bools are not ints and ints are floats; `kind` may be a union (str | dict)."""
    if typing.get_origin(kind) is typing.Union:
        return any(_is(value, k) for k in typing.get_args(kind))
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (float, int)) if kind is float else isinstance(value, kind)


def _describe(annotation) -> str:
    if typing.get_origin(annotation) is typing.Union:
        return " | ".join(map(_describe, typing.get_args(annotation)))
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
