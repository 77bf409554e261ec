"""The benchmarks that matter, each a ratio of two times measured in this run (a machine's speed drifts from day to
day; a ratio taken in one run does not):

    loss        fastgrpo's loss step (forward + backward) over the 3-GEMM floor (a bare linear layer's forward and
                backward) and over TRL's fused head + loss; fastgrpo.bench.loss, each method in its own process
    logprobs    the no-grad logprobs pass (old / reference logprobs) over the floor's one GEMM
    decode      one decode step of the engine over its bytes floor: every weight the step reads (the embedding's S
                rows aside) plus the K/V of every sequence, once, at the copy bandwidth measured in this run
    sampling    the engine's tokens/s over HF generate's on the same prompts (fastgrpo.bench.sampling)

Sizes: `--quick` (the default) fits in minutes; `--full` runs the sizes of the benchmarks' issues.
"""

import os
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Plan:
    loss_heads: tuple[str, ...]
    loss_tokens: tuple[int, ...]
    loss_methods: tuple[str, ...]
    loss_repeats: int
    loss_warmup: int
    decode_shape: str
    decode_sequences: int
    decode_prompt: int
    decode_steps: int
    sampling: dict  # fastgrpo.bench.sampling.Workload fields besides device and dtype


PLANS = {
    ("cuda", "quick"): Plan(("qwen2.5-1.5b",), (8192,), ("fastgrpo", "floor", "trl"), 10, 3,
                            "qwen2.5-1.5b", 64, 512, 64,
                            dict(shape="qwen2.5-1.5b", prompts=16, group_size=8, prompt_len=128, max_new_tokens=128)),
    ("cuda", "full"): Plan(("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3-8b"), (2048, 8192, 16384, 32768),
                           ("fastgrpo", "floor", "trl", "torch_lce", "liger"), 10, 3,
                           "qwen2.5-1.5b", 256, 512, 128,
                           dict(shape="qwen2.5-1.5b", prompts=64, group_size=8, prompt_len=256, max_new_tokens=512)),
    ("cpu", "quick"): Plan(("cpu-h128-v16384",), (2048,), ("fastgrpo", "floor", "trl"), 3, 1,
                           "tiny", 8, 64, 32,
                           dict(shape="tiny", prompts=2, group_size=4, prompt_len=16, max_new_tokens=16)),
    ("cpu", "full"): Plan(("cpu-h128-v16384", "cpu-h1024-v32768"), (2048, 8192), ("fastgrpo", "floor", "trl"), 3, 1,
                          "tiny", 32, 64, 32,
                          dict(shape="tiny", prompts=8, group_size=8, prompt_len=64, max_new_tokens=128)),
}  # fmt: skip


def loss_rows(device: torch.device, plan: Plan) -> tuple[list[dict], list[str]]:
    """fastgrpo.bench.loss's rows (full and forward modes, beta 0.04) with fastgrpo's ratios, and the skipped peers."""
    from fastgrpo.bench import loss

    settings = loss.Settings(device=device.type, dtype="bf16" if device.type == "cuda" else "fp32",
                             repeats=plan.loss_repeats, warmup=plan.loss_warmup,
                             threads=torch.get_num_threads() if device.type == "cuda" else 1)
    rows, skipped = [], []
    for method in plan.loss_methods:
        reason = loss.available(method, device.type)
        if reason:
            skipped.append(reason)
            continue
        rows += loss.run_isolated(method, loss.cases_for(method, plan.loss_heads, plan.loss_tokens, (0.04,),
                                                         ("forward", "full")), settings)
    loss.add_ratios(rows)
    return rows, skipped


def copy_bandwidth(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes per second of a large device copy (read + write), the median of 5: the floor's bandwidth."""
    size = (2**30 if device.type == "cuda" else 2**28) // torch.empty((), dtype=dtype).element_size()
    src = torch.ones(size, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(7):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step(device: torch.device, plan: Plan) -> dict:
    """The engine's mean decode step: (time of a call with 1 + 2K new tokens - time of one with 1 + K) / K, so the
    prefill, the first token and the call's set-up (a CUDA graph's capture included) cancel; the least of 5
    interleaved pairs; against its bytes floor at the mean context of those K steps."""
    from fastgrpo.bench.sampling import Workload, build_model
    from fastgrpo.sampling import Engine, SamplingParams

    dtype = "bf16" if device.type == "cuda" else "fp32"
    S, P, K = plan.decode_sequences, plan.decode_prompt, plan.decode_steps
    model = build_model(Workload(shape=plan.decode_shape, device=device.type, dtype=dtype, prompts=S, group_size=1,
                                 prompt_len=P, max_new_tokens=1 + 2 * K))
    prompts = Workload(shape=plan.decode_shape, device=device.type, dtype=dtype, prompts=S, group_size=1,
                       prompt_len=P, max_new_tokens=1).prompt_ids(model.config.vocab_size)
    engine = Engine(model, max_num_seqs=S, max_num_batched_tokens=max(4096, S))

    def call(new_tokens: int) -> float:
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=(), seed=0)
        start = time.perf_counter()
        engine.generate(prompts, n=1, params=params)  # (returns host lists: the device is done)
        return time.perf_counter() - start

    threads = torch.get_num_threads()
    if device.type == "cpu":  # (OpenMP's spin-waits on a CPU shared with other work make 2-thread times erratic)
        torch.set_num_threads(1)
    try:
        call(1 + 2 * K)  # compile, capture
        pairs = [(call(1 + K), call(1 + 2 * K)) for _ in range(5)]  # interleaved, so drift slows both alike
    finally:
        torch.set_num_threads(threads)
    # The least of each: other work on the machine only ever adds time.
    short, long = min(p[0] for p in pairs), min(p[1] for p in pairs)
    step = (long - short) / K
    config = model.config
    itemsize = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * itemsize
    if not config.tie_word_embeddings:  # the input embedding is read only at the S rows of the step's tokens
        weights -= model.get_input_embeddings().weight.numel() * itemsize
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    context = P + 1.5 * K  # the mean context of the K steps the difference times
    kv = 2 * config.num_hidden_layers * S * context * config.num_key_value_heads * head_dim * itemsize
    bandwidth = copy_bandwidth(device, next(model.parameters()).dtype)
    floor = (weights + kv) / bandwidth
    return {"shape": plan.decode_shape, "dtype": dtype, "sequences": S, "context": context, "step_ms": step * 1e3,
            "weight_bytes": weights, "kv_bytes": kv, "bandwidth_gbs": bandwidth / 1e9, "floor_ms": floor * 1e3,
            "vs_floor": step / floor, "layers": engine.layers, "attention": engine.backend,
            "short_call_s": short, "long_call_s": long}


def sampling_rows(device: torch.device, plan: Plan) -> list[dict]:
    """The engine and HF generate on the same workload, each in its own process (fastgrpo.bench.sampling)."""
    from fastgrpo.bench import sampling

    workload = sampling.Workload(device=device.type, dtype="bf16" if device.type == "cuda" else "fp32",
                                 **plan.sampling)
    saved = os.environ.get("OMP_NUM_THREADS")
    if device.type == "cpu":  # one thread in each child, as the loss timings and the decode step take on a CPU
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        rows = [sampling.run_isolated(method, workload) for method in ("fastgrpo", "hf_generate")]
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    if all("error" not in row for row in rows):
        rows[0]["speedup_vs_hf_generate"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    return rows
