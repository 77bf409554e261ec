"""The memory plan (fastgrpo/train/plan.py) against live-tensor counts (fastgrpo/bench/memory_trace.py), by phase.

1. Real shapes (Qwen2.5-1.5B, Qwen2.5-7B, Llama-3.1-8B from fastgrpo/bench/models/*/config.json): the sampling
   phase, one micro-batch's no-grad logprobs and training (G = 8 completions of 1024 tokens after 256-token prompts,
   LoRA r 16, bf16 or a 4-bit base, offload off or on) and one decode step (64 sequences of 1280 tokens) traced on
   fake CPU tensors, the loss in its CUDA form.
2. Real runs on this CPU: one `Trainer.train_step` of small Qwen2 models (fp32) per configuration, measured.

3. Long reasoning (issue 33, `--long-reasoning`, alone): `fastgrpo plan ... --use-peft --load-in-4bit
   --offload-activations -G 8 --auto-fit` of Qwen2.5-7B on 24 GiB and Qwen3-8B on 24 and 80 GiB at completions of
   16K to 110K tokens (the KV cache in bf16 and fp8), and traces of the sampling phase and the training micro-batch
   at each fitted setting.

4. The 2026 families (issue 38, `--families`, alone): gpt-oss-20b, Gemma 3 12B and Gemma 4 E2B from their published
   configs (fastgrpo/bench/models/), LoRA r 16 with offload, 4-bit where bitsandbytes applies, auto-fit on 24 and 80
   GiB, and at each fitted setting traces of the sampling phase (the engine's pools: logical and per window) and of
   the training micro-batch (its no-grad logprobs and its training step).

    fastgrpo bench memory-plan                  # 1 and 2; ~6 min on 2 cores
    fastgrpo bench memory-plan --skip-traces    # only the measured CPU runs
    fastgrpo bench memory-plan --long-reasoning # only 3; --no-long-traces for its plans alone
    fastgrpo bench memory-plan --families       # only 4; --no-long-traces for its plans alone

Writes <out-dir>/memory-plan-<date>.md (and .json). Plans are plans, traces are counts of fake tensors at real
shapes, measurements are counts of real tensors on a CPU: the table says which is which.
"""

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import torch

from fastgrpo import bench as harness
from fastgrpo.sizes import GiB

MODELS = ("qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-8b")
PROMPT, COMPLETION, G, MICRO_BATCH, DECODE_ROWS, DECODE_CONTEXT = 256, 1024, 8, 8, 64, 1280


def error(plan: int, count: int) -> str:
    return f"{(plan - count) / count * 100:+.1f}%"


def real_shapes(rows: list, record: dict) -> None:
    from transformers import AutoConfig

    from fastgrpo.bench.memory_trace import trace_decode_step, trace_sampling, trace_train_step
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import kv_block_bytes, model_shapes, plan_memory, sampler_bytes, weight_bytes

    for name in MODELS:
        folder = harness.MODELS / name
        model_config = AutoConfig.from_pretrained(folder)
        shapes = model_shapes(model_config)
        for four_bit in (False, True):
            for offload in (False, True):
                config = TrainConfig(model_name_or_path=str(folder), dataset_name="builtin",
                                     use_peft=True, lora_r=16, load_in_4bit=four_bit, offload_activations=offload,
                                     num_generations=G, max_completion_length=COMPLETION, max_prompt_length=PROMPT,
                                     per_device_train_batch_size=MICRO_BATCH, bf16=True)
                plan = plan_memory(config, shapes=shapes, device_type="cuda")
                trace = trace_train_step(model_config, micro_batch=MICRO_BATCH, prompt_length=PROMPT,
                                         completion_length=COMPLETION, use_peft=True, lora_r=16,
                                         load_in_4bit=four_bit, offload_activations=offload, head="cuda")
                label = f"{name} {'4-bit' if four_bit else 'bf16'} LoRA{' offload' if offload else ''}"
                record[label] = {"trace": trace, "plan": {p: plan.peak(p) for p in plan.phases}}
                pairs = [("logprobs (no grad)", plan.peak("logprobs"), trace["logprobs"]),
                         ("train: forward + loss", max(plan.peak("train: forward"), plan.peak("train: loss")),
                          trace["forward"]),
                         ("train: loss", plan.peak("train: loss"), trace["loss"]),
                         ("train: backward", plan.peak("train: backward"), trace["backward"]),
                         ("train: optimizer step", plan.peak("train: optimizer step"), trace["optimizer"])]
                if not offload:  # (sampling does not depend on it)
                    sampled = trace_sampling(model_config, kv_blocks=plan.settings["kv_blocks"], prompt_length=PROMPT,
                                             completion_length=COMPLETION, num_generations=G,
                                             num_prompts=config.generation_batch_size // G, load_in_4bit=four_bit)
                    record[label]["sampling trace"] = sampled
                    pairs.insert(0, ("sampling (a round's KV pool)", plan.peak("sampling"), sampled["sampling"]))
                for phase, planned, counted in pairs:
                    rows.append((label, phase, planned, counted, "trace (fake tensors)"))
                print(label, "done", flush=True)
        for four_bit in (False, True):
            config = TrainConfig(model_name_or_path=str(folder), dataset_name="builtin",
                                 load_in_4bit=four_bit, use_peft=four_bit, bf16=True)
            trace = trace_decode_step(model_config, num_sequences=DECODE_ROWS, context_length=DECODE_CONTEXT,
                                      load_in_4bit=four_bit)
            blocks = DECODE_ROWS * -(-DECODE_CONTEXT // config.block_size)
            # The plan's decode moment: weights, the pool, a hidden state per row and the sampler's passes.
            planned = (weight_bytes(shapes, config, 2) + blocks * kv_block_bytes(shapes, config.block_size, 2)
                       + DECODE_ROWS * 2 * shapes.hidden * 2 + sampler_bytes(shapes, DECODE_ROWS))
            label = f"{name} {'4-bit' if four_bit else 'bf16'}"
            record[label + " decode"] = {"trace": trace, "plan": planned}
            rows.append((label, f"decode step ({DECODE_ROWS} x {DECODE_CONTEXT} tokens)", planned, trace["decode"],
                         "trace (fake tensors)"))


def qwen3_8b_config(max_position_embeddings: int = 40960):
    """Qwen3-8B's published architecture (Qwen/Qwen3-8B config.json); max_position_embeddings 40960 as published, more
    for longer sequences (Qwen3 reaches 131072 with YaRN; the rotary tables' size does not depend on it)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                       rope_theta=1e6, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6)


# (model, GiB of the card, completion lengths): the table
LONG_CELLS = (("qwen2.5-7b", 24, (16384, 32768)), ("qwen3-8b", 24, (32768,)), ("qwen3-8b", 80, (32768, 65536, 110000)))
LONG_TRAIN_PHASES = (("logprobs", "logprobs"), ("train: forward", "forward"), ("train: loss", "loss"),
                     ("train: backward", "backward"), ("train: optimizer step", "optimizer"))


def long_reasoning(rows: list, record: dict, traces: bool = True) -> None:
    """Section 3 of the module docstring: each cell's auto_fit plan, and the trace of its micro-batch at the settings
    it picked (micro-batch, MLP tile; LoRA inputs kept as they come and SDPA without a mask, the defaults)."""
    from transformers import AutoConfig

    from fastgrpo.bench.memory_trace import trace_sampling, trace_train_step
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import auto_fit, fitted, model_shapes

    for name, gpu, lengths in LONG_CELLS:
        for length in lengths:
            if name == "qwen3-8b":
                model_config = qwen3_8b_config(40960 if length + 512 <= 40960 else 131072)
            else:
                model_config = AutoConfig.from_pretrained(harness.MODELS / name)
            shapes = model_shapes(model_config)
            for kv in ("auto", "fp8"):
                config = TrainConfig(model_name_or_path=name, dataset_name="builtin", use_peft=True, lora_r=16,
                                     load_in_4bit=True, offload_activations=True, num_generations=G,
                                     max_completion_length=length, bf16=True, kv_cache_dtype=kv)
                plan = auto_fit(config, gpu * GiB, shapes)
                picks = fitted(config, plan)
                label = f"{name} 4-bit LoRA r 16, {gpu} GiB, L {length}, KV {'bf16' if kv == 'auto' else 'fp8'}"
                entry = record[label] = {"picks": picks, "plan": {p: plan.peak(p) for p in plan.phases},
                                         "plan components": plan.phases, "settings": plan.settings}
                peak_phase = max(plan.phases, key=plan.peak)
                sampled = None
                if traces:
                    sampled = trace_sampling(model_config, kv_blocks=plan.settings["kv_blocks"],
                                             prompt_length=config.max_prompt_length, completion_length=length,
                                             num_generations=G, num_prompts=config.generation_batch_size // G,
                                             kv_cache_dtype=kv, load_in_4bit=True,
                                             mlp_tile_tokens=plan.settings["mlp_tile_tokens"])
                    entry["sampling trace"] = sampled
                rows.append((label, picks, "sampling", plan.peak("sampling"), sampled and sampled["sampling"],
                             peak_phase))
                trace = None
                if traces and kv == "auto":  # the KV dtype changes sampling only: one trace per cell
                    trace = trace_train_step(model_config, micro_batch=plan.settings["per_device_train_batch_size"],
                                             prompt_length=config.max_prompt_length, completion_length=length,
                                             use_peft=True, lora_r=16, load_in_4bit=True, offload_activations=True,
                                             mlp_tile_tokens=plan.settings["mlp_tile_tokens"], head="cuda")
                    entry["trace"] = trace
                    print(label, f"traced in {trace['seconds']:.0f} s", flush=True)
                for phase, key in LONG_TRAIN_PHASES:
                    rows.append((label, picks, phase, plan.peak(phase), trace and trace[key], peak_phase))


def long_reasoning_report(rows: list, day: str) -> str:
    lines = [f"# Long reasoning on small GPUs: plans and traces ({day}, torch {torch.__version__}, CPU only: no GPU)",
             "", "`fastgrpo bench memory-plan --long-reasoning`: `fastgrpo plan --model-name-or-path <config> "
             "--use-peft --load-in-4bit --offload-activations -G 8 --max-completion-length L --gpu-memory <card> "
             "--auto-fit` (prompts of 512 tokens, 8 completions a step, LoRA r 16, --recompute-lora-inputs and "
             "--mask-free-attention on, their defaults), KV cache bf16 or `--kv-cache-dtype fp8`. Plan: "
             "fastgrpo/train/plan.py. Trace: live tensor storages of one micro-batch's no-grad logprobs and "
             "training at the settings auto-fit picked, on fake CPU tensors at real shapes (the loss in its CUDA "
             "form), and of the sampling phase with the KV pool auto-fit sized (`trace_sampling`: resident state, "
             "the pool, the engine's buffers, its prefill and decode steps and the sampler). Qwen3-8B's config is "
             "built in code from its published numbers (max_position_embeddings 131072 past 40960 tokens). A 24 GiB "
             "card leaves 21.8 GiB "
             "for tensors, 80 GiB 75.0 (the plan's reserve: 5% + 1 GiB).", "",
             "| cell | auto-fit picks | phase | plan GiB | trace GiB | error | the plan's peak phase |",
             "|---|---|---|---|---|---|---|"]
    for label, picks, phase, planned, counted, peak_phase in rows:
        traced = "" if counted is None else f"{counted / GiB:.2f}"
        err = "" if counted is None else error(planned, counted)
        said = " ".join(f"{k}={v}" for k, v in picks.items())
        lines.append(f"| {label} | {said} | {phase} | {planned / GiB:.2f} | {traced} | {err} | {peak_phase} |")
    return "\n".join(lines) + "\n"


# (model, what a user of that card loads, the card's GiB, completion lengths, plan only): issue 38's families. gpt-oss's
# experts take LoRA (lora_experts, on by default), which takes no dropout; its attention is transformers' eager one
# (it has no SDPA path), unless a flash kernel with sinks is named (planned only: no CPU trace runs it).
FAMILY_CELLS = (
    ("gpt-oss-20b", dict(load_in_4bit=True, lora_dropout=0.0), 24, (1024,), False),
    ("gpt-oss-20b", dict(load_in_4bit=True, lora_dropout=0.0), 80, (1024, 4096, 8192), False),
    ("gpt-oss-20b", dict(load_in_4bit=True, lora_dropout=0.0, lora_experts=False), 80, (8192,), False),
    ("gpt-oss-20b", dict(load_in_4bit=True, lora_dropout=0.0, attn_implementation="kernels-community/vllm-flash-attn3"),
     80, (32768,), True),
    ("gemma-3-12b", dict(load_in_4bit=True), 24, (8192, 16384, 32768), False),
    ("gemma-3-12b", dict(load_in_4bit=True), 80, (32768, 65536), False),
    ("gemma-4-e2b", dict(), 24, (8192, 32768), False),
    ("gemma-4-e2b", dict(), 80, (65536,), False),
)
FAMILY_TRAIN_PHASES = (("logprobs", "logprobs"), ("train: forward", "forward"), ("train: backward", "backward"),
                       ("train: optimizer step", "optimizer"))


def families(rows: list, record: dict, traces: bool = True, cells: tuple | None = None) -> None:
    """Section 4 of the module docstring: each cell's auto_fit plan (or why nothing fits), and the traces of its
    sampling phase and micro-batch at the settings it picked."""
    from transformers import AutoConfig

    from fastgrpo.bench.memory_trace import trace_sampling, trace_train_step
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import auto_fit, fitted, model_shapes

    for name, options, gpu, lengths, plan_only in cells or FAMILY_CELLS:
        model_config = AutoConfig.from_pretrained(harness.MODELS / name)
        shapes = model_shapes(model_config)
        for length in lengths:
            config = TrainConfig(model_name_or_path=name, dataset_name="builtin", use_peft=True, lora_r=16,
                                 offload_activations=True, num_generations=G, max_completion_length=length, bf16=True,
                                 **options)
            said = ", ".join(f"{k} {v}" for k, v in options.items())
            label = f"{name} LoRA r 16 ({said}), {gpu} GiB, L {length}"
            try:
                plan = auto_fit(config, gpu * GiB, shapes)
            except ValueError as error:
                record[label] = {"does not fit": str(error)}
                rows.append((label, {}, "does not fit", None, None, str(error).split("; at ")[0]))
                print(label, "does not fit", flush=True)
                continue
            picks = fitted(config, plan)
            entry = record[label] = {"picks": picks, "plan": {p: plan.peak(p) for p in plan.phases},
                                     "plan components": plan.phases, "settings": plan.settings}
            peak_phase = max(plan.phases, key=plan.peak)
            sampled = trace = None
            if traces and not plan_only:
                sampled = entry["sampling trace"] = trace_sampling(
                    model_config, kv_blocks=plan.settings["kv_blocks"], prompt_length=config.max_prompt_length,
                    completion_length=length, num_generations=G, num_prompts=config.generation_batch_size // G,
                    load_in_4bit=config.load_in_4bit, mlp_tile_tokens=plan.settings["mlp_tile_tokens"],
                    lora_dropout=config.lora_dropout, lora_experts=config.lora_experts)
                trace = entry["trace"] = trace_train_step(
                    model_config, micro_batch=plan.settings["per_device_train_batch_size"],
                    prompt_length=config.max_prompt_length, completion_length=length, use_peft=True, lora_r=16,
                    load_in_4bit=config.load_in_4bit, offload_activations=True, lora_dropout=config.lora_dropout,
                    lora_experts=config.lora_experts, mlp_tile_tokens=plan.settings["mlp_tile_tokens"], head="cuda")
                print(label, f"traced in {sampled['seconds'] + trace['seconds']:.0f} s", flush=True)
            pools = [(w, pages) for w, pages, layers, _ in plan.settings["page_groups"] if layers]
            rows.append((label, picks, "sampling", plan.peak("sampling"), sampled and sampled["sampling"],
                         f"{peak_phase}; KV pages " + ", ".join(f"{'logical' if w is None else f'window {w}'} {n}"
                                                                for w, n in pools)))
            for phase, key in FAMILY_TRAIN_PHASES:
                rows.append((label, picks, phase, plan.peak(phase), trace and trace[key], peak_phase))


CONFIGS_SAID = {
    "--families": "the published config.json (gpt-oss-20b; Gemma 3 12B's text model; Gemma 4 E2B's text model)",
    "--moe": "the published config.json (Qwen3-30B-A3B, gpt-oss-20b: fastgrpo/bench/models/README.md); "
             "--routing-replay on, its route records in the sampling phase",
    "--hybrids": "transformers' own default configs of Qwen3.5-9B and Qwen3.5-35B-A3B "
                 "(fastgrpo/bench/models/README.md); their Gated DeltaNet layers run transformers' PyTorch path, as "
                 "the plan counts them",
}


def families_report(rows: list, day: str, flag: str = "--families") -> str:
    title = {"--hybrids": "The hybrids", "--moe": "Mixture-of-experts models"}.get(flag, "The 2026 families")
    lines = [f"# {title} on one GPU: plans and traces ({day}, torch {torch.__version__}, transformers "
             f"{transformers_version()}, CPU only: no GPU)", "",
             f"`fastgrpo bench memory-plan {flag}`: `fastgrpo plan --model-name-or-path "
             "fastgrpo/bench/models/<model> --use-peft --offload-activations -G 8 --max-completion-length L "
             "--gpu-memory <card> --auto-fit` and the options shown (prompts of 512 tokens, 8 completions a step, "
             "LoRA r 16 as load_policy adds it: on gpt-oss's experts too, which takes lora_dropout 0; "
             "--recompute-lora-inputs, --mask-free-attention and --recompute-norms on, their defaults). Configs from "
             f"{CONFIGS_SAID[flag]}. Plan: "
             "fastgrpo/train/plan.py, each layer read from the meta build (fastgrpo/train/shapes.py). Trace: live "
             "tensor storages on fake CPU tensors at real shapes, at the settings auto-fit picked: the sampling phase "
             "(trace_sampling: the engine's KV cache with its logical pool and one pool per sliding window, its "
             "prefill and decode steps and the sampler) and one micro-batch's no-grad logprobs and training step "
             "(the loss in its CUDA form). A 24 GiB card leaves 21.8 GiB for tensors, 80 GiB 75.0 (the plan's "
             "reserve: 5% + 1 GiB).", "",
             "| cell | auto-fit picks | phase | plan GiB | trace GiB | error | notes |",
             "|---|---|---|---|---|---|---|"]
    for label, picks, phase, planned, counted, note in rows:
        said = " ".join(f"{k}={v}" for k, v in picks.items())
        if planned is None:
            lines.append(f"| {label} | | {phase} | | | | {note} |")
            continue
        traced = "" if counted is None else f"{counted / GiB:.2f}"
        err = "" if counted is None else error(planned, counted)
        lines.append(f"| {label} | {said} | {phase} | {planned / GiB:.2f} | {traced} | {err} | {note} |")
    return "\n".join(lines) + "\n"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def small_model(folder: Path, hidden: int, layers: int) -> str:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from fastgrpo.train import arithmetic

    tokenizer = arithmetic.build_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, tie_word_embeddings=False))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def measured_runs(rows: list, record: dict) -> None:
    from fastgrpo.bench.memory_trace import measure_trainer_step
    from fastgrpo.train import TrainConfig, Trainer, arithmetic
    from fastgrpo.train.plan import plan_memory

    cases = {
        "full fine-tuning, AdamW, beta 0.04": dict(beta=0.04),
        "LoRA r 16, num_iterations 2": dict(use_peft=True, num_iterations=2),
        "LoRA r 16, offload": dict(use_peft=True, offload_activations=True, num_iterations=2),
        "QLoRA (4-bit), AdamW 8-bit": dict(use_peft=True, load_in_4bit=True, optim="adamw_8bit", num_iterations=2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = small_model(Path(tmp) / "model", hidden=256, layers=4)
        data = Path(tmp) / "data.jsonl"
        # Prompts of one length, so every micro-batch is as long as the plan assumes (it plans the longest)
        problems = arithmetic.problems("train", 2000, seed=0)
        longest = max(len(r["prompt"]) for r in problems)
        problems = [r for r in problems if len(r["prompt"]) == longest][:64]
        data.write_text("".join(json.dumps(r) + "\n" for r in problems))
        for name, overrides in cases.items():
            config = TrainConfig(model_name_or_path=model, dataset_name=str(data), dataset_test_split=None,
                                 output_dir=str(Path(tmp) / name.replace(" ", "_")), num_generations=8,
                                 per_device_train_batch_size=16, max_completion_length=8, max_prompt_length=longest,
                                 report_to=["none"], disable_tqdm=True, reward_funcs=["length"], **overrides)
            trainer = Trainer(config)
            trainer.step = 1
            trainer.train_step()  # the optimizer's states exist from the first step on: measure a steady step
            trainer.step = 2
            measured = measure_trainer_step(trainer)
            plan = plan_memory(config, device_type="cpu")
            record[f"cpu {name}"] = {"measured": measured, "plan": {p: plan.peak(p) for p in plan.phases},
                                     "plan components": plan.phases}
            label = f"small Qwen2 (H 256, 4 layers) {name}"
            train_plan = max(plan.peak(p) for p in plan.phases if p.startswith("train"))
            rows.append((label, "sampling", plan.peak("sampling"), measured["sampling"], "measured (CPU, real)"))
            if measured["logprobs"] is not None:
                rows.append((label, "logprobs", plan.peak("logprobs"), measured["logprobs"], "measured (CPU, real)"))
            rows.append((label, "train (largest moment)", train_plan, measured["train"], "measured (CPU, real)"))
            print(label, "done", flush=True)


# Issue 39's hybrids: Qwen3.5-9B (24 Gated DeltaNet and 8 attention layers) and Qwen3.5-35B-A3B (30 and 10, 256 experts,
# 8 a token) from transformers' own default configs of those names (fastgrpo/bench/models/), LoRA r 16 with offload,
# 8K and 32K completions. The recurrent layers run transformers' PyTorch path (no flash-linear-attention on a CPU).
HYBRID_CELLS = (
    ("qwen3.5-9b", dict(load_in_4bit=True), 24, (8192, 32768), False),
    ("qwen3.5-9b", dict(), 80, (8192, 32768), False),
    ("qwen3.5-35b-a3b", dict(load_in_4bit=True, lora_experts=False), 24, (8192,), True),
    ("qwen3.5-35b-a3b", dict(load_in_4bit=True, lora_experts=False), 80, (8192, 32768), False),
)


# Issue 40's MoE models with LoRA and routing replay (route records counted in the sampling phase): Qwen3-30B-A3B (48
# layers of 128 experts of 768, 8 a token; fastgrpo/bench/models/qwen3-30b-a3b) and gpt-oss-20b. bitsandbytes'
# 4-bit quantizes linear layers only: the fused 3-D experts stay bf16 (Qwen3-30B-A3B's 54.0 GiB of them).
MOE_CELLS = (
    ("qwen3-30b-a3b", dict(load_in_4bit=True, lora_dropout=0.0, routing_replay=True), 24, (1024,), True),
    ("qwen3-30b-a3b", dict(load_in_4bit=True, lora_dropout=0.0, routing_replay=True), 80, (1024, 4096), False),
    ("qwen3-30b-a3b", dict(load_in_4bit=True, lora_experts=False, routing_replay=True), 80, (8192,), False),
    ("gpt-oss-20b", dict(load_in_4bit=True, lora_dropout=0.0, routing_replay=True), 24, (1024,), True),
    ("gpt-oss-20b", dict(load_in_4bit=True, lora_dropout=0.0, routing_replay=True), 80, (4096,), False),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-traces", action="store_true", help="only the measured CPU runs")
    parser.add_argument("--long-reasoning", action="store_true",
                        help="only the long-reasoning cells (issue 33): auto-fit plans and traces at 16K-110K tokens")
    parser.add_argument("--families", action="store_true", help="only the 2026 families (issue 38): gpt-oss-20b, "
                                                                  "Gemma 3 12B, Gemma 4 E2B on 24 and 80 GiB")
    parser.add_argument("--hybrids", action="store_true", help="only the hybrids (issue 39): Qwen3.5-9B and "
                                                                 "Qwen3.5-35B-A3B on 24 and 80 GiB")
    parser.add_argument("--moe", action="store_true", help="only the MoE models (issue 40): Qwen3-30B-A3B and "
                                                            "gpt-oss-20b with LoRA and routing replay on 24 and 80 GiB")
    parser.add_argument("--no-long-traces", action="store_true",
                        help="with --long-reasoning, --families, --hybrids or --moe: plans only")
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .json and .md results go")


def run(args: argparse.Namespace) -> list[tuple]:
    harness.check_out_dir(args.out_dir)
    rows, record = [], {}
    day = datetime.date.today().isoformat()
    if args.families or args.hybrids or args.moe:
        cells, name = ((HYBRID_CELLS, "hybrids") if args.hybrids else (MOE_CELLS, "moe") if args.moe
                       else (FAMILY_CELLS, "families"))
        families(rows, record, traces=not args.no_long_traces, cells=cells)
        write(args.out_dir, f"memory-plan-{name}-{day}", families_report(rows, day, f"--{name}"), record)
        return rows
    if args.long_reasoning:
        long_reasoning(rows, record, traces=not args.no_long_traces)
        write(args.out_dir, f"memory-plan-long-{day}", long_reasoning_report(rows, day), record)
        return rows
    if not args.skip_traces:
        real_shapes(rows, record)
    measured_runs(rows, record)
    lines = [f"# Memory plan vs counted bytes ({day}, torch {torch.__version__}, CPU only: no GPU)", "",
             "`fastgrpo bench memory-plan`. Plan: fastgrpo/train/plan.py from the model's config. Trace: live "
             "tensor storages of the sampling phase (trace_sampling: a round of 8 completions, its whole KV pool), one "
             "micro-batch (no-grad logprobs and training) and a decode step on fake CPU tensors at real shapes (G 8, "
             "256 + 1024 tokens, micro-batch 8, LoRA r 16, the layer options at their defaults, the loss in its CUDA "
             "form). Measured: live tensor storages of one "
             "real `Trainer.train_step` on this CPU (fp32). Error = (plan - count) / count.", "",
             "| model / run | phase | plan GiB | counted GiB | error | counted by |", "|---|---|---|---|---|---|"]
    for label, phase, planned, counted, how in rows:
        scale = GiB if counted > GiB / 16 else 2**20
        unit = "" if scale == GiB else " MiB"
        lines.append(f"| {label} | {phase} | {planned / scale:.3f}{unit} | {counted / scale:.3f}{unit} | "
                     f"{error(planned, counted)} | {how} |")
    write(args.out_dir, f"memory-plan-{day}", "\n".join(lines) + "\n", record)
    return rows


def write(out_dir: str, name: str, text: str, record: dict) -> None:
    """Prints the report and writes it to <out_dir>/<name>.md, the record to <name>.json."""
    print(text)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
