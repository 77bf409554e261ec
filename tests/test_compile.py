"""torch.compile of the default path: fused_grpo_loss and token_logprobs trace as one graph (the chunk loops in plain
PyTorch around the registered row ops of fastgrpo.chunked), the compiled loss equals eager's, and every op passes
torch.library.opcheck. CPU, small shapes."""

import itertools

import pytest
import torch
from helpers import leaf, make_problem

from fastgrpo import chunked
from fastgrpo.loss import LossConfig, fused_grpo_loss, token_logprobs

LEVELS_AND_BETAS = list(itertools.product(["token", "sequence"], [0.0, 0.04]))


@pytest.fixture(autouse=True)
def default_backend(monkeypatch):
    monkeypatch.setenv("FASTGRPO_BACKEND", "chunked")
    torch._dynamo.reset()  # each test traces afresh (no recompile limits, no cached graphs)
    yield
    torch._dynamo.reset()


def _head(p, dtype=torch.float32):
    """Leaves hidden [B, T, H] (not contiguous, as `last_hidden_state[:, :-1]` is), weight and bias of problem p."""
    B, T, H = p["hidden"].shape
    hidden = torch.empty(B, T + 1, H, dtype=dtype)[:, :-1].copy_(p["hidden"]).requires_grad_()
    return hidden, leaf(p["weight"], dtype), leaf(p["bias"], dtype)


def _loss_inputs(config, rows=None, **overrides):
    """fused_grpo_loss's (args, kwargs) on make_problem()'s first `rows` rows: a bias, old_logps None (on-policy)."""
    p = {k: v if k in ("weight", "bias") else v[:rows] for k, v in make_problem().items()}
    hidden, weight, bias = _head(p)
    kwargs = dict(bias=bias, old_logps=None, ref_logps=p["ref"] if config.beta else None, config=config)
    return (hidden, weight, p["ids"], p["mask"], p["adv"]), {**kwargs, **overrides}


def _assert_one_graph(fn, *args, **kwargs):
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    return explanation.graphs[0].code


@pytest.mark.parametrize("level,beta", LEVELS_AND_BETAS)
def test_fused_grpo_loss_is_one_graph(level, beta):
    config = LossConfig(loss_type="grpo", importance_sampling_level=level, beta=beta)
    args, kwargs = _loss_inputs(config)
    code = _assert_one_graph(fused_grpo_loss, *args, **kwargs)
    assert "fastgrpo.logit_row_stats" in code and "fastgrpo.logit_row_grad_" in code


EVERY_OPTION = LossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.05, logit_softcap=3.0, delta=1.5)


@pytest.mark.parametrize("items", [40, torch.tensor(40)], ids=["int", "tensor"])
def test_fused_grpo_loss_with_every_option_is_one_graph(items):
    """The value checks (ids in range, advantages finite, num_items_in_batch >= 0) are skipped under compile."""
    args, kwargs = _loss_inputs(EVERY_OPTION, num_items_in_batch=items, importance_weights=torch.rand(4))
    _assert_one_graph(fused_grpo_loss, *args, **kwargs)


@pytest.mark.parametrize("grad", [False, True])
def test_token_logprobs_is_one_graph(grad):
    p = make_problem()
    x, w, b = _head(p)
    with torch.set_grad_enabled(grad):
        code = _assert_one_graph(token_logprobs, x, w, p["ids"].clamp(min=0), bias=b, temperature=0.7,
                                 return_entropy=True)
    # (with a gradient the ops sit in the autograd.Function's forward and backward subgraphs)
    assert ("autograd_function_apply" if grad else "fastgrpo.logit_row_stats") in code


def _run(fn, args, kwargs):
    """fn's loss (or logprobs), metrics and gradients w.r.t. hidden, weight, bias."""
    out, metrics = fn(*args, **kwargs)
    out.sum().backward()
    x, w, b = args[0], args[1], kwargs["bias"]
    return {"out": out.detach(), **metrics, "d_hidden": x.grad, "d_weight": w.grad, "d_bias": b.grad}


def _assert_equal(got, want, close=("out", "d_bias")):
    """Bit for bit, but for `close` (to 2 fp32 ulps): a compiled graph scores every position of [B, T] (static
    shapes), so the loss's sum over tokens and the bias gradient's column sums over dZ meet padding's exact zeros,
    which regroup their additions."""
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name].isnan(), want[name].isnan()), name
        if name in close:
            torch.testing.assert_close(got[name], want[name], rtol=2.5e-7, atol=1e-7, msg=name)
        else:
            assert torch.equal(got[name].nan_to_num(0.0), want[name].nan_to_num(0.0)), name


# Under aot_eager the compiled graph runs eager's ops and kernels on the same numbers (padding contributes exact
# zeros), so its results equal eager's bit for bit but for the regrouped sums.


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_compiled_fused_grpo_loss_equals_eager(level):
    config = LossConfig(loss_type="grpo", importance_sampling_level=level, beta=0.04)
    want = _run(fused_grpo_loss, *_loss_inputs(config))
    got = _run(torch.compile(fused_grpo_loss, backend="aot_eager", fullgraph=True), *_loss_inputs(config))
    _assert_equal(got, want)


@pytest.mark.slow
def test_inductor_compiled_loss_matches_eager():
    """Inductor fuses the objective's elementwise math and the GEMMs' neighbours (its own rounding), not the row
    ops: fp32 results within 1e-5 of eager's."""
    config = LossConfig(loss_type="dapo", importance_sampling_level="sequence", beta=0.04)
    want = _run(fused_grpo_loss, *_loss_inputs(config))
    got = _run(torch.compile(fused_grpo_loss, fullgraph=True), *_loss_inputs(config))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)


def test_compiled_with_every_option_equals_eager():
    """The op's registered autograd under AOTAutograd (aot_eager: no Inductor compile) with every input given."""
    weights = torch.rand(4, generator=torch.Generator().manual_seed(0))
    inputs = lambda: _loss_inputs(EVERY_OPTION, num_items_in_batch=40, importance_weights=weights)
    _assert_equal(_run(torch.compile(fused_grpo_loss, backend="aot_eager", fullgraph=True), *inputs()),
                  _run(fused_grpo_loss, *inputs()))


def test_a_graph_per_batch_shape():
    """The chunk loop unrolls by the batch's shape, so a new [B, T] compiles a new graph and a shape seen before
    reuses its graph. aot_eager: the row ops and the autograd.Function without an Inductor compile."""
    compiled = torch.compile(fused_grpo_loss, backend="aot_eager", fullgraph=True)
    config = LossConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.04)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in (4, 3, 4):
        got, want = (_run(fn, *_loss_inputs(config, rows=rows)) for fn in (compiled, fused_grpo_loss))
        _assert_equal(got, want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2


def test_compiled_token_logprobs_equals_eager():
    p = make_problem()

    def logprobs(x, w, ids, bias):
        logp, ent = token_logprobs(x, w, ids, bias=bias, temperature=0.7, return_entropy=True)
        return logp + 0.3 * ent, {}

    def inputs():
        x, w, b = _head(p)
        return (x, w, p["ids"].clamp(min=0)), dict(bias=b)

    # A CPU's eager no-grad pass sums each row's exp over vocab blocks, the compiled one over the whole row.
    got = _run(torch.compile(logprobs, backend="aot_eager", fullgraph=True), *inputs())
    _assert_equal(got, _run(logprobs, *inputs()), close=("out", "d_hidden", "d_weight", "d_bias"))


def test_shape_checks_hold_under_compile():
    config = LossConfig(loss_type="grpo")
    args, kwargs = _loss_inputs(config)
    with pytest.raises(ValueError, match="advantages must have shape"):
        torch.compile(fused_grpo_loss, backend="eager")(*args[:4], torch.randn(3), **kwargs)


def _rows(softcap=None):
    """A chunk of logits [5, 300], its targets and its row statistics (the row ops' inputs)."""
    g = torch.Generator().manual_seed(0)
    z, ids = 3 * torch.randn(5, 300, generator=g), torch.randint(0, 300, (5,), generator=g)
    lse, logp, entropy = chunked.logit_row_stats(z, ids, softcap, True, None)
    return z, ids, lse, entropy, torch.randn(5, generator=g), torch.randn(5, generator=g)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("entropy", [False, True])
def test_opcheck_logit_row_stats(entropy, softcap):
    z, ids, *_ = _rows()
    torch.library.opcheck(chunked.logit_row_stats, (z, ids, softcap, entropy, None))
    torch.library.opcheck(chunked.logit_row_stats, (z, ids, softcap, entropy, torch.empty(8, 300)))  # a CPU's scratch


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("with_h", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_opcheck_logit_row_grad(with_h, softcap, out_dtype):
    z, ids, lse, entropy, g, h = _rows(softcap)
    out = None if out_dtype is None else torch.empty(z.shape, dtype=out_dtype)
    torch.library.opcheck(chunked.logit_row_grad_, (z, ids, lse, entropy, g, h if with_h else None, 0.7, softcap, out))
