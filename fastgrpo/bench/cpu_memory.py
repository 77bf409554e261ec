"""Peak host memory above the inputs of one forward+backward of the loss, chunked path vs the reference.

Each method runs in a fresh process; the peak resident set is reset after the inputs are built (Linux
`/proc/self/clear_refs`), so the reported figure is what the loss itself adds.

    fastgrpo bench cpu-memory --tokens 8192 --hidden 256 --vocab 65536
"""

import argparse
import json
import os

import torch

from fastgrpo.bench import run_in_child, suite_main
from fastgrpo.memory import PeakMemory

METHODS = ("chunked", "reference")


def measure(method: str, tokens: int, hidden: int, vocab: int) -> dict:
    """Run in this process: peak RSS growth (bytes) over one fused_grpo_loss forward + backward."""
    from fastgrpo.loss import LossConfig, fused_grpo_loss

    os.environ["FASTGRPO_BACKEND"] = method
    torch.manual_seed(0)
    B = max(1, tokens // 512)
    T = tokens // B
    h = (torch.randn(B, T, hidden) / hidden**0.5).requires_grad_()  # [B, T, H]
    w = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_()  # [V, H]
    ids = torch.randint(0, vocab, (B, T))
    mask = torch.ones(B, T)
    adv = torch.randn(B)
    # One small call first: the first call through a torch.library op imports torch._dynamo (~143 MiB resident, which
    # any transformers forward imports anyway); the figure is the loss's memory, not the process's imports.
    fused_grpo_loss(h[:1, :8], w, ids[:1, :8], mask[:1, :8], adv[:1], config=LossConfig(beta=0.0))[0].backward()
    h.grad = w.grad = None
    with PeakMemory(torch.device("cpu")).measure() as memory:
        loss, _ = fused_grpo_loss(h, w, ids, mask, adv, config=LossConfig(beta=0.0))
        loss.backward()
    return {"method": method, "tokens": B * T, "hidden": hidden, "vocab": vocab,
            "peak_extra_bytes": memory.peak_bytes, "logits_bytes": B * T * vocab * 4}


def run_isolated(method: str, tokens: int, hidden: int, vocab: int) -> dict:
    """`measure` in a fresh process (2 OpenMP threads), so that no method sees the other's freed pages."""
    payload = json.dumps({"tokens": tokens, "hidden": hidden, "vocab": vocab})
    row, error = run_in_child("fastgrpo.bench.cpu_memory", method, payload, {**os.environ, "OMP_NUM_THREADS": "2"})
    if error is not None:
        raise RuntimeError(f"{method}: {error}")
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=65536)


def run(args: argparse.Namespace) -> list[dict]:
    rows = [run_isolated(m, args.tokens, args.hidden, args.vocab) for m in METHODS]
    print(f"N={rows[0]['tokens']} H={args.hidden} V={args.vocab} fp32, logits alone: "
          f"{rows[0]['logits_bytes'] / 2**20:.0f} MiB")
    for r in rows:
        print(f"  {r['method']:<10} peak above inputs: {r['peak_extra_bytes'] / 2**20:8.1f} MiB")
    print(f"  ratio chunked/reference: {rows[0]['peak_extra_bytes'] / rows[1]['peak_extra_bytes']:.3f}")
    return rows


def _measure_payload(method: str, payload: str) -> dict:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return measure(method, **json.loads(payload))


def main(argv: list[str] | None = None) -> None:
    suite_main(argv, __doc__, add_arguments, run, _measure_payload)


if __name__ == "__main__":
    main()
