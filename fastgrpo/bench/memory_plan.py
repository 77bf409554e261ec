"""The memory plan (fastgrpo/train/plan.py) against live-tensor counts (fastgrpo/bench/memory_trace.py), by phase.

1. Real shapes (Qwen2.5-1.5B, Qwen2.5-7B, Llama-3.1-8B from fastgrpo/bench/models/*/config.json): one training
   micro-batch (G = 8 completions of 1024 tokens after 256-token prompts, LoRA r 16, bf16 or a 4-bit base, offload off
   or on) and one decode step (64 sequences of 1280 tokens) traced on fake CPU tensors, the loss in its CUDA form.
2. Real runs on this CPU: one `Trainer.train_step` of small Qwen2 models (fp32) per configuration, measured.

    fastgrpo bench memory-plan                  # both; ~6 min on 2 cores
    fastgrpo bench memory-plan --skip-traces    # only the measured CPU runs

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

    from fastgrpo.bench.memory_trace import trace_decode_step, trace_train_step
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
                pairs = [("train: forward + loss", max(plan.peak("train: forward"), plan.peak("train: loss")),
                          trace["forward"]),
                         ("train: loss", plan.peak("train: loss"), trace["loss"]),
                         ("train: backward", plan.peak("train: backward"), trace["backward"]),
                         ("train: optimizer step", plan.peak("train: optimizer step"), trace["optimizer"])]
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-traces", action="store_true", help="only the measured CPU runs")
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .json and .md results go")


def run(args: argparse.Namespace) -> list[tuple]:
    harness.check_out_dir(args.out_dir)
    rows, record = [], {}
    if not args.skip_traces:
        real_shapes(rows, record)
    measured_runs(rows, record)
    day = datetime.date.today().isoformat()
    lines = [f"# Memory plan vs counted bytes ({day}, torch {torch.__version__}, CPU only: no GPU)", "",
             "`fastgrpo bench memory-plan`. Plan: fastgrpo/train/plan.py from the model's config. Trace: live "
             "tensor storages of one micro-batch / decode step on fake CPU tensors at real shapes (G 8, 256 + 1024 "
             "tokens, micro-batch 8, LoRA r 16, the loss in its CUDA form). Measured: live tensor storages of one "
             "real `Trainer.train_step` on this CPU (fp32). Error = (plan - count) / count.", "",
             "| model / run | phase | plan GiB | counted GiB | error | counted by |", "|---|---|---|---|---|---|"]
    for label, phase, planned, counted, how in rows:
        scale = GiB if counted > GiB / 16 else 2**20
        unit = "" if scale == GiB else " MiB"
        lines.append(f"| {label} | {phase} | {planned / scale:.3f}{unit} | {counted / scale:.3f}{unit} | "
                     f"{error(planned, counted)} | {how} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"memory-plan-{day}.md").write_text(text)
    (out / f"memory-plan-{day}.json").write_text(json.dumps(record, indent=1, default=str))
    return rows
