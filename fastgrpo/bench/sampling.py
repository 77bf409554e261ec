"""Sampling throughput and peak memory: fastgrpo's paged engine vs HF `generate` and transformers' `generate_batch`.

Workload: random-weight Qwen2-shaped model, P random prompts of equal length, G completions each, sampled at
temperature 1 with no stop token, so every method generates exactly P x G x max_new_tokens tokens. Each method runs
in its own process (clean peak memory), after an untimed warm-up call of the same method (kernel compilation).
tokens/s counts generated tokens over the wall time of the one timed call.

Per step: the call's wall time over its forwards (fastgrpo: prefill and decode steps; HF generate: one forward per
new token), and on a CPU the part of it inside the model's forward (its `forward` timed) and the rest, outside:
the sampler's own work (scheduling, batch building, sampling, finish checks, and the call's set-up and output,
spread over its steps). For fastgrpo that rest is split into the sampling math (`sampler.sample`: a few passes over
the [rows, V] logits, device work on a GPU) and the engine's host work (all the rest). fastgrpo decodes all P x G
sequences at once (max_num_seqs = P x G).

`--overhead` isolates that rest: a model whose forward costs almost nothing (1 layer, hidden 16, vocab 64), 16-token
prompts, G = 8, 64 new tokens, at P = 8, 64 and 256 (64, 512 and 2048 sequences), fastgrpo vs HF generate, the
median of 7 calls each (a call takes well under a second: one would be at the mercy of the machine's drift).

    fastgrpo bench sampling                       # CPU: tiny model; GPU: Qwen2.5-1.5B shape, 64 x 8, 256 + 512
    fastgrpo bench sampling --overhead            # CPU: ms per decode step outside the forward, 64 to 2048 sequences
    python -m fastgrpo bench sampling --prompts 16 --max-new-tokens 128
"""

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass

import torch

from fastgrpo import bench as harness

METHODS = ("fastgrpo", "hf_generate", "generate_batch")


@dataclass(frozen=True)
class Workload:
    shape: str
    device: str
    dtype: str
    prompts: int
    group_size: int
    prompt_len: int
    max_new_tokens: int
    repeats: int = 1  # timed calls (the median is kept), after the warm-up call

    def prompt_ids(self, vocab_size: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, vocab_size, (self.prompts, self.prompt_len), generator=g).tolist()


def build_model(workload: Workload):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**harness.SHAPES[workload.shape], max_position_embeddings=32768, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(workload.device):
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.to(harness.DTYPES[workload.dtype]).eval()


def _caller(method: str, model, workload: Workload):
    """A no-argument call that samples the workload with `method`, a function counting its new tokens, and one
    giving the steps of the last call (fastgrpo's own count, which CUDA-graph replays are in; None: count the
    forwards)."""
    from transformers import GenerationConfig

    from fastgrpo.sampling import Engine, SamplingParams

    prompts, group, new = workload.prompt_ids(model.config.vocab_size), workload.group_size, workload.max_new_tokens
    if method == "fastgrpo":
        num_seqs = len(prompts) * group
        engine = Engine(model, max_num_seqs=num_seqs, max_num_batched_tokens=max(4096, num_seqs))
        params = SamplingParams(temperature=1.0, max_new_tokens=new, stop_token_ids=(), seed=0)
        return (lambda: engine.generate(prompts, n=group, params=params),
                lambda out: sum(len(c.token_ids) for completions in out for c in completions),
                lambda: engine.stats.num_steps)
    if method == "hf_generate":
        ids = torch.tensor(prompts, device=workload.device)
        return (lambda: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                       top_k=0, top_p=1.0, max_new_tokens=new, num_return_sequences=group,
                                       eos_token_id=None, pad_token_id=0),
                lambda out: (out.shape[1] - workload.prompt_len) * out.shape[0], None)
    if method == "generate_batch":
        config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                                  eos_token_id=None, pad_token_id=0)
        inputs = [p for p in prompts for _ in range(group)]
        return (lambda: model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False),
                lambda out: sum(len(o.generated_tokens) for o in out.values()), None)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


class ForwardTimer:
    """Counts the forwards (`owner.<name>`: the model's `forward`; for fastgrpo `Engine._forward`, which runs its own
    decode layers or the model's modules) and, on a CPU (where a forward is synchronous), the seconds in them."""

    def __init__(self, owner, name: str, device: torch.device):
        self.calls, self.seconds, self.timed = 0, 0.0, device.type == "cpu"
        forward = getattr(owner, name)

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed_forward)

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


class SampleTimer:
    """Seconds in fastgrpo's sampling math (sampler.sample: [rows, V] passes, device work on a GPU), timed on a CPU."""

    def __init__(self):
        from fastgrpo.sampling import engine

        self.seconds, sample = 0.0, engine.sample

        def timed_sample(*args, **kwargs):
            start = time.perf_counter()
            try:
                return sample(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        engine.sample = timed_sample


def measure(method: str, workload: Workload) -> dict:
    """Run in this process: warm up on a small call, then time one call of the workload."""
    device = torch.device(workload.device)
    model = build_model(workload)
    gc.freeze()  # every method: a full collection would re-scan the libraries' and the model's objects (~0.3 s)
    try:
        return _timed_row(method, workload, model, device)
    finally:
        gc.unfreeze()  # frozen objects are never freed at exit, and triton's bindings would report them as leaks


def _timed_row(method: str, workload: Workload, model, device: torch.device) -> dict:
    from fastgrpo.sampling import Engine

    forwards = ForwardTimer(Engine, "_forward", device) if method == "fastgrpo" else ForwardTimer(model, "forward",
                                                                                                   device)
    sampling = SampleTimer() if method == "fastgrpo" and forwards.timed else None
    small = Workload(**{**asdict(workload), "prompts": 1, "group_size": 2, "max_new_tokens": 8})
    warm, _, _ = _caller(method, model, small)
    warm()
    call, count, steps_of_call = _caller(method, model, workload)
    forwards.reset()
    if sampling:
        sampling.seconds = 0.0
    seconds, peak_bytes, out = harness.time_call(lambda _: call(), device, repeats=workload.repeats, warmup=0)
    tokens = count(out)
    expected = workload.prompts * workload.group_size * workload.max_new_tokens
    assert tokens == expected, f"{method} generated {tokens} tokens, expected {expected}"
    steps = forwards.calls // workload.repeats if steps_of_call is None else steps_of_call()  # per call
    row = {"method": method, **asdict(workload), "sequences": workload.prompts * workload.group_size,
           "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
           "peak_memory_bytes": peak_bytes, "steps": steps, "ms_per_step": seconds / steps * 1e3}
    if forwards.timed:  # the forward's and the sampling math's share: their mean over the timed calls
        row["forward_ms_per_step"] = forwards.seconds / forwards.calls * 1e3
        row["outside_ms_per_step"] = row["ms_per_step"] - row["forward_ms_per_step"]
        row["outside_share"] = row["outside_ms_per_step"] / row["ms_per_step"]
    if sampling:
        row["sample_ms_per_step"] = sampling.seconds / forwards.calls * 1e3
        row["host_ms_per_step"] = row["outside_ms_per_step"] - row["sample_ms_per_step"]
    return row


def run_isolated(method: str, workload: Workload) -> dict:
    row, error = harness.run_in_child("fastgrpo.bench.sampling", method, json.dumps(asdict(workload)))
    return row if error is None else {"method": method, **asdict(workload), "error": error}


def default_workload(device: str, quick: bool, overhead: bool = False) -> dict:
    if overhead:
        return dict(shape="negligible", prompts=[8, 64, 256], group_size=8, prompt_len=16, max_new_tokens=64)
    if quick:
        return dict(shape="tiny", prompts=2, group_size=4, prompt_len=16, max_new_tokens=16)
    if device == "cuda":
        return dict(shape="qwen2.5-1.5b", prompts=64, group_size=8, prompt_len=256, max_new_tokens=512)
    return dict(shape="tiny", prompts=8, group_size=8, prompt_len=64, max_new_tokens=128)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a few seconds on a CPU: tiny model, 2 x 4 x 16 tokens")
    harness.add_device_arguments(parser, shape="model shape (random weights)")
    parser.add_argument("--overhead", action="store_true",
                        help="the sampler's own cost per step: negligible model, P = 8, 64, 256, G = 8, 64 new tokens")
    parser.add_argument("--prompts", type=int, nargs="+", help="number(s) of prompts P (one run per number)")
    parser.add_argument("--group-size", type=int, help="completions per prompt G")
    parser.add_argument("--prompt-len", type=int, help="tokens per prompt")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per completion (no stop token)")
    parser.add_argument("--repeats", type=int, help="timed calls per method, median kept (default 1; --overhead: 7)")
    parser.add_argument("--methods", nargs="+", choices=METHODS,
                        help=f"default: {' '.join(METHODS)} (--overhead: fastgrpo hf_generate)")
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .json and .md results go")


def run(args: argparse.Namespace) -> list[dict]:
    device = harness.start_run(args)
    defaults = default_workload(device, args.quick, args.overhead)
    chosen = dict(shape=args.shape, prompts=args.prompts, group_size=args.group_size, prompt_len=args.prompt_len,
                  max_new_tokens=args.max_new_tokens)
    for name in ("prompts", "group_size", "prompt_len", "max_new_tokens"):
        values = chosen[name] if isinstance(chosen[name], list) else [chosen[name]]
        for value in values:
            if value is not None and value < 1:
                raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    repeats = args.repeats if args.repeats is not None else (7 if args.overhead else 1)
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    settings = {k: v if v is not None else defaults[k] for k, v in chosen.items()}
    settings["repeats"] = repeats
    prompt_counts = settings.pop("prompts")
    methods = args.methods or (["fastgrpo", "hf_generate"] if args.overhead else list(METHODS))
    rows = []
    for prompts in prompt_counts if isinstance(prompt_counts, list) else [prompt_counts]:
        workload = Workload(device=device, dtype=args.dtype or ("bf16" if device == "cuda" else "fp32"),
                            prompts=prompts, **settings)
        runs = [run_isolated(method, workload) for method in methods]
        baseline = next((r for r in runs if r["method"] == "hf_generate" and "error" not in r), None)
        for row in runs:
            if "error" not in row and baseline:
                row["speedup_vs_hf_generate"] = row["tokens_per_s"] / baseline["tokens_per_s"]
                row["memory_vs_hf_generate"] = row["peak_memory_bytes"] / max(baseline["peak_memory_bytes"], 1)
            row["peak_memory_mib"] = row.get("peak_memory_bytes", 0) / 2**20 if "error" not in row else None
        rows += runs
    env = harness.environment(torch.device(device))
    for row in rows:
        row.update(env)
    table = harness.markdown_table(rows, [
        ("method", "method", ""), ("P x G", "sequences", "d"), ("tokens/s", "tokens_per_s", ".1f"),
        ("seconds", "seconds", ".2f"), ("steps", "steps", "d"), ("ms / step", "ms_per_step", ".2f"),
        ("forward ms / step", "forward_ms_per_step", ".2f"), ("outside ms / step", "outside_ms_per_step", ".2f"),
        ("outside share", "outside_share", ".0%"), ("of which sampling math", "sample_ms_per_step", ".2f"),
        ("of which engine host work", "host_ms_per_step", ".2f"), ("peak MiB", "peak_memory_mib", ".1f"),
        ("x HF generate", "speedup_vs_hf_generate", ".2f"), ("memory / HF generate", "memory_vs_hf_generate", ".2f"),
    ])
    first = rows[0]
    title = (f"{first['shape']} ({first['dtype']}) on {env['device']}: P prompts x G={first['group_size']}, prompt "
             f"{first['prompt_len']}, {first['max_new_tokens']} new tokens each, {torch.get_num_threads()} torch "
             f"thread(s), median of {repeats} call(s) after a warm-up call")
    suite = "sampling-overhead" if args.overhead else "sampling"
    harness.publish(args.out_dir, suite, env, rows, title, table)
    return rows


def main(argv: list[str] | None = None) -> None:
    harness.suite_main(argv, __doc__, add_arguments, run,
               lambda method, payload: measure(method, Workload(**json.loads(payload))))


if __name__ == "__main__":
    main()
