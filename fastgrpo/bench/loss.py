"""GRPO loss kernels side by side: fastgrpo vs the reference, TRL 1.16, PyTorch, Liger and the bare matmuls (the floor).

Workload per case: an lm_head W [V, H] (~N(0, 1/H)), hidden states [B, T, H] ~ N(0, 1) with B * T = N tokens
(B = 8 when 8 divides N), random target ids, the last 10% of every completion masked (padding), advantages [B],
dapo loss, and, at beta != 0, reference logprobs. All methods get the same tensors (seeded on the device).

Methods (each in its own process, so no method sees another's compiled kernels or cached memory):
  fastgrpo   fastgrpo.loss.fused_grpo_loss on the default path: the gradient is computed in the forward (3 GEMMs
             per chunk), the backward only scales it; forward mode: fastgrpo.loss.token_logprobs of the valid tokens
  reference  fastgrpo.reference (full [N, V] logits), the yardstick every row's loss is compared with
  trl        TRL 1.16's own path: `trl.kernels.ChunkedLogProbFunction` called as `trl.trainer.utils.add_fused_lm_head`
             calls it in the GRPOTrainer (valid tokens only, TRL's chunk size, outputs log_probs + entropy), then
             TRL's loss math, which is `fastgrpo.reference.grpo_loss` (a bitwise copy of GRPOTrainer._compute_loss's
             math, tested against TRL in tests/; `_compute_loss` itself needs a model and a trainer)
  torch_lce  PyTorch's own chunked head: `F.linear_cross_entropy(x, W, ids, reduction="none",
             options=LinearCrossEntropyOptions())` = -logp of the valid tokens (its backward recomputes the chunks),
             then the same loss math; it computes no entropy
  liger      liger_kernel's LigerFusedLinearGRPOLoss (when importable); it computes the gradients inside its
             forward, so its backward mode is a copy-out and its forward mode runs on detached inputs
  floor      the bare GEMMs of an exact method, no softmax, each in the fastest form known on the device: forward
             z = X W^T; backward dX = z W and dW = z^T X (z stands in for dz: same shape, same cost): 3 GEMMs, a
             linear layer's forward + backward. On a GPU one cuBLAS GEMM each. On a CPU z is formed in vocab blocks
             of ~2 MiB (fastgrpo.chunked.vocab_blocks: one GEMM writing all of z re-reads and re-writes it from
             memory once per block of H, ~15-20% slower), and the forward mode keeps only one block at a time
  floor4     the same with the backward's recompute of z (4 GEMMs: the floor of a method that recomputes)
  linear     a CPU only: PyTorch's bare linear layer as it runs, z = X W^T in one GEMM (+ dX, dW in full mode),
             the floor before vocab blocks (on a GPU it is the floor)

Modes: forward (no-grad logprobs, the old/ref pass), backward (the backward of the loss alone, after an untimed
forward), full (forward + backward). Gradients are taken w.r.t. both hidden and the weight.

FLOPs counted (the GEMMs a method runs, 2 * rows * H * V each; Nv = valid tokens = 0.9 N, N = all tokens):
  fastgrpo, floor        forward 2 Nv H V;  backward 0 (fastgrpo; floor 4 Nv H V);  full 6 Nv H V
  trl, torch_lce, floor4   forward 2 Nv H V;  backward 6 Nv H V (recompute, dX, dW);  full 8 Nv H V
  reference              forward 2 Nv H V;  backward 4 N H V (dX, dW; logits stored); full 6 N H V
  liger                  forward 4 N H V (it forms dX too);  backward 0 (done in forward);  full 8 N H V
The softmax, exp and loss math are not counted. TFLOP/s = FLOPs / median time.

Timing: one function (`time_call`): `--warmup` untimed runs, then the median of `--repeats` runs; CUDA events on a
GPU, perf_counter on a CPU. Peak memory is the growth above the level at the start of a run (inputs, and for the
backward mode the forward's saved state, excluded), the maximum over the timed runs: the CUDA allocator peak, or on a
CPU the resident-set peak, in a child whose glibc returns freed tensors to the system
(MALLOC_MMAP_THRESHOLD_), so one mode's freed pages do not hide the next one's growth.

    fastgrpo bench loss --quick                               # CPU, well under 2 minutes
    python -m fastgrpo.bench.loss --heads qwen2.5-7b --tokens 8192 32768 --modes full   # GPU: bf16, beta 0 and 0.04
"""

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import fastgrpo
from fastgrpo import bench as harness

HEADS = {  # name: (hidden size H, vocab size V)
    "qwen2.5-0.5b": (896, 151936),
    "qwen2.5-1.5b": (1536, 151936),
    "qwen2.5-7b": (3584, 152064),
    "llama-3-8b": (4096, 128256),
    "cpu-h64-v4096": (64, 4096),
    "cpu-h128-v16384": (128, 16384),
    "cpu-h1024-v32768": (1024, 32768),  # GEMM-dominated on a CPU, as a GPU head is: the proxy of the issue-13 targets
}
GPU_HEADS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3-8b")
GPU_TOKENS = (2048, 8192, 16384, 32768)
QUICK = dict(heads=("cpu-h64-v4096", "cpu-h128-v16384"), tokens=(256, 2048), betas=(0.04,), repeats=3, warmup=1)
METHODS = ("fastgrpo", "reference", "trl", "torch_lce", "liger", "floor", "floor4", "linear")
MODES = ("forward", "backward", "full")
MASKED_FRACTION = 0.1
# GEMMs of [rows, H] x [H, V] per method and mode, rows being the valid tokens Nv ("valid") or all N ("all")
_RECOMPUTE = {"forward": (1, "valid"), "backward": (3, "valid"), "full": (4, "valid")}
GEMMS = {
    "fastgrpo": {"forward": (1, "valid"), "backward": (0, "valid"), "full": (3, "valid")},
    "floor": {"forward": (1, "valid"), "backward": (2, "valid"), "full": (3, "valid")},
    "linear": {"forward": (1, "valid"), "backward": (2, "valid"), "full": (3, "valid")},
    "trl": _RECOMPUTE,
    "torch_lce": _RECOMPUTE,
    "floor4": _RECOMPUTE,
    "reference": {"forward": (1, "valid"), "backward": (2, "all"), "full": (3, "all")},
    "liger": {"forward": (2, "all"), "backward": (0, "all"), "full": (4, "all")},
}
FLOORS = ("floor", "floor4", "linear")
PEERS = ("floor", "floor4", "linear", "trl", "torch_lce", "liger", "reference")


@dataclass(frozen=True)
class Case:
    head: str
    tokens: int
    beta: float | None  # None for the floor, which has no loss
    mode: str


@dataclass(frozen=True)
class Settings:
    device: str
    dtype: str
    repeats: int
    warmup: int
    threads: int


@dataclass
class Inputs:
    hidden: torch.Tensor  # [B, T, H], requires grad
    weight: torch.Tensor  # [V, H], requires grad
    ids: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T] fp32, 0 on the last 10% of every row
    advantages: torch.Tensor  # [B] fp32
    ref_logps: torch.Tensor | None  # [B, T] fp32 at beta != 0
    x_valid: torch.Tensor  # [Nv, H], the valid tokens' hidden states (forward mode), no grad
    ids_valid: torch.Tensor  # [Nv]


def make_inputs(case: Case, settings: Settings) -> Inputs:
    """The case's tensors, identical in every process (seeded generator on the device)."""
    from fastgrpo.loss import token_logprobs

    device, dtype = torch.device(settings.device), harness.DTYPES[settings.dtype]
    H, V = HEADS[case.head]
    N = case.tokens
    B = 8 if N % 8 == 0 else 1
    T = N // B
    g = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g, device=device).to(dtype)
    weight = (torch.randn(V, H, generator=g, device=device) * H**-0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g, device=device)
    valid = torch.arange(T, device=device) < T - round(MASKED_FRACTION * T)  # [T]
    mask = valid.float().expand(B, T).contiguous()
    advantages = torch.randn(B, generator=g, device=device)
    ref_logps = None
    if case.beta:
        with torch.no_grad():
            ref_logps = token_logprobs(hidden, weight, ids)[0]
            ref_logps += 0.05 * torch.randn(B, T, generator=g, device=device)  # a reference a little off-policy
    flat_valid = mask.reshape(-1).bool()
    return Inputs(hidden.requires_grad_(), weight.requires_grad_(), ids, mask, advantages, ref_logps,
                  hidden.detach().reshape(-1, H)[flat_valid], ids.reshape(-1)[flat_valid])


def flop_count(method: str, mode: str, case: Case) -> int:
    """The FLOPs of the GEMMs the method runs (see the module docstring): 2 * rows * H * V per GEMM."""
    gemms, rows = GEMMS[method][mode]
    H, V = HEADS[case.head]
    return gemms * 2 * (case.tokens if rows == "all" else valid_tokens(case.tokens)) * H * V


def valid_tokens(tokens: int) -> int:
    B = 8 if tokens % 8 == 0 else 1
    T = tokens // B
    return B * (T - round(MASKED_FRACTION * T))


# -- the methods ----------------------------------------------------------------------------------------------------


def _config(beta: float):
    from fastgrpo.loss import LossConfig

    return LossConfig(loss_type="dapo", beta=beta)


def _trl_logprobs(x, weight, ids, outputs):
    """TRL 1.16's fused LM head, as `add_fused_lm_head` calls it on the valid tokens: (logp [Nv], entropy or None)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    logp, entropy, *_ = ChunkedLogProbFunction.apply(x, weight, None, ids, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None,
                                                     1.0, outputs)
    return logp, entropy


def _torch_logprobs(x, weight, ids):
    """PyTorch's chunked linear cross-entropy per token: logp [Nv] = -CE (no entropy)."""
    import torch.nn.functional as F
    from torch.nn import LinearCrossEntropyOptions

    return -F.linear_cross_entropy(x, weight, ids, reduction="none", options=LinearCrossEntropyOptions())


def loss_fn(method: str, beta: float, device: torch.device):
    """inp -> the method's scalar loss (differentiable w.r.t. inp.hidden and inp.weight)."""
    from fastgrpo import reference
    from fastgrpo.loss import fused_grpo_loss

    config = _config(beta)
    if method == "fastgrpo":
        return lambda inp: fused_grpo_loss(inp.hidden, inp.weight, inp.ids, inp.mask, inp.advantages,
                                           ref_logps=inp.ref_logps, config=config)[0]
    if method == "reference":
        return lambda inp: reference.fused_grpo_loss(inp.hidden, inp.weight, inp.ids, inp.mask, inp.advantages,
                                                     ref_logps=inp.ref_logps, config=config)[0]
    if method == "trl":
        def trl_loss(inp):
            valid = inp.mask.bool()  # [B, T]
            logp, entropy = _trl_logprobs(inp.hidden[valid], inp.weight, inp.ids[valid], ("entropy",))
            logps = logp.new_zeros(valid.shape).masked_scatter(valid, logp)  # [B, T], as add_fused_lm_head does
            entropies = entropy.detach().new_zeros(valid.shape).masked_scatter(valid, entropy.detach())
            return reference.grpo_loss(logps, inp.mask, inp.advantages, ref_logps=inp.ref_logps, config=config,
                                       entropies=entropies)[0]
        return trl_loss
    if method == "torch_lce":
        def torch_loss(inp):
            valid = inp.mask.bool()  # [B, T]
            logp = _torch_logprobs(inp.hidden[valid], inp.weight, inp.ids[valid])  # [Nv]
            logps = logp.new_zeros(valid.shape).masked_scatter(valid, logp)
            return reference.grpo_loss(logps, inp.mask, inp.advantages, ref_logps=inp.ref_logps, config=config)[0]
        return torch_loss
    if method == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        module = LigerFusedLinearGRPOLoss(
            beta=beta, compiled=device.type == "cuda", use_ref_model=beta != 0.0, epsilon_low=config.epsilon_low,
            epsilon_high=config.epsilon_high, loss_type=config.loss_type,
            max_completion_length=config.max_completion_length, temperature=config.temperature,
            use_bias_correction_kl=config.use_bias_correction_kl,
        )

        def liger_loss(inp, hidden=None, weight=None):
            out = module(inp.hidden if hidden is None else hidden, inp.weight if weight is None else weight,
                         inp.ids, inp.mask, inp.advantages, ref_per_token_logps=inp.ref_logps)
            return out[0] if isinstance(out, tuple) else out
        return liger_loss
    raise ValueError(f"method must be one of {METHODS[:-1]} here, got {method!r}")


def forward_fn(method: str, beta: float, device: torch.device):
    """inp -> what the method's no-grad pass returns (logprobs [Nv]; liger: its loss, having no logprob API)."""
    from fastgrpo import reference
    from fastgrpo.loss import token_logprobs

    if method == "fastgrpo":
        return lambda inp: token_logprobs(inp.x_valid, inp.weight.detach(), inp.ids_valid)[0]
    if method == "torch_lce":
        return lambda inp: _torch_logprobs(inp.x_valid, inp.weight.detach(), inp.ids_valid)
    if method == "reference":
        return lambda inp: reference.token_logprobs(inp.x_valid, inp.weight.detach(), inp.ids_valid)[0]
    if method == "trl":
        return lambda inp: _trl_logprobs(inp.x_valid, inp.weight.detach(), inp.ids_valid, ("log_probs",))[0]
    if method == "liger":
        liger = loss_fn("liger", beta, device)
        return lambda inp: liger(inp, inp.hidden.detach(), inp.weight.detach())
    if method in ("floor", "floor4") and device.type == "cpu":
        return _blocked_gemm
    return lambda inp: inp.x_valid @ inp.weight.detach().T  # floor on a GPU, linear


def _blocked_gemm(inp: Inputs) -> torch.Tensor:
    """The forward floor on a CPU: X W^T one vocab block at a time into one reused buffer; returns the last block."""
    from fastgrpo.chunked import vocab_blocks

    x, w = inp.x_valid, inp.weight.detach()
    blocks = vocab_blocks(x.shape[0], w.shape[0])
    buffer = x.new_empty(x.shape[0], blocks[0].stop - blocks[0].start)
    for cols in blocks:
        z = torch.mm(x, w[cols].T, out=buffer[:, : cols.stop - cols.start])
    return z


def floor_logits(inp: Inputs, method: str = "floor") -> torch.Tensor:
    """z = X W^T [Nv, V], materialized: the floors' in vocab blocks on a CPU (fastgrpo.chunked.chunk_logits, as
    fastgrpo's chunks are formed), linear's (and a GPU's) in one GEMM."""
    from fastgrpo.chunked import chunk_logits

    x, w = inp.x_valid, inp.weight.detach()
    if method == "linear" or x.is_cuda:
        return x @ w.T
    return chunk_logits(x, w, None, 1.0, out=x.new_empty(x.shape[0], w.shape[0]))


def floor_backward(inp: Inputs, z: torch.Tensor | None = None, method: str = "floor") -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """A floor's backward, the GEMMs of an exact method with no softmax: dX = z W [Nv, H] and dW = z^T X [V, H] (z
    stands in for dz: same shape, same cost), from the forward's z (floor, linear) or, with z None, recomputing it
    (floor4); returns (dX, dW). After `floor_logits` it makes a floor's full mode."""
    x, w = inp.x_valid, inp.weight.detach()
    z = floor_logits(inp, method) if z is None else z
    return z @ w, z.T @ x


def measure_case(method: str, case: Case, settings: Settings) -> dict:
    """One row: the method's time, peak memory and outputs on the case."""
    device = torch.device(settings.device)
    inp = make_inputs(case, settings)
    timing = dict(repeats=settings.repeats, warmup=settings.warmup)
    row = {}

    def clear_grads():
        inp.hidden.grad = inp.weight.grad = None

    if case.mode == "forward":
        with torch.no_grad():
            seconds, peak, out = harness.time_call(lambda _: forward_fn(method, case.beta or 0.0, device)(inp), device,
                                           **timing)
        if method == "liger":
            row["loss"] = out.item()
        elif method not in FLOORS:
            row["mean_logp"] = out.double().mean().item()
    elif method in FLOORS:
        forward = lambda: floor_logits(inp, method)
        stored = method != "floor4"  # the 3-GEMM floors keep the forward's z; floor4 recomputes it
        if case.mode == "backward":
            z = forward() if stored else None  # untimed
            seconds, peak, _ = harness.time_call(lambda _: floor_backward(inp, z, method), device, **timing)
        else:  # forward, then dX and dW from its z; floor4: forward, then recompute z, dX and dW
            step = lambda _: floor_backward(inp, forward(), method) if stored else (forward(), floor_backward(inp))
            seconds, peak, _ = harness.time_call(step, device, **timing)
    else:
        loss = loss_fn(method, case.beta, device)

        def forward_then_clear():
            clear_grads()
            return loss(inp)

        def backward(value):
            value.backward()
            return value.detach()

        if case.mode == "backward":
            seconds, peak, out = harness.time_call(backward, device, setup=forward_then_clear, **timing)
        else:
            seconds, peak, out = harness.time_call(lambda _: backward(loss(inp)), device, setup=clear_grads, **timing)
            row["grad_hidden_norm"] = inp.hidden.grad.double().norm().item()
            row["grad_weight_norm"] = inp.weight.grad.double().norm().item()
        row["loss"] = out.item()
    flops = flop_count(method, case.mode, case)
    return {"method": method, **asdict(case), "hidden_size": HEADS[case.head][0], "vocab_size": HEADS[case.head][1],
            "valid_tokens": valid_tokens(case.tokens), "dtype": settings.dtype, "seconds": seconds,
            "peak_bytes": peak, "flops": flops, "tflops": flops / seconds / 1e12 if flops else None, **row}


def measure_all(method: str, cases: list[Case], settings: Settings) -> list[dict]:
    """Every case for one method, in this process; a failing case (out of memory) becomes a row with its error."""
    torch.set_num_threads(settings.threads)
    if method == "fastgrpo":
        os.environ["FASTGRPO_BACKEND"] = "chunked"
    rows = []
    for case in cases:
        try:
            row = measure_case(method, case, settings)
        except Exception as error:  # noqa: BLE001 (torch.OutOfMemoryError and friends: report, go on)
            row = {"method": method, **asdict(case), "dtype": settings.dtype,
                   "error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        if settings.device == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def run_isolated(method: str, cases: list[Case], settings: Settings) -> list[dict]:
    """measure_all in a child process (clean peaks, caches and compiled kernels per method)."""
    payload = json.dumps({"cases": [asdict(c) for c in cases], "settings": asdict(settings)})
    env = dict(os.environ)
    package_root = str(Path(fastgrpo.__file__).resolve().parents[1])  # the child imports this very fastgrpo
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_root, env.get("PYTHONPATH"))))
    if settings.device == "cpu":
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # freed tensors leave the resident set
        env.setdefault("OMP_NUM_THREADS", str(settings.threads))
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waits on a CPU shared with other work
    rows, error = harness.run_in_child("fastgrpo.bench.loss", method, payload, env)
    if error is not None:
        return [{"method": method, **asdict(c), "dtype": settings.dtype, "error": error} for c in cases]
    return rows


# -- the suite ------------------------------------------------------------------------------------------------------


def available(method: str, device: str) -> str | None:
    """None when the method can run here, else why not."""
    import importlib.util

    package = {"trl": "trl", "liger": "liger_kernel"}.get(method)
    if package and importlib.util.find_spec(package) is None:
        return f"{method}: skipped, {package} is not installed"
    if method == "linear" and device == "cuda":
        return "linear: skipped, on CUDA the floor is the bare linear layer (one cuBLAS GEMM)"
    if method == "torch_lce" and not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch_lce: skipped, torch {torch.__version__} has no chunked F.linear_cross_entropy"
    return None


def _key(row: dict, method: str | None = None) -> tuple:
    return (row["head"], row["tokens"], row["mode"], None if method in FLOORS else row["beta"])


def add_ratios(rows: list[dict]) -> None:
    """On fastgrpo rows: time (and peak memory) over each peer's on the same case; on all rows: |loss - reference|."""
    ok = {(row["method"], *_key(row, row["method"])): row for row in rows if "error" not in row}
    for row in rows:
        if "error" in row:
            continue
        ref = ok.get(("reference", *_key(row)))
        for value in ("loss", "mean_logp"):
            if ref is not None and row.get(value) is not None and ref.get(value) is not None:
                row[f"{value}_err_vs_reference"] = abs(row[value] - ref[value])
        if row["method"] != "fastgrpo":
            continue
        for peer in PEERS:
            other = ok.get((peer, *_key(row, peer)))
            if other is not None and other["seconds"] > 0:
                row[f"time_vs_{peer}"] = row["seconds"] / other["seconds"]
                row[f"memory_vs_{peer}"] = row["peak_bytes"] / max(other["peak_bytes"], 1)


def plot(rows: list[dict], path) -> None:
    """Grid: one row of panels per (head, beta), for each mode a time panel and a peak-memory panel vs tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [row for row in rows if "error" not in row]
    panels = sorted({(row["head"], row["beta"]) for row in ok if row["beta"] is not None})
    modes = [mode for mode in MODES if any(row["mode"] == mode for row in ok)]
    if not panels or not modes:
        return
    fig, axes = plt.subplots(len(panels), 2 * len(modes), figsize=(4 * 2 * len(modes), 3.2 * len(panels)),
                             squeeze=False)
    for i, (head, beta) in enumerate(panels):
        for j, mode in enumerate(modes):
            for k, (key, scale, unit) in enumerate((("seconds", 1e3, "time (ms)"),
                                                    ("peak_bytes", 2**-20, "peak memory (MiB)"))):
                ax = axes[i][2 * j + k]
                for method in METHODS:
                    points = sorted((row["tokens"], row[key] * scale) for row in ok if row["method"] == method
                                    and row["head"] == head and row["mode"] == mode
                                    and row["beta"] in ((None, beta) if method in FLOORS else (beta,)))
                    if points:
                        ax.plot(*zip(*points, strict=True), marker="o", label=method)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")  # non-positive peaks (a CPU run that grew nothing) are left out
                ax.set_title(f"{head} beta={beta:g} {mode}", fontsize=9)
                ax.set_xlabel("tokens N")
                ax.set_ylabel(unit)
                ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cases_for(method: str, heads, tokens, betas, modes) -> list[Case]:
    betas = (None,) if method in FLOORS else betas  # a floor has no loss: one run serves every beta
    return [Case(head, n, beta, mode) for head in heads for n in tokens for beta in betas for mode in modes]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run, well under 2 minutes: heads " + ", ".join(QUICK["heads"]) +
                             f", N {QUICK['tokens']}, fp32, beta {QUICK['betas']}, 1 thread")
    harness.add_device_arguments(parser)
    parser.add_argument("--heads", nargs="+", choices=tuple(HEADS), help=f"lm heads (default: {', '.join(GPU_HEADS)})")
    parser.add_argument("--tokens", nargs="+", type=int, help=f"tokens N per case (default: {GPU_TOKENS})")
    parser.add_argument("--beta", nargs="+", type=float, help="KL coefficients (default: 0 0.04)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--repeats", type=int, help="timed runs per case, median reported (default: 10; quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed runs first (default: 3; quick 1)")
    parser.add_argument("--threads", type=int,
                        help="torch threads (default: torch's; --quick: 1, since OpenMP spin-waits on a CPU shared "
                             "with other work can make 2-thread runs many times slower)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every method's process this many times, interleaved (A B C, A B C, ...), and keep "
                             "each case's median round: ratios that hold on a machine whose speed drifts")
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .json, .md and .png go")


def run(args: argparse.Namespace) -> list[dict]:
    device = harness.start_run(args)
    quick = args.quick
    heads = args.heads or (QUICK["heads"] if quick else GPU_HEADS)
    tokens = args.tokens or (QUICK["tokens"] if quick else GPU_TOKENS)
    betas = args.beta or (QUICK["betas"] if quick else (0.0, 0.04))
    repeats = args.repeats if args.repeats is not None else (QUICK["repeats"] if quick else 10)
    warmup = args.warmup if args.warmup is not None else (QUICK["warmup"] if quick else 3)
    threads = args.threads if args.threads is not None else (1 if quick else torch.get_num_threads())
    for n in tokens:
        if n < 10:
            raise SystemExit(f"--tokens must be >= 10 (10% of them are masked), got {n}")
    for beta in betas:
        if not (math.isfinite(beta) and beta >= 0):
            raise SystemExit(f"--beta must be a finite number >= 0, got {beta}")
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {warmup}")
    if threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {threads}")
    settings = Settings(device=device, dtype=args.dtype or ("bf16" if device == "cuda" else "fp32"),
                        repeats=repeats, warmup=warmup, threads=threads)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    notes, methods = [], []
    for method in args.methods:
        reason = available(method, device)
        if reason:
            notes.append(reason)
            print(reason)
        else:
            methods.append(method)
    # Rounds interleave the methods' processes (A B C, A B C, ...), so a machine whose speed drifts during the run
    # slows every method alike; each row is the round with the median time.
    cases = {method: cases_for(method, heads, tokens, betas, args.modes) for method in methods}
    runs = {method: [] for method in methods}  # per method, one list of rows per round
    for _ in range(args.rounds):
        for method in methods:
            runs[method].append(run_isolated(method, cases[method], settings))
    rows = [_median_round([run[i] for run in runs[method]]) for method in methods for i in range(len(cases[method]))]
    add_ratios(rows)
    env = harness.environment(torch.device(device))
    for row in rows:
        row.update(env)
        if "error" not in row:
            row["ms"] = row["seconds"] * 1e3
            row["peak_mib"] = row["peak_bytes"] / 2**20
        else:
            notes.append(f"{row['method']} {row['head']} N={row['tokens']} beta={row['beta']} {row['mode']}: "
                         f"{row['error']}")
    order = {method: i for i, method in enumerate(METHODS)}
    rows.sort(key=lambda r: (r["head"], r["tokens"], MODES.index(r["mode"]), order[r["method"]],
                             -1 if r["beta"] is None else r["beta"]))
    table = harness.markdown_table(rows, [
        ("head", "head", ""), ("N", "tokens", "d"), ("mode", "mode", ""), ("method", "method", ""),
        ("beta", "beta", "g"), ("ms", "ms", ".3f"), ("TFLOP/s", "tflops", ".3f"), ("peak MiB", "peak_mib", ".1f"),
        ("/ floor", "time_vs_floor", ".2f"), ("/ floor4", "time_vs_floor4", ".2f"),
        ("/ linear", "time_vs_linear", ".2f"), ("/ TRL", "time_vs_trl", ".2f"),
        ("/ torch", "time_vs_torch_lce", ".2f"), ("/ Liger", "time_vs_liger", ".2f"),
        ("/ reference", "time_vs_reference", ".2f"), ("mem / TRL", "memory_vs_trl", ".2f"),
        ("loss", "loss", ".6f"), ("mean logp", "mean_logp", ".5f"),
    ])
    title = (f"GRPO loss (dapo, {MASKED_FRACTION:.0%} masked) on {env['device']}, {settings.dtype}: median of "
             f"{repeats} after {warmup} warm-up, {threads} torch thread(s), median of {args.rounds} interleaved "
             f"round(s). Ratios are fastgrpo's time over the "
             f"peer's (< 1: fastgrpo faster); peak memory is above the inputs.")
    print(title)
    print(table)
    text = f"{title}\n\n{table}" + ("\n\n" + "\n".join(f"- {note}" for note in notes) if notes else "")
    json_path, md_path = harness.write_results(args.out_dir, "loss", env, rows, text)
    harness.exit_if_all_failed(rows, json_path)
    png_path = md_path.with_suffix(".png")
    plot(rows, png_path)
    print(f"wrote {json_path}, {md_path} and {png_path}")
    return rows


def _median_round(rows: list[dict]) -> dict:
    """One case's rows from every round -> the row of the median time (an error row if any round failed)."""
    failed = [row for row in rows if "error" in row]
    if failed:
        return failed[0]
    ordered = sorted(rows, key=lambda row: row["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds": len(rows)}


def _measure_payload(method: str, payload: str) -> list[dict]:
    values = json.loads(payload)
    return measure_all(method, [Case(**case) for case in values["cases"]], Settings(**values["settings"]))


def main(argv: list[str] | None = None) -> None:
    harness.suite_main(argv, __doc__, add_arguments, run, _measure_payload)


if __name__ == "__main__":
    main()
