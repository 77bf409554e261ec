"""One TRL GRPO training step, stock `trl.GRPOTrainer` vs fastgrpo's `FastGRPOTrainer`: time and peak memory.

Workload: a random-weight Qwen2-shaped model and one micro-batch of B completions of exactly T tokens after P prompt
tokens (random ids, advantages ~ N(0, 1)), as TRL's generation step hands it to the loss, under TRL's default config
(loss_type dapo, gradient checkpointing on). Generation and rewards are not timed: both trainers run TRL's own code
for them. Two phases, each timed as the median of --repeats runs after one untimed warm-up run:

  logprobs   the no-grad pass that computes old / reference logprobs (`_get_per_token_logps_and_entropies`)
  step       `compute_loss` + backward, as `Trainer.training_step` runs them (no optimizer step: the same in both)

Peak memory is the largest growth over any run of a phase (warm-up included) above the level at its start (CUDA:
allocator peak; CPU: resident-set peak). Each method runs in its own process, so neither sees the other's caches.

    fastgrpo bench trl                               # CPU: tiny model, 8 x 256; GPU: Qwen2.5-1.5B shape, 8 x 1024
    python -m fastgrpo bench trl --quick
    fastgrpo bench trl --shape qwen2.5-1.5b --completions 8 --completion-len 1024
"""

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass

import torch

from fastgrpo import bench as harness

METHODS = ("trl", "fastgrpo")
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


@dataclass(frozen=True)
class Workload:
    shape: str
    device: str
    dtype: str
    completions: int
    prompt_len: int
    completion_len: int
    loss_type: str
    repeats: int
    threads: int  # torch intra-op threads (CPU)


def word_tokenizer(vocab_size: int):
    """Offline word-level tokenizer covering the model's vocab: <pad> 0, <eos> 1, <unk> 2, then w3 .. w{V-1}."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<unk>": UNK_ID, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_trainer(method: str, workload: Workload, output_dir: str):
    """The method's trainer around a fresh random-weight model (seed 0), with TRL's default config otherwise."""
    import datasets
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from fastgrpo.integrations.trl import FastGRPOTrainer

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    config = Qwen2Config(**harness.SHAPES[workload.shape], max_position_embeddings=32768, pad_token_id=PAD_ID,
                         eos_token_id=EOS_ID, bos_token_id=EOS_ID)
    torch.manual_seed(0)
    with torch.device(workload.device):
        model = Qwen2ForCausalLM(config).to(harness.DTYPES[workload.dtype])
    B = workload.completions
    args = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=B, num_generations=B, loss_type=workload.loss_type,
        max_completion_length=workload.completion_len, use_cpu=workload.device == "cpu",
        bf16=workload.dtype == "bf16", fp16=workload.dtype == "fp16", report_to=[], save_strategy="no",
    )
    trainer_cls = FastGRPOTrainer if method == "fastgrpo" else GRPOTrainer
    return trainer_cls(model=model, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
                       train_dataset=datasets.Dataset.from_dict({"prompt": ["w3"] * B}),
                       processing_class=word_tokenizer(config.vocab_size))


def make_inputs(workload: Workload, vocab_size: int) -> dict:
    """One micro-batch as TRL's `_generate_and_score_completions` returns it (beta = 0: no reference logprobs)."""
    g = torch.Generator().manual_seed(0)
    B, P, T = workload.completions, workload.prompt_len, workload.completion_len
    inputs = {
        "prompt_ids": torch.randint(3, vocab_size, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab_size, (B, T), generator=g),
        "completion_mask": torch.ones(B, T, dtype=torch.long),
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": torch.tensor(B * T),
    }
    return {k: v.to(workload.device) for k, v in inputs.items()}


def measure(method: str, workload: Workload) -> dict:
    """Run in this process: build the trainer, then time the logprob pass and the loss step."""
    device = torch.device(workload.device)
    torch.set_num_threads(workload.threads)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(method, workload, output_dir)
        model = trainer.model
        model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop
        inputs = make_inputs(workload, model.config.vocab_size)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)

        @torch.no_grad()
        def logprobs():
            return trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                              workload.completion_len)[0]

        def step():
            model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(loss)
            return loss.detach()

        # One untimed warm-up run; its peak counts too (see harness.time_call).
        timing = dict(repeats=workload.repeats, warmup=1, warmup_peaks=True)
        logprobs_s, logprobs_peak, logps = harness.time_call(lambda _: logprobs(), device, **timing)
        step_s, step_peak, loss = harness.time_call(lambda _: step(), device, **timing)
    import trl

    tokens = workload.completions * workload.completion_len
    return {"method": method, **asdict(workload), "trl": trl.__version__,
            "tokens": tokens, "loss": loss.item(),
            "mean_logp": logps.float().mean().item(), "logprobs_seconds": logprobs_s,
            "logprobs_peak_bytes": logprobs_peak, "step_seconds": step_s, "step_peak_bytes": step_peak,
            "step_tokens_per_s": tokens / step_s}


def run_isolated(method: str, workload: Workload) -> dict:
    row, error = harness.run_in_child("fastgrpo.bench.trl_step", method, json.dumps(asdict(workload)))
    return row if error is None else {"method": method, **asdict(workload), "error": error}


def default_workload(device: str, quick: bool) -> dict:
    if quick:
        return dict(shape="tiny", completions=2, prompt_len=8, completion_len=16, repeats=1)
    if device == "cuda":
        return dict(shape="qwen2.5-1.5b", completions=8, prompt_len=128, completion_len=1024, repeats=5)
    return dict(shape="tiny", completions=8, prompt_len=64, completion_len=256, repeats=3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a few seconds on a CPU: tiny model, 2 x 16 tokens")
    harness.add_device_arguments(parser, shape="model shape (random weights)")
    parser.add_argument("--completions", type=int, help="completions in the micro-batch B")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per completion")
    parser.add_argument("--completion-len", type=int, help="tokens per completion T (all scored)")
    parser.add_argument("--repeats", type=int, help="timed runs per phase (median reported)")
    parser.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type (default: TRL's, dapo)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (default: torch's); 1 on a CPU shared with other work, whose OpenMP "
                             "spin-waits otherwise dominate the timings")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .json and .md results go")


def run(args: argparse.Namespace) -> list[dict]:
    device = harness.start_run(args)
    defaults = default_workload(device, args.quick)
    chosen = dict(shape=args.shape, completions=args.completions, prompt_len=args.prompt_len,
                  completion_len=args.completion_len, repeats=args.repeats, threads=args.threads)
    for name in ("completions", "prompt_len", "completion_len", "repeats", "threads"):
        if chosen[name] is not None and chosen[name] < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {chosen[name]}")
    if chosen["completions"] is not None and chosen["completions"] < 2:
        raise SystemExit(f"--completions must be >= 2 (GRPO groups need 2 completions), got {chosen['completions']}")
    workload = Workload(device=device, dtype=args.dtype or ("bf16" if device == "cuda" else "fp32"),
                        loss_type=args.loss_type, **{k: v if v is not None else defaults.get(k)
                                                     for k, v in chosen.items()})
    rows = [run_isolated(method, workload) for method in args.methods]
    baseline = next((r for r in rows if r["method"] == "trl" and "error" not in r), None)
    for row in rows:
        if "error" in row:
            continue
        row["logprobs_peak_mib"] = row["logprobs_peak_bytes"] / 2**20
        row["step_peak_mib"] = row["step_peak_bytes"] / 2**20
        if baseline:
            row["step_speedup_vs_trl"] = baseline["step_seconds"] / row["step_seconds"]
            row["step_memory_vs_trl"] = row["step_peak_bytes"] / max(baseline["step_peak_bytes"], 1)
    env = harness.environment(torch.device(device))
    for row in rows:
        row.update(env)
    table = harness.markdown_table(rows, [("method", "method", ""), ("loss", "loss", ".6f"),
                                  ("logprobs s", "logprobs_seconds", ".3f"),
                                  ("logprobs peak MiB", "logprobs_peak_mib", ".1f"),
                                  ("step s", "step_seconds", ".3f"), ("step peak MiB", "step_peak_mib", ".1f"),
                                  ("step tokens/s", "step_tokens_per_s", ".0f"),
                                  ("step x TRL", "step_speedup_vs_trl", ".2f"),
                                  ("step memory / TRL", "step_memory_vs_trl", ".2f")])
    title = (f"{workload.shape} ({workload.dtype}) on {env['device']}: {workload.completions} completions x "
             f"{workload.completion_len} tokens after {workload.prompt_len} prompt tokens, loss_type "
             f"{workload.loss_type}, median of {workload.repeats}, {workload.threads} torch thread(s)")
    harness.publish(args.out_dir, "trl-step", env, rows, title, table)
    return rows


def main(argv: list[str] | None = None) -> None:
    harness.suite_main(argv, __doc__, add_arguments, run,
               lambda method, payload: measure(method, Workload(**json.loads(payload))))


if __name__ == "__main__":
    main()
