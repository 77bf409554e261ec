"""The row kernels over fp32 logits (fastgrpo/kernels/logit_rows.py), three ways: float64 autograd ground truth, the
same math in fp32 torch, the kernels (under the interpreter on CPU, for real with CUDA)."""

import os

import pytest
import torch
from helpers import assert_close, assert_no_worse, describe_mismatch

from fastgrpo.check.tolerance import row_grad_limit, ulp
from fastgrpo.kernels.logit_rows import STATS_TILE, logit_row_grad, logit_row_stats

BLOCK_V = STATS_TILE[0]
SHAPES = [(C, V) for C in (1, 3, 7) for V in (1, 5, 1000, 4099)]  # no V a multiple of the 4096 tile
SOFTCAP = 30.0  # Gemma-2's final_logit_softcapping
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest: set whenever there is no GPU
DEVICE = "cpu" if INTERPRETED else "cuda"


def _logits(C, V, seed=0, spread=4.0):
    """z [C, V] fp32 with a row stride of V + 3 (not contiguous); ids [C] with ids[0] = 0 and ids[-1] = V - 1."""
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(C, V + 3, generator=gen) * spread).to(DEVICE)[:, :V]
    ids = torch.randint(0, V, (C,), generator=gen)
    ids[0], ids[-1] = 0, V - 1
    g = torch.randn(C, generator=gen)
    h = torch.randn(C, generator=gen)
    return z, ids.to(DEVICE), g.to(DEVICE), h.to(DEVICE)


def _reference(z, ids, g, h, softcap=None, scale=1.0, dtype=torch.float64):
    """The module docstring's plain-PyTorch equivalent in `dtype` on the CPU: (lse, logp, entropy, scale * dL/dz)."""
    z, ids, g, h = (None if x is None else x.cpu() for x in (z, ids, g, h))
    z = z.detach().to(dtype).requires_grad_()
    zc = softcap * torch.tanh(z / softcap) if softcap else z
    lsm = zc.log_softmax(-1)
    hit = (ids >= 0) & (ids < z.shape[1])
    logp = lsm.gather(-1, ids.clamp(0, z.shape[1] - 1)[:, None])[:, 0] * hit  # ignored ids: the constant 0
    entropy = -(lsm.exp() * lsm).sum(-1)
    loss = (g.to(dtype) * logp).sum() + (0.0 if h is None else (h.to(dtype) * entropy).sum())
    (grad,) = torch.autograd.grad(loss, z)
    return zc.logsumexp(-1).detach(), logp.detach(), entropy.detach(), grad * scale


def _assert_grad(name, got, same, truth, lse, g, ids, scale):
    """The kernel's gradient within fastgrpo.check.tolerance.row_grad_limit of the float64 truth."""
    got, g, ids = got.cpu(), g.cpu(), ids.cpu()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    limit = row_grad_limit(same, truth, lse, g, ids, scale)
    assert (got.double() - truth).abs().max().item() <= limit, describe_mismatch(name, got, truth, limit)


def _check(z, ids, g, h, softcap, scale):
    """Run both kernels (the gradient into a fresh fp32 buffer) and compare everything three ways."""
    truth = _reference(z, ids, g, h, softcap, scale)
    same = _reference(z, ids, g, h, softcap, scale, dtype=torch.float32)
    lse, logp, entropy = logit_row_stats(z, ids, softcap=softcap)
    for i, name in enumerate(("lse", "logp", "entropy")):
        assert_no_worse(name, (lse, logp, entropy)[i].cpu(), same[i], truth[i], torch.float32)
    out = torch.empty_like(z)
    got = logit_row_grad(z, ids, lse, entropy if h is not None else None, g, h, scale=scale, softcap=softcap, out=out)
    assert got is out
    _assert_grad("grad", got, same[3], truth[3], truth[0], g, ids, scale)
    return lse, logp, entropy, got


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("C,V", SHAPES)
def test_row_stats(C, V, softcap):
    z, ids, _, _ = _logits(C, V)
    truth = _reference(z, ids, torch.zeros(C), None, softcap)
    same = _reference(z, ids, torch.zeros(C), None, softcap, dtype=torch.float32)
    got = logit_row_stats(z, ids, softcap=softcap)
    for name, a, b, c in zip(("lse", "logp", "entropy"), got, same, truth, strict=False):
        assert a.shape == (C,) and a.dtype == torch.float32 and a.device == z.device
        assert_no_worse(f"{name} C={C} V={V} softcap={softcap}", a.cpu(), b, c, torch.float32)


@pytest.mark.parametrize("h_term,scale", [(True, 1.0 / 0.7), (False, 1.0)])
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("C,V", SHAPES)
def test_row_grad(C, V, softcap, h_term, scale):
    z, ids, g, h = _logits(C, V, seed=1)
    _check(z, ids, g, h if h_term else None, softcap, scale)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the cap's exp(2|x|) is inf past |x| = 44: tanh = 1
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
def test_extreme_logits(softcap):
    """Spreads of +-4e4, a very peaked row, a large common offset, a uniform row, and rows whose max grows in every
    tile (and never again after the first) across 2 full tiles and a tail; targets at the least likely token, the
    peak, 0 and V - 1."""
    V = 2 * BLOCK_V + 1
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(6, V, generator=gen)
    z[0] *= 1e4
    z[1, 17] = 1e4
    z[2] += 1e4
    z[3] = 0.0
    z[4] = torch.linspace(-1e4, 1e4, V)
    z[5] = torch.linspace(1e4, -1e4, V)
    ids = torch.tensor([int(z[0].argmin()), 17, 0, V - 1, V - 1, 0])
    g, h = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    z, ids, g, h = (x.to(DEVICE) for x in (z, ids, g, h))
    lse, logp, entropy, _ = _check(z, ids, g, h, softcap, 1.0)
    logp, entropy = logp.cpu(), entropy.cpu()
    assert logp[0] < (-3e4 if softcap is None else -50.0)
    log_v = torch.tensor(float(V)).log()
    assert_close("uniform row logp", logp[3:4], -log_v[None], atol=1e-5)
    assert_close("uniform row entropy", entropy[3:4], log_v[None], atol=1e-5)


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("C,V", [(3, 4099), (7, 1000)])
def test_grad_in_place(C, V, softcap):
    """out aliasing z: every tile is read before it is written; the row stride's padding stays untouched."""
    z, ids, g, h = _logits(C, V, seed=3)
    base = z._base if z._base is not None else z
    pad = base[:, V:].clone()
    truth = _reference(z, ids, g, h, softcap, 0.5)
    same = _reference(z, ids, g, h, softcap, 0.5, dtype=torch.float32)
    lse, _, entropy = logit_row_stats(z, ids, softcap=softcap)
    got = logit_row_grad(z, ids, lse, entropy, g, h, scale=0.5, softcap=softcap, out=z)
    assert got.data_ptr() == z.data_ptr()
    _assert_grad("in-place grad", got, same[3], truth[3], truth[0], g, ids, 0.5)
    assert torch.equal(base[:, V:], pad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
def test_grad_low_precision_out(dtype, softcap):
    """out in bf16/fp16 (a strided buffer) vs the fp64 truth rounded to out's dtype. The kernel rounds its fp32 value
    once; that value is ~1e-6 relative off the truth, which changes the rounding only where the truth lies that close
    to a rounding boundary, so: within one ulp of out's dtype plus 2^-20 relative (the fp32 value's own error) of the
    truth everywhere, and >= 99% of the values equal to the rounded truth. GPUs round
    to nearest even (cvt.rn); triton 3.9's interpreter truncates fp32 -> bf16 (its cast_impl), so under the
    interpreter the bf16 truth is rounded toward zero."""
    C, V = 5, 4099
    z, ids, g, h = _logits(C, V, seed=4)
    truth = _reference(z, ids, g, h, softcap, 1.0 / 0.7)[3]
    lse, _, entropy = logit_row_stats(z, ids, softcap=softcap)
    out = torch.zeros(C, V + 8, dtype=dtype, device=DEVICE)[:, 8:]
    logit_row_grad(z, ids, lse, entropy, g, h, scale=1.0 / 0.7, softcap=softcap, out=out)
    out = out.cpu()
    if dtype == torch.bfloat16 and INTERPRETED:
        want = (truth.float().view(torch.int32) & -(2**16)).view(torch.float32).to(dtype)  # drop the low 16 bits
    else:
        want = truth.to(dtype)
    limit = ulp(truth, dtype) + 2**-20 * truth.abs()
    bad = ((out.double() - truth).abs() > limit).nonzero()[:5].tolist()
    assert not bad, f"{dtype} grad off by more than one ulp at {bad}: {[(out[i, j], truth[i, j]) for i, j in bad]}"
    exact = (out == want).double().mean().item()
    assert exact >= 0.99, f"only {exact:.4f} of the values equal the rounded truth"


def test_ignored_ids():
    """ids outside [0, V): logp is 0 and g adds no gradient; lse, entropy and the entropy gradient as usual."""
    z, _, g, h = _logits(3, 1000, seed=5)
    ids = torch.tensor([-100, 1000, 7], device=DEVICE)
    _, logp, _, _ = _check(z, ids, g, h, None, 1.0)
    assert torch.equal(logp[:2].cpu(), torch.zeros(2))


def test_deterministic():
    z, ids, g, h = _logits(4, 4099, seed=6)
    runs = []
    for _ in range(2):
        lse, logp, entropy = logit_row_stats(z, ids, softcap=SOFTCAP)
        out = logit_row_grad(z, ids, lse, entropy, g, h, scale=0.3, softcap=SOFTCAP, out=torch.empty_like(z))
        runs.append((lse, logp, entropy, out))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_empty_chunk():
    z, ids = torch.empty(0, 50, device=DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE)
    lse, logp, entropy = logit_row_stats(z, ids)
    assert lse.shape == logp.shape == entropy.shape == (0,)
    out = torch.empty(0, 50, dtype=torch.bfloat16, device=DEVICE)
    e = torch.empty(0, device=DEVICE)
    assert logit_row_grad(z, ids, e, e, e, None, out=out) is out


def test_bad_inputs():
    z, ids, g, h = _logits(3, 10)
    lse, _, entropy = logit_row_stats(z, ids)
    with pytest.raises(AssertionError, match="z must be"):
        logit_row_stats(z.double(), ids)
    with pytest.raises(AssertionError, match="unit stride"):
        logit_row_stats(z.t().contiguous().t(), ids)
    with pytest.raises(AssertionError, match="ids must be a \\[3\\]"):
        logit_row_stats(z, ids.int())
    with pytest.raises(AssertionError, match="softcap"):
        logit_row_stats(z, ids, softcap=0.0)
    with pytest.raises(AssertionError, match="h must be"):
        logit_row_grad(z, ids, lse, entropy, g, h[:2], out=torch.empty_like(z))
    with pytest.raises(AssertionError, match="out must be float32"):
        logit_row_grad(z, ids, lse, entropy, g, h, out=torch.empty(3, 10, dtype=torch.float64, device=DEVICE))
    with pytest.raises(AssertionError, match="out must be a \\[3, 10\\]"):
        logit_row_grad(z, ids, lse, entropy, g, h, out=torch.empty(3, 11, device=DEVICE))
    base = z._base
    with pytest.raises(AssertionError, match="out overlaps z"):  # shifted by one column
        logit_row_grad(z, ids, lse, entropy, g, h, out=base[:, 1:11])
    with pytest.raises(AssertionError, match="out overlaps z"):  # in place needs float32 out
        logit_row_grad(z, ids, lse, entropy, g, h, out=base.view(torch.bfloat16)[:, :10])
