"""The default path on a real GPU (cuBLAS GEMMs, Triton row kernels): bf16/fp16/fp32 inputs against the float64
reference (skipped without CUDA)."""

import pytest
import torch
from helpers import assert_no_worse, leaf, make_head, make_problem

from fastgrpo.loss import LossConfig, fused_grpo_loss, token_logprobs
from fastgrpo.loss_config import LOSS_TYPES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(backend, dtype, device, p, config, monkeypatch):
    monkeypatch.setenv("FASTGRPO_BACKEND", backend)
    x, w, b = (leaf(p[k], dtype).to(device).detach().requires_grad_() for k in ("hidden", "weight", "bias"))
    to = lambda t: t.to(device)
    loss, metrics = fused_grpo_loss(x, w, to(p["ids"]), to(p["mask"]), to(p["adv"]), bias=b, old_logps=to(p["old"]),
                                    ref_logps=to(p["ref"]) if config.beta else None, config=config)
    loss.backward()
    return {"loss": loss.detach().cpu(), "d_hidden": x.grad.cpu(), "d_weight": w.grad.cpu(), "d_bias": b.grad.cpu()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level,beta", [("token", 0.0), ("sequence", 0.04)])
def test_loss_on_gpu(monkeypatch, dtype, loss_type, level, beta):
    p = make_problem(seed=11)
    config = LossConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, temperature=0.9)
    rounded = {k: (v.to(dtype).double() if k in ("hidden", "weight", "bias") else v) for k, v in p.items()}
    truth = _run("reference", torch.float64, "cpu", rounded, config, monkeypatch)
    same = _run("reference", dtype, "cuda", p, config, monkeypatch)
    fast = _run("chunked", dtype, "cuda", p, config, monkeypatch)
    for name in truth:
        assert_no_worse(f"{loss_type}/{dtype}/{name}", fast[name], same[name], truth[name], dtype)


@pytest.mark.parametrize("N,H,V", [(1000, 896, 151936), (333, 1536, 32000)])
def test_logprobs_real_heads_bf16(monkeypatch, N, H, V):
    hidden, weight, _, ids = make_head((N,), H, V, scale=8.0)
    truth = token_logprobs(hidden.to(torch.bfloat16).double(), weight.to(torch.bfloat16).double(), ids,
                           return_entropy=True)
    monkeypatch.setenv("FASTGRPO_BACKEND", "reference")
    same = token_logprobs(hidden.bfloat16().cuda(), weight.bfloat16().cuda(), ids.cuda(), return_entropy=True)
    monkeypatch.setenv("FASTGRPO_BACKEND", "chunked")
    fast = token_logprobs(hidden.bfloat16().cuda(), weight.bfloat16().cuda(), ids.cuda(), return_entropy=True)
    for i, name in enumerate(("logp", "entropy")):
        assert_no_worse(name, fast[i].cpu(), same[i].cpu(), truth[i], torch.bfloat16)


def test_the_default_path_is_bitwise_deterministic(monkeypatch):
    """No atomics: the same inputs give the same bits (cuBLAS's GEMMs are deterministic on one stream)."""
    p = make_problem(seed=12)
    runs = [_run("auto", torch.bfloat16, "cuda", p, LossConfig(beta=0.04), monkeypatch) for _ in range(2)]
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name
