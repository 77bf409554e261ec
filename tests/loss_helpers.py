"""Shared helpers of the loss tests: one fused_grpo_loss call with its gradients on a chosen backend (`run`), and a
fast path checked against the float64 reference and the same-dtype reference (`check`); and for the training tests'
gradients, a comparison against the float64 truth (`assert_close_gradients`, `largest_difference`) and ragged rows
padded into one tensor (`padded`)."""

import torch
import torch.nn.functional as F
from helpers import assert_close, assert_no_worse, leaf

from fastgrpo.loss import fused_grpo_loss

# fp32 training against the float64 truth: the same sums in another order; relative to each tensor's largest entry.
GRAD_TOLERANCE = 1e-5


def run(monkeypatch, backend, dtype, p, config, on_policy=False, num_items=None):
    monkeypatch.setenv("FASTGRPO_BACKEND", backend)
    x, w, b = leaf(p["hidden"], dtype), leaf(p["weight"], dtype), leaf(p["bias"], dtype)
    loss, metrics = fused_grpo_loss(
        x, w, p["ids"], p["mask"], p["adv"], bias=b, old_logps=None if on_policy else p["old"],
        ref_logps=p["ref"] if config.beta else None, config=config, num_items_in_batch=num_items,
    )
    loss.backward()
    return {"loss": loss.detach(), "d_hidden": x.grad, "d_weight": w.grad, "d_bias": b.grad}, metrics


def check(monkeypatch, backend, dtype, p, config, **kw):
    rounded = {k: (v.to(dtype).double() if k in ("hidden", "weight", "bias") else v) for k, v in p.items()}
    truth, truth_metrics = run(monkeypatch, "reference", torch.float64, rounded, config, **kw)
    same, _ = run(monkeypatch, "reference", dtype, p, config, **kw)
    fast, metrics = run(monkeypatch, backend, dtype, p, config, **kw)
    for name in truth:
        assert_no_worse(f"{config.loss_type}/{backend}/{dtype}/{name}", fast[name], same[name], truth[name], dtype)
    assert metrics.keys() == truth_metrics.keys()
    for name in truth_metrics:
        # metrics are means of fp32 per-token values (and of 0/1 clip indicators, equal unless a ratio sits on a
        # clip boundary to within fp32 rounding, which these random inputs avoid)
        assert_close(f"metric {name}", metrics[name].double().reshape(1), truth_metrics[name].double().reshape(1),
                     atol=2e-4 if dtype == torch.bfloat16 else 2e-5)
    return truth_metrics


def assert_close_gradients(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = GRAD_TOLERANCE) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        error = (g.double() - w).abs()
        scale = w.abs().max().clamp(min=1e-30)
        assert error.max() <= tol * scale, (
            f"parameter {i} {tuple(w.shape)}: max error {error.max():.3e} (mean {error.mean():.3e}) > {tol} * "
            f"{scale:.3e}; first at {divmod(int(error.argmax()), w.shape[-1]) if w.dim() > 1 else int(error.argmax())}")


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over parameters of max |a - b| / max |b|."""
    return max(float((x.double() - y).abs().max() / y.abs().max().clamp(min=1e-30)) for x, y in zip(a, b, strict=True))


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    T = max(len(r) for r in rows)
    return torch.stack([F.pad(torch.as_tensor(r, dtype=torch.float32), (0, T - len(r))) for r in rows])
