"""The engine, the loss and the trainer end to end, each on something small enough to take seconds.

    engine   a tiny Qwen2 built from its config (peaked outputs, so greedy never hinges on the last ulp), prompts of
             ragged lengths across page boundaries: greedy completions equal HF generate's token for token (fp32);
             where the GPU runs them, the fused decoder layers and sampler are on and decode steps replay CUDA
             graphs; sampled completions' logprobs equal the model's own forward over the whole sequence
    loss     fastgrpo.loss.fused_grpo_loss against fastgrpo.reference (full logits) on a real lm_head, three ways:
             loss, d hidden, d weight
    train    `fastgrpo train --max-steps 1` on the built-in recipe, in its own process, as a user runs it
"""

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from fastgrpo.check.tolerance import max_error, no_worse_limit, ulp

NUM_WORDS = 125  # the tiny model's vocabulary: 128 with 3 special tokens
NEW_TOKENS = 24  # per completion (12 under Triton's interpreter, with fewer prompts: it runs each kernel in numpy)
TEMPERATURE = 0.8
FP32_LOGPROB_ATOL = 1e-4
# A bf16 model's logprobs are no closer than its bf16 logits: the paged engine and the plain forward accumulate in
# different orders, so a logit may land one bf16 ulp u off (|logit| ~10 here: u = 0.0625), which moves log p by up to
# u / T through the token's logit and u / T through the logsumexp: the limit is 2 u / T at the largest |logit|.
# (tests/test_sampling_cuda.py measured at most 0.045 on a CPU.)


def tiny_model(device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A 2-layer Qwen2 (4 query heads on 2 KV heads, hidden 64, vocab 128) whose lm_head (std 0.3) peaks its outputs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=NUM_WORDS + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1,
                         pad_token_id=0, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    return model.to(device, dtype)


def prompts(block_size: int, seed: int = 0, short: bool = False) -> list[list[int]]:
    """Ragged lengths at and across page boundaries (`short`: four of them, for Triton's interpreter)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, block_size - 1, block_size + 1, 37] if short else \
        [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 1, 37]
    return [torch.randint(3, NUM_WORDS + 3, (n,), generator=g).tolist() for n in lengths]


def engine_checks(device: torch.device) -> Iterator[tuple[str, str, bool]]:
    """(name, detail, passed) of the engine's checks, each as it finishes."""
    from fastgrpo.sampling import Engine, SamplingParams

    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    attention = "triton" if interpreted else "auto"  # the interpreter runs the kernels a GPU would
    new_tokens = NEW_TOKENS // 2 if interpreted else NEW_TOKENS
    model = tiny_model(device, torch.float32)
    engine = Engine(model, attention=attention)
    batch = prompts(engine.config.block_size, short=interpreted)
    completions = engine.generate(batch, n=2, params=SamplingParams(temperature=0, max_new_tokens=new_tokens,
                                                                    stop_token_ids=()))
    stats = engine.stats
    wrong = []
    for i, (prompt, group) in enumerate(zip(batch, completions, strict=True)):
        want = _hf_greedy(model, prompt, new_tokens)
        wrong += [f"prompt {i} (length {len(prompt)})" for c in group if c.token_ids != want]
    where = f"{engine.backend} attention, {engine.layers} layers, {'fused' if engine.fused_kernels else 'PyTorch'} " \
            f"sampler"
    detail = (f"{len(batch)} prompts x 2, {new_tokens} tokens, {where}" +
              (f", {stats.num_graph_steps} of {stats.num_steps} steps replayed CUDA graphs" if device.type == "cuda"
               else ""))
    yield ("greedy = HF generate (fp32)", detail if not wrong else f"differs at {', '.join(wrong)}; {detail}",
           not wrong)
    if device.type == "cuda" or interpreted:
        yield "fused decode layers and sampler on", where, engine.layers == "fused" and engine.fused_kernels
    if device.type == "cuda":
        yield ("CUDA graphs captured and replayed", f"{stats.num_graph_steps} of {stats.num_steps} steps",
               stats.num_graph_steps > 0)
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        yield _sampled_logprobs(device, dtype, attention, new_tokens, short=interpreted)


def _hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _sampled_logprobs(device: torch.device, dtype: torch.dtype, attention: str, new_tokens: int, short: bool
                      ) -> tuple[str, str, bool]:
    """Temperature 0.8, top-k 20, seeded: each sampled token's logprob against log_softmax of the processed logits of
    one plain forward over prompt + completion."""
    from fastgrpo.sampling import Engine, SamplingParams

    model = tiny_model(device, dtype)
    engine = Engine(model, attention=attention)
    batch = prompts(engine.config.block_size, short=short)
    n = 2 if short else 4
    params = SamplingParams(temperature=TEMPERATURE, top_k=20, max_new_tokens=new_tokens, seed=0, stop_token_ids=())
    worst, largest = 0.0, 0.0
    for prompt, group in zip(batch, engine.generate(batch, n=n, params=params), strict=True):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids], device=device)
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [completion, V]
            largest = max(largest, logits.abs().max().item())
            z = logits / TEMPERATURE
            z = z.masked_fill(z < z.topk(20, dim=-1).values[:, -1:], -math.inf)
            want = z.log_softmax(-1).gather(-1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0]
            worst = max(worst, max_error(torch.tensor(c.logprobs), want.cpu()))
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    limit = FP32_LOGPROB_ATOL if dtype == torch.float32 else \
        2 * ulp(torch.tensor(largest), dtype).item() / TEMPERATURE
    return (f"sampled logprobs = the model's forward ({name})",
            f"{len(batch)} prompts x {n}, temperature {TEMPERATURE:g}, top-k 20: worst |logp error| {worst:.2e} "
            f"(limit {limit:.3g})", worst <= limit)


def loss_check(device: torch.device, quick_head: tuple[int, int], tokens: int, dtype: torch.dtype
               ) -> tuple[str, str, bool]:
    """One fused-loss step (forward and backward, beta 0.04, dapo, 10% padding) against the reference: the loss and
    the gradients of hidden and weight, three ways."""
    from fastgrpo import reference
    from fastgrpo.loss import LossConfig, fused_grpo_loss

    H, V = quick_head
    g = torch.Generator(device).manual_seed(0)
    B = 8
    T = tokens // B
    hidden = torch.randn(B, T, H, generator=g, device=device)
    weight = torch.randn(V, H, generator=g, device=device) * H**-0.5
    ids = torch.randint(0, V, (B, T), generator=g, device=device)
    mask = (torch.arange(T, device=device) < T - T // 10).float().expand(B, T)
    advantages = torch.randn(B, generator=g, device=device)
    with torch.no_grad():  # old and reference logprobs a little off the policy's
        logps = reference.token_logprobs(hidden.to(dtype).double(), weight.to(dtype).double(), ids)[0].float()
    old, ref = (logps + 0.05 * torch.randn(B, T, generator=g, device=device) for _ in range(2))
    config = LossConfig(loss_type="dapo", beta=0.04)

    def run(fn, dt):
        x = hidden.to(dtype).to(dt).detach().clone().requires_grad_()  # (a leaf of its own every run)
        w = weight.to(dtype).to(dt).detach().clone().requires_grad_()
        loss, _ = fn(x, w, ids, mask, advantages, old_logps=old, ref_logps=ref, config=config)
        loss.backward()
        return loss.detach(), x.grad, w.grad

    truth = run(reference.fused_grpo_loss, torch.float64)
    same = run(reference.fused_grpo_loss, dtype)
    fast = run(fused_grpo_loss, dtype)
    parts, ok = [], True
    for name, f, s, t in zip(("loss", "d hidden", "d weight"), fast, same, truth, strict=True):
        error, limit = max_error(f, t), no_worse_limit(s, t, dtype)
        ok &= bool(torch.isfinite(f).all()) and error <= limit
        parts.append(f"{name} {error:.1e} (limit {limit:.1e})")
    dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    return (f"fused loss step = reference ({dt})", f"N {tokens}, H {H}, V {V}: worst error " + ", ".join(parts), ok)


def train_check(device: torch.device) -> tuple[str, str, bool]:
    """`python -m fastgrpo train --max-steps 1` on the built-in recipe in a fresh process: exit 0 and a finite loss."""
    with tempfile.TemporaryDirectory(prefix="fastgrpo-check-") as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "fastgrpo", "train", "--max-steps", "1", "--eval-num-samples", "64",
                   "--output-dir", str(run_dir)]
        env = dict(os.environ)
        if device.type == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # (`--device cpu` on a machine with a GPU)
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        shown = "fastgrpo train --max-steps 1 --eval-num-samples 64"
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return "one `fastgrpo train` step", f"{shown}: exit {done.returncode}: {last}", False
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steps = [m for m in metrics if "loss" in m]
        if not steps or not math.isfinite(steps[-1]["loss"]):
            return "one `fastgrpo train` step", f"{shown}: no finite loss in metrics.jsonl", False
        step = steps[-1]
        return ("one `fastgrpo train` step",
                f"{shown}: loss {step['loss']:.4f}, reward {step.get('reward', float('nan')):.3f}", True)
