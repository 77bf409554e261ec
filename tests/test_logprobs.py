"""token_logprobs: the chunked path vs the full-logits reference (float64 truth, the same-dtype reference)."""

import pytest
import torch
from helpers import assert_close, assert_no_worse, leaf, make_head

from fastgrpo import chunked, reference
from fastgrpo.loss import token_logprobs

CPU_PATHS = [("chunked", torch.float64), ("chunked", torch.float32), ("chunked", torch.bfloat16)]
SHAPES = [((37,), 70, 300), ((3, 11), 33, 129), ((4,), 16, 64), ((1,), 5, 7)]


def _run(monkeypatch, backend, dtype, hidden, weight, bias, ids, temperature, g, h):
    monkeypatch.setenv("FASTGRPO_BACKEND", backend)
    x, w, b = leaf(hidden, dtype), leaf(weight, dtype), leaf(bias, dtype)
    logp, ent = token_logprobs(x, w, ids, bias=b, temperature=temperature, return_entropy=True)
    assert logp.dtype == ent.dtype == torch.promote_types(dtype, torch.float32)
    ((logp * g.to(logp.dtype)).sum() + (ent * h.to(ent.dtype)).sum()).backward()
    return {"logp": logp.detach(), "entropy": ent.detach(), "d_hidden": x.grad, "d_weight": w.grad,
            "d_bias": None if b is None else b.grad}


def _three_way(monkeypatch, backend, dtype, hidden, weight, bias, ids, temperature):
    g = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    # float64 truth on the dtype-rounded inputs, the same-dtype torch reference, the fast path
    rounded = [None if t is None else t.to(dtype).double() for t in (hidden, weight, bias)]
    truth = _run(monkeypatch, "reference", torch.float64, *rounded, ids, temperature, g, h)
    same = _run(monkeypatch, "reference", dtype, hidden, weight, bias, ids, temperature, g, h)
    fast = _run(monkeypatch, backend, dtype, hidden, weight, bias, ids, temperature, g, h)
    for name in truth:
        if truth[name] is not None:
            assert_no_worse(f"{backend}/{dtype}/{name}", fast[name], same[name], truth[name], dtype)


@pytest.mark.parametrize("backend,dtype", CPU_PATHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature,bias", [(1.0, False), (0.7, True)])
def test_matches_reference(monkeypatch, backend, dtype, shape, temperature, bias):
    n_shape, H, V = shape
    hidden, weight, b, ids = make_head(n_shape, H, V, scale=4.0, bias=bias)
    _three_way(monkeypatch, backend, dtype, hidden, weight, b, ids, temperature)


@pytest.mark.parametrize("backend,dtype", [("chunked", torch.float32)])
def test_extreme_logits(monkeypatch, backend, dtype):
    hidden, weight, _, ids = make_head((9,), 24, 200, scale=3000.0)  # logits of std ~3000
    hidden[3] = 0.0  # all-equal logits: logp = -log V, entropy = log V
    ids[4] = weight.double().matmul(hidden[4].double()).argmin()  # the least likely token: logp ~ -1e4
    _three_way(monkeypatch, backend, dtype, hidden, weight, None, ids, 1.0)
    monkeypatch.setenv("FASTGRPO_BACKEND", backend)
    logp, ent = token_logprobs(hidden.to(dtype), weight.to(dtype), ids, return_entropy=True)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert_close("uniform row logp", logp[3:4], torch.tensor([-torch.log(torch.tensor(200.0))]), atol=1e-5)
    assert_close("uniform row entropy", ent[3:4], torch.tensor([torch.log(torch.tensor(200.0))]), atol=1e-5)


@pytest.mark.parametrize("offset,dtype", [(-300.0, torch.float32), (85.0, torch.float32), (78.0, torch.float32),
                                          (700.0, torch.float64)])
def test_logits_far_from_zero(monkeypatch, offset, dtype):
    row_stats = chunked.chunked_row_stats
    """The CPU row passes skip the max subtraction while exp(z) sums stay in range: logits all far below zero (the
    sum underflows), near the top of exp's range (it overflows at V terms), or just under it (the sum is finite but
    the entropy's sum of exp(z) z would overflow) take the shifted form, exactly."""
    hidden, weight, bias, ids = make_head((6,), 16, 300, scale=1.0, bias=True)
    bias = bias + offset
    shifted = []  # the chunks the no-grad pass computed again because its blocked sums went out of range
    monkeypatch.setattr(chunked, "chunked_row_stats", lambda *args: shifted.append(args[-1]) or row_stats(*args))
    _three_way(monkeypatch, "chunked", dtype, hidden, weight, bias, ids, 1.0)
    assert shifted


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpu_vocab_blocks(monkeypatch, dtype):
    """A CPU forms each chunk's logits in vocab blocks (the no-grad pass consumes them block by block, the gradient
    path writes them into its chunk): blocks of 128 columns and a short last one, chunks of 7 rows and a short last
    one, every target's block hit; the same with a soft cap and a logit scale, without a gradient."""
    monkeypatch.setattr(chunked, "CPU_BLOCK_BYTES", 1)  # the narrowest blocks: 128 columns
    monkeypatch.setenv("FASTGRPO_CHUNK_TOKENS", "7")
    assert [b.stop - b.start for b in chunked.vocab_blocks(7, 300)] == [128, 128, 44]
    hidden, weight, bias, ids = make_head((23,), 16, 300, scale=4.0, bias=True)
    ids[:3] = torch.tensor([0, 128, 299])  # the first and last columns of blocks
    _three_way(monkeypatch, "chunked", dtype, hidden, weight, bias, ids, 0.8)
    monkeypatch.setenv("FASTGRPO_BACKEND", "chunked")
    with torch.no_grad():
        logp, ent = token_logprobs(hidden.to(dtype), weight.to(dtype), ids, bias=bias.to(dtype), temperature=0.8,
                                   return_entropy=True, logit_scale=1.5, logit_softcap=6.0)
    truth = reference.token_logprobs(*(t.to(dtype).double() for t in (hidden, weight)), ids,
                                     bias=bias.to(dtype).double(), temperature=0.8, return_entropy=True,
                                     logit_scale=1.5, logit_softcap=6.0)
    atol = 1e-9 if dtype == torch.float64 else 1e-4
    assert_close("logp (softcap, scale)", logp, truth[0], atol=atol)
    assert_close("entropy (softcap, scale)", ent, truth[1], atol=atol)


def test_real_vocab_chunked(monkeypatch):
    """Qwen2's vocab (151936) on the chunked path: several chunks, forward and gradients."""
    hidden, weight, bias, ids = make_head((40,), 32, 151936, scale=4.0, bias=True)
    _three_way(monkeypatch, "chunked", torch.float32, hidden, weight, bias, ids, 0.9)


@pytest.mark.parametrize("backend", ["chunked"])
def test_deterministic(monkeypatch, backend):
    hidden, weight, bias, ids = make_head((29,), 40, 333, scale=4.0, bias=True, dtype=torch.float32)
    g = torch.randn(29)
    runs = [_run(monkeypatch, backend, torch.float32, hidden, weight, bias, ids, 0.8, g, g) for _ in range(2)]
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


@pytest.mark.parametrize("backend", ["chunked"])
def test_frozen_weight_or_hidden(monkeypatch, backend):
    """A frozen lm_head (LoRA) or frozen hidden states skip that gradient and leave the other one unchanged."""
    monkeypatch.setenv("FASTGRPO_BACKEND", backend)
    hidden, weight, _, ids = make_head((13,), 20, 90, scale=4.0, dtype=torch.float32)
    g = torch.randn(13)
    want = {}
    for frozen in (None, "weight", "hidden"):
        x, w = hidden.clone().requires_grad_(frozen != "hidden"), weight.clone().requires_grad_(frozen != "weight")
        logp, _ = token_logprobs(x, w, ids)
        (logp * g).sum().backward()
        if frozen is None:
            want = {"hidden": x.grad, "weight": w.grad}
        else:
            assert (w if frozen == "weight" else x).grad is None
            live = "hidden" if frozen == "weight" else "weight"
            assert torch.equal((x if live == "hidden" else w).grad, want[live]), live


@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("ids_dtype", [torch.uint8, torch.int16, torch.int32])
def test_any_integer_ids(monkeypatch, backend, ids_dtype):
    """Token ids of any integer dtype give what int64 ids give (uint8 ids against a vocabulary of 300 once wrapped
    in the range check and were refused)."""
    from fastgrpo.loss import LossConfig, fused_grpo_loss

    monkeypatch.setenv("FASTGRPO_BACKEND", backend)
    hidden, weight, _, ids = make_head((2, 5), 16, 300, scale=2.0, dtype=torch.float32)
    ids = ids % 256
    want = token_logprobs(hidden, weight, ids, return_entropy=True)
    got = token_logprobs(hidden, weight, ids.to(ids_dtype), return_entropy=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    mask, adv = torch.ones(2, 5), torch.tensor([1.0, -1.0])
    config = LossConfig(loss_type="dapo", beta=0.0)
    want = fused_grpo_loss(hidden, weight, ids, mask, adv, config=config)[0]
    got = fused_grpo_loss(hidden, weight, ids.to(ids_dtype), mask, adv, config=config)[0]
    assert torch.equal(got, want)
