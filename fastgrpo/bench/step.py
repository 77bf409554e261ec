"""One whole GRPO training step: fastgrpo's `Trainer` vs stock `trl.GRPOTrainer` (HF generate, no vLLM, no Liger).

Workload: a random-weight Qwen2-shaped model saved once (seed 0) with a word-level tokenizer, which both trainers load
from the same folder; P prompts of random words (one token each) x G completions, sampled at temperature 1 up to
max_new_tokens. A random model almost never samples EOS, so hidden dimension 0 carries a constant (BIAS in every
token embedding) and the EOS row of lm_head reads only that dimension, scaled so that p(EOS) is about 1 / eos_every
per token: completions stop at geometrically spread lengths, a few reaching the cap. Both trainers run the same
recipe: AdamW (torch's, TRL's optim="adamw_torch"), constant learning rate, no warmup, grad clip 1.0, loss_type
dapo, beta 0, one iteration, one optimizer step per round (micro-batches of --micro-batch completions), gradient
checkpointing (non-reentrant), and one length reward (`length_reward`). Each method runs in its own process; it
trains 1 + --repeats steps, the first an untimed warm-up, and reports the timed step of median total time. Both
samplers draw their own random completions, so the lengths differ between the two; tokens/s (generated tokens over
the step's time) compares steps of unequal length.

Phases of a step (they sum to its total):

  fastgrpo (the laps of `Trainer.train_step`'s Timer)
    sampling   the paged engine's generate: a finished completion leaves the batch at its EOS
    rewards    decode, reward functions, group advantages, the rollout's tensors
    logprobs   no-grad old / reference logprobs (the "reference" lap): none with beta 0 and on-policy updates
    update     per micro-batch: checkpointed backbone forward, fused GRPO loss on the completion hidden states,
               backward; then clip, AdamW, scheduler
    other      the rest of the train_step call (its step metrics)
  trl (stock methods wrapped with timers; a step runs from the loop's on_step_begin to on_step_end)
    sampling   `_generate_single_turn`: left-pad, HF `generate` of the whole generation batch (it decodes until every
               row has stopped or the longest hits the cap; stopped rows keep decoding padding), cut at EOS
    rewards    the rest of `_prepare_inputs`: tokenize prompts, decode, pad to tensors, reward functions, advantages,
               metrics, shuffle and split into micro-batches
    logprobs   no-grad `_get_per_token_logps_and_entropies` (old / reference): none here, as in fastgrpo
    update     each `training_step` less its `_prepare_inputs` (compute_loss: checkpointed forward, chunked logprobs,
               loss; backward), then clip, AdamW, scheduler, zero_grad up to on_step_end
    other      the HF loop's bookkeeping between micro-batches

Peak memory is a step's largest growth above the level at its start. CUDA: the allocator's peak over the timed
steps. CPU: the resident set's peak over every step, warm-up included, as in harness.time_call: pages freed in one
step stay resident for the next, so later steps grow less than their work needs; the warm-up step's growth includes
the AdamW state (two more copies of the weights) in both trainers.

With --model (a model folder or .gguf file) the workload runs on that model's real weights instead: loaded once as
`fastgrpo train` loads it (a GGUF dequantized) and saved as one folder that both trainers load, with its own tokenizer
and EOS; each prompt is prompt_len random tokens of its vocabulary as one user message, so that both trainers put it
through the same chat template (as the text without one), and completions end at the model's own EOS (--eos-every
does not apply).

    fastgrpo bench step --threads 1              # tiny Qwen2 shape, 8 prompts x G 8, prompt 128, up to 128 new tokens
    fastgrpo bench step --model path/to/model.gguf --prompts 2 --group-size 8 --prompt-len 32 --max-new-tokens 32
    python -m fastgrpo.bench.step --quick
"""

import argparse
import importlib.metadata
import json
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fastgrpo import bench as harness
from fastgrpo.bench.trl_step import EOS_ID, PAD_ID, word_tokenizer
from fastgrpo.memory import peak_memory, reset_peak_memory

METHODS = ("trl", "fastgrpo")
SEED = 42  # both trainers' seed (data order, sampling)
LEARNING_RATE = 1e-6  # TRL's GRPOConfig default
# Hidden dimension 0 of every token embedding. With the tiny shape it reaches the final norm as 5.0 +- 0.07 while
# the other dimensions keep their random scale (next-token entropy 8.267 nats against 8.266 without it).
BIAS = 1.0
CALIBRATION_SEQUENCES = 8  # random sequences of prompt_len + max_new_tokens tokens that p(EOS) is fitted on


@dataclass(frozen=True)
class Workload:
    shape: str
    device: str
    dtype: str
    prompts: int  # P per step
    group_size: int  # G
    prompt_len: int
    max_new_tokens: int
    micro_batch: int  # completions per forward/backward
    eos_every: float  # p(EOS) = 1 / eos_every per sampled token
    repeats: int  # timed steps, after one untimed warm-up step
    threads: int  # torch intra-op threads (CPU)
    model: str | None = None  # a model folder or .gguf file whose weights replace the random `shape`

    @property
    def steps(self) -> int:
        return 1 + self.repeats

    @property
    def completions(self) -> int:
        return self.prompts * self.group_size


def length_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """The completion's length in tokens / 100: a rule reward with TRL's signature, the same in both trainers."""
    return [len(ids) / 100 for ids in completion_ids]


# -- the shared model and prompts ------------------------------------------------------------------------------------


def prompt_texts(workload: Workload, vocab_size: int) -> list[str]:
    """P distinct prompts per step, prompt_len words each; the word wI is token I of the word-level tokenizer."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (workload.prompts * workload.steps, workload.prompt_len), generator=g)
    return [" ".join(f"w{i}" for i in row) for row in ids.tolist()]


def build_model(workload: Workload):
    """The random-weight model (seed 0) whose EOS row makes p(EOS) about 1 / eos_every per token."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**harness.SHAPES[workload.shape], max_position_embeddings=32768, pad_token_id=PAD_ID,
                         eos_token_id=EOS_ID, bos_token_id=EOS_ID)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = BIAS
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS_ID, PAD_ID
    calibrate_eos(model, workload)
    return model.to(harness.DTYPES[workload.dtype])


@torch.no_grad()
def calibrate_eos(model, workload: Workload) -> float:
    """Set the EOS row of lm_head to scale * e_0, scale bisected so that the mean p(EOS) over random sequences is
    1 / eos_every; returns that mean. The hidden states do not depend on the EOS row (no input holds EOS), so one
    forward serves every trial."""
    g = torch.Generator().manual_seed(1)
    length = workload.prompt_len + workload.max_new_tokens
    ids = torch.randint(3, model.config.vocab_size, (CALIBRATION_SEQUENCES, length), generator=g)
    hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)  # [N, H]
    head = model.get_output_embeddings().weight  # [V, H]
    others = torch.cat([head[:EOS_ID], head[EOS_ID + 1 :]])  # [V-1, H]
    other_lse = (hidden @ others.T).logsumexp(-1)  # [N]
    p_eos = lambda scale: torch.sigmoid(scale * hidden[:, 0] - other_lse).mean().item()
    target, low, high = 1 / workload.eos_every, 0.0, 1.0
    while p_eos(high) < target:
        high *= 2
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if p_eos(middle) < target else (low, middle)
    head[EOS_ID] = 0
    head[EOS_ID, 0] = high
    return p_eos(high)


def save_model_inputs(workload: Workload, folder: Path) -> None:
    """--model: its weights and tokenizer as `fastgrpo train` loads them, saved to folder/model; prompt_len random
    tokens of its vocabulary (no special token) per prompt, decoded, to folder/prompts.jsonl: as one user message
    where the tokenizer has a chat template (both trainers apply it then), else as the text."""
    from fastgrpo.train.config import TrainConfig
    from fastgrpo.train.loading import load_policy, load_tokenizer

    config = TrainConfig(model_name_or_path=workload.model, dataset_name="builtin", bf16=False,
                         gradient_checkpointing=False)
    model, tokenizer = load_policy(config, torch.device("cpu")), load_tokenizer(config)
    model.config.use_cache = True  # load_policy turns the KV cache off for training; HF generate (TRL) needs it
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    special = set(tokenizer.all_special_ids)
    vocab = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    g = torch.Generator().manual_seed(0)
    ids = vocab[torch.randint(len(vocab), (workload.prompts * workload.steps, workload.prompt_len), generator=g)]
    texts = map(tokenizer.decode, ids.tolist())
    rows = [{"prompt": [{"role": "user", "content": text}] if tokenizer.chat_template else text} for text in texts]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def save_inputs(workload: Workload, folder: Path) -> None:
    """folder/model (weights, config, tokenizer) and folder/prompts.jsonl, read by both methods' processes."""
    if workload.model is not None:
        return save_model_inputs(workload, folder)
    model = build_model(workload)
    model.save_pretrained(folder / "model")
    word_tokenizer(model.config.vocab_size).save_pretrained(folder / "model")
    rows = [{"prompt": text} for text in prompt_texts(workload, model.config.vocab_size)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


# -- fastgrpo --------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_fastgrpo(workload: Workload, folder: Path) -> list[dict]:
    from fastgrpo.train.config import TrainConfig
    from fastgrpo.train.trainer import Trainer

    config = TrainConfig(
        model_name_or_path=str(folder / "model"), dataset_name=str(folder / "prompts.jsonl"),
        dataset_test_split=None, answer_column=None, max_prompt_length=None, bf16=workload.dtype == "bf16",
        num_generations=workload.group_size, max_completion_length=workload.max_new_tokens,
        reward_funcs=["fastgrpo.bench.step:length_reward"], loss_type="dapo", beta=0.0, learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant", per_device_train_batch_size=workload.micro_batch,
        gradient_accumulation_steps=workload.completions // workload.micro_batch, gradient_checkpointing=True,
        max_steps=workload.steps, seed=SEED, output_dir=str(folder / "fastgrpo-run"), report_to=["none"],
        disable_tqdm=True,
    )  # fmt: skip
    device = torch.device(workload.device)
    trainer = Trainer(config, device)
    steps = []
    try:
        for _ in range(workload.steps):
            trainer.step += 1
            _sync(device)
            base = reset_peak_memory(device)
            start = time.perf_counter()
            metrics = trainer.train_step()
            _sync(device)
            total = time.perf_counter() - start
            phases = {"sampling": metrics["time/sampling"], "rewards": metrics["time/rewards"],
                      "logprobs": metrics["time/reference"], "update": metrics["time/train"]}
            lengths = {"generated_tokens": round(metrics["completions/mean_length"] * workload.completions),
                       "mean_length": metrics["completions/mean_length"],
                       "min_length": int(metrics["completions/min_length"]),
                       "max_length": int(metrics["completions/max_length"]),
                       "clipped_ratio": metrics["completions/clipped_ratio"]}
            steps.append(_step_row(total, phases, peak_memory(device) - base, lengths))
    finally:
        trainer.folder.release()
    return steps


def _step_row(total: float, phases: dict, peak: int, lengths: dict) -> dict:
    """One step: its total and phase seconds (other = the rest), peak bytes, completion-length statistics."""
    return {"total_seconds": total, **{f"{name}_seconds": seconds for name, seconds in phases.items()},
            "other_seconds": total - sum(phases.values()), "peak_bytes": peak, **lengths}


# -- TRL -------------------------------------------------------------------------------------------------------------


def _step_clock(device: torch.device, eos_id: int):
    """A TrainerCallback timing each optimizer step of TRL's loop, and the phases of the trainer methods it wraps."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps, self.seconds, self.completion_ids = [], defaultdict(float), []

        def wrap(self, trainer, method: str, phase: str, no_grad_only: bool = False) -> None:
            """Replace trainer.<method> by a call that adds its time to `phase` (only calls without autograd)."""
            own = getattr(trainer, method)

            def timed(*args, **kwargs):
                if no_grad_only and torch.is_grad_enabled():
                    return own(*args, **kwargs)
                _sync(device)
                start = time.perf_counter()
                out = own(*args, **kwargs)
                _sync(device)
                self.last_end = time.perf_counter()
                self.seconds[phase] += self.last_end - start
                if method == "_generate_single_turn":
                    self.completion_ids += out[0]
                return out

            setattr(trainer, method, timed)

        def attach(self, trainer) -> None:
            self.wrap(trainer, "_generate_single_turn", "sampling")
            self.wrap(trainer, "_get_per_token_logps_and_entropies", "logprobs", no_grad_only=True)
            self.wrap(trainer, "_prepare_inputs", "prepare")
            self.wrap(trainer, "training_step", "training_step")

        def on_step_begin(self, args, state, control, **kwargs):
            self.seconds.clear()
            self.completion_ids = []
            _sync(device)
            self.base = reset_peak_memory(device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            end = time.perf_counter()
            s = self.seconds
            phases = {"sampling": s["sampling"], "rewards": s["prepare"] - s["sampling"] - s["logprobs"],
                      "logprobs": s["logprobs"], "update": s["training_step"] - s["prepare"] + end - self.last_end}
            lengths = [len(ids) for ids in self.completion_ids]  # [P*G], each up to and including its EOS
            stats = {"generated_tokens": sum(lengths), "mean_length": sum(lengths) / len(lengths),
                     "min_length": min(lengths), "max_length": max(lengths),
                     "clipped_ratio": sum(ids[-1] != eos_id for ids in self.completion_ids) / len(lengths)}
            self.steps.append(_step_row(end - self.start, phases, peak_memory(device) - self.base, stats))

    return StepClock()


def run_trl(workload: Workload, folder: Path) -> list[dict]:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from fastgrpo.train.loading import tokenizer_from

    device = torch.device(workload.device)
    rows = [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()]
    dtype_name = str(harness.DTYPES[workload.dtype]).removeprefix("torch.")  # "float32": TRL's model_init_kwargs
    args = GRPOConfig(
        output_dir=str(folder / "trl-run"), use_cpu=workload.device == "cpu", bf16=workload.dtype == "bf16",
        fp16=workload.dtype == "fp16", model_init_kwargs={"dtype": dtype_name},
        num_generations=workload.group_size, max_completion_length=workload.max_new_tokens,
        per_device_train_batch_size=workload.micro_batch,
        gradient_accumulation_steps=workload.completions // workload.micro_batch, loss_type="dapo", beta=0.0,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", optim="adamw_torch", gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, max_steps=workload.steps, seed=SEED,
        report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    # The tokenizer as fastgrpo's trainer loads it: the word-level one itself (AutoTokenizer would load a qwen2
    # folder's tokenizer as Qwen2Tokenizer), a --model's own.
    tokenizer = tokenizer_from(str(folder / "model"))
    clock = _step_clock(device, tokenizer.eos_token_id)
    trainer = GRPOTrainer(model=str(folder / "model"), reward_funcs=length_reward, args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                          callbacks=[clock])
    clock.attach(trainer)
    trainer.train()
    return clock.steps


# -- one method, all methods ----------------------------------------------------------------------------------------


def measure(method: str, workload: Workload, folder: Path) -> dict:
    """Run in this process: 1 + repeats steps of `method`; the row of the timed step with the median total time."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    torch.set_num_threads(workload.threads)
    steps = (run_trl if method == "trl" else run_fastgrpo)(workload, folder)
    if len(steps) != workload.steps:
        raise RuntimeError(f"{method} ran {len(steps)} steps, expected {workload.steps}")
    timed = steps[1:]
    median = statistics.median_low(step["total_seconds"] for step in timed)
    row = next(step for step in timed if step["total_seconds"] == median)
    return {"method": method, **asdict(workload), "trl": importlib.metadata.version("trl"), **row,
            "peak_bytes": max(step["peak_bytes"] for step in (steps if workload.device == "cpu" else timed)),
            "tokens_per_s": row["generated_tokens"] / row["total_seconds"], "steps": steps}


def run_isolated(method: str, workload: Workload, folder: Path) -> dict:
    payload = json.dumps({"workload": asdict(workload), "folder": str(folder)})
    row, error = harness.run_in_child("fastgrpo.bench.step", method, payload)
    return row if error is None else {"method": method, **asdict(workload), "error": error}


def default_workload(quick: bool) -> dict:
    if quick:
        return dict(shape="tiny", prompts=2, group_size=4, prompt_len=16, max_new_tokens=24, eos_every=8.0,
                    repeats=1)
    return dict(shape="tiny", prompts=8, group_size=8, prompt_len=128, max_new_tokens=128, eos_every=48.0, repeats=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds on a CPU: tiny model, 2 prompts x G 4, prompt 16, up to 24 new tokens")
    harness.add_device_arguments(parser, shape="model shape (random weights; default tiny)")
    parser.add_argument("--model", help="a model folder or .gguf file: its real weights instead of --shape's random "
                                         "ones (its chat template, tokenizer and EOS)")
    parser.add_argument("--prompts", type=int, help="prompts per step P (default 8)")
    parser.add_argument("--group-size", type=int, help="completions per prompt G (default 8)")
    parser.add_argument("--prompt-len", type=int, help="tokens per prompt (default 128)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per completion at most (default 128)")
    parser.add_argument("--micro-batch", type=int, help="completions per forward/backward (default: G)")
    parser.add_argument("--eos-every", type=float, help="mean tokens per EOS: p(EOS) = 1 / this per token (default 48)")
    parser.add_argument("--repeats", type=int, help="timed steps after the warm-up step (median reported; default 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a CPU shared with other work OpenMP spin-waits otherwise "
                             "dominate the timings)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .json and .md results go")


def _workload(args: argparse.Namespace, device: str) -> Workload:
    defaults = default_workload(args.quick)
    chosen = dict(shape=args.shape, prompts=args.prompts, group_size=args.group_size, prompt_len=args.prompt_len,
                  max_new_tokens=args.max_new_tokens, eos_every=args.eos_every, repeats=args.repeats)
    for name in ("prompts", "group_size", "prompt_len", "max_new_tokens", "repeats"):
        if chosen[name] is not None and chosen[name] < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {chosen[name]}")
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    if chosen["group_size"] is not None and chosen["group_size"] < 2:
        raise SystemExit(f"--group-size must be >= 2 (GRPO groups need 2 completions), got {chosen['group_size']}")
    if args.model is not None:
        if args.shape is not None:
            raise SystemExit("--shape and --model: give one (--model's weights replace the random shape's)")
        if not Path(args.model).exists():
            raise SystemExit(f"--model: {args.model} does not exist")
        chosen["shape"] = Path(args.model).name
    if chosen["eos_every"] is not None and not chosen["eos_every"] > 1:
        raise SystemExit(f"--eos-every must be > 1 (p(EOS) below 1), got {chosen['eos_every']}")
    values = {k: v if v is not None else defaults[k] for k, v in chosen.items()}
    micro_batch = args.micro_batch if args.micro_batch is not None else values["group_size"]
    completions = values["prompts"] * values["group_size"]
    if micro_batch < 1 or completions % micro_batch:
        raise SystemExit(f"--micro-batch must divide the {completions} completions of a step, got {micro_batch}")
    return Workload(device=device, dtype=args.dtype or ("bf16" if device == "cuda" else "fp32"),
                    micro_batch=micro_batch, threads=args.threads, model=args.model, **values)


def run(args: argparse.Namespace) -> list[dict]:
    device = harness.start_run(args)
    workload = _workload(args, device)
    with tempfile.TemporaryDirectory(prefix="fastgrpo-bench-step-") as folder:
        save_inputs(workload, Path(folder))
        rows = [run_isolated(method, workload, Path(folder)) for method in args.methods]
    baseline = next((r for r in rows if r["method"] == "trl" and "error" not in r), None)
    for row in rows:
        if "error" in row:
            continue
        row["peak_mib"] = row["peak_bytes"] / 2**20
        row["lengths"] = f"{row['min_length']}-{row['max_length']}"
        if baseline:
            for key in ("total_seconds", "sampling_seconds", "update_seconds", "peak_bytes"):
                row[f"{key.split('_')[0]}_vs_trl"] = row[key] / max(baseline[key], 1e-12)
    env = harness.environment(torch.device(device))
    for row in rows:
        row.update(env)
    table = harness.markdown_table(rows, [
        ("method", "method", ""), ("step s", "total_seconds", ".3f"), ("sampling s", "sampling_seconds", ".3f"),
        ("rewards s", "rewards_seconds", ".3f"), ("logprobs s", "logprobs_seconds", ".3f"),
        ("update s", "update_seconds", ".3f"), ("other s", "other_seconds", ".3f"), ("peak MiB", "peak_mib", ".1f"),
        ("generated tokens", "generated_tokens", "d"), ("mean length", "mean_length", ".1f"),
        ("lengths", "lengths", ""), ("at cap", "clipped_ratio", ".0%"), ("tokens/s", "tokens_per_s", ".0f"),
        ("step / TRL", "total_vs_trl", ".2f"), ("sampling / TRL", "sampling_vs_trl", ".2f"),
        ("update / TRL", "update_vs_trl", ".2f"), ("memory / TRL", "peak_vs_trl", ".2f"),
    ])  # fmt: skip
    eos = f"p(EOS) 1/{workload.eos_every:g}" if workload.model is None else "its own EOS; chat template"
    title = (f"{workload.shape} ({workload.dtype}) on {env['device']}: one GRPO step of {workload.prompts} prompts x "
             f"G={workload.group_size}, prompt {workload.prompt_len}, up to {workload.max_new_tokens} new tokens "
             f"({eos}), micro-batch {workload.micro_batch}, dapo, beta 0; median of "
             f"{workload.repeats} step(s) after a warm-up step, {workload.threads} torch thread(s)")
    harness.publish(args.out_dir, "step", env, rows, title, table)
    return rows


def _one(method: str, payload: str) -> dict:
    values = json.loads(payload)
    return measure(method, Workload(**values["workload"]), Path(values["folder"]))


def main(argv: list[str] | None = None) -> None:
    harness.suite_main(argv, __doc__, add_arguments, run, _one)


if __name__ == "__main__":
    main()
