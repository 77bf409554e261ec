"""Shared helpers of the loss tests: one fused_grpo_loss call with its gradients on a chosen backend (`run`), and a
fast path checked against the float64 reference and the same-dtype reference (`check`)."""

import torch
from helpers import assert_close, assert_no_worse, leaf

from fastgrpo.loss import fused_grpo_loss


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
