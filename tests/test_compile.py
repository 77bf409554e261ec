"""torch.compile of the default path: fused_grpo_loss and token_logprobs trace as one graph around the registered ops
(fastgrpo.ops), the compiled loss equals eager's, and every op passes torch.library.opcheck. CPU, small shapes."""

import itertools

import pytest
import torch
from helpers import leaf, make_problem

from fastgrpo import ops
from fastgrpo.loss import LossConfig, fused_grpo_loss, token_logprobs

LEVELS_AND_BETAS = list(itertools.product(["token", "sequence"], [0.0, 0.04]))


@pytest.fixture(autouse=True)
def default_backend(monkeypatch):
    monkeypatch.setenv("FASTGRPO_BACKEND", "torch")
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
    assert "fastgrpo.grpo_head_loss" in _assert_one_graph(fused_grpo_loss, *args, **kwargs)


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
    assert "fastgrpo.token_logprobs" in code


def _run(fn, args, kwargs):
    """fn's loss (or logprobs), metrics and gradients w.r.t. hidden, weight, bias."""
    out, metrics = fn(*args, **kwargs)
    out.sum().backward()
    x, w, b = args[0], args[1], kwargs["bias"]
    return {"out": out.detach(), **metrics, "d_hidden": x.grad, "d_weight": w.grad, "d_bias": b.grad}


def _assert_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name].isnan(), want[name].isnan()), name
        assert torch.equal(got[name].nan_to_num(0.0), want[name].nan_to_num(0.0)), name


# The compiled graph runs the same kernels as eager on the same inputs; around them it only multiplies the saved
# gradients by grad_output = 1 and splits the metrics tensor, so its results equal eager's bit for bit.


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_compiled_fused_grpo_loss_equals_eager(level):
    config = LossConfig(loss_type="grpo", importance_sampling_level=level, beta=0.04)
    want = _run(fused_grpo_loss, *_loss_inputs(config))
    got = _run(torch.compile(fused_grpo_loss, fullgraph=True), *_loss_inputs(config))
    _assert_equal(got, want)


def test_compiled_with_every_option_equals_eager():
    """The op's registered autograd under AOTAutograd (aot_eager: no Inductor compile) with every input given."""
    weights = torch.rand(4, generator=torch.Generator().manual_seed(0))
    inputs = lambda: _loss_inputs(EVERY_OPTION, num_items_in_batch=40, importance_weights=weights)
    _assert_equal(_run(torch.compile(fused_grpo_loss, backend="aot_eager", fullgraph=True), *inputs()),
                  _run(fused_grpo_loss, *inputs()))


def test_new_shapes_recompile_once_with_dynamic_shapes():
    """A second batch shape recompiles with symbolic B, T (the fake implementations' shapes follow); a third reuses
    that graph. aot_eager: the op's autograd without an Inductor compile."""
    compiled = torch.compile(fused_grpo_loss, backend="aot_eager", fullgraph=True)
    config = LossConfig(loss_type="grpo", importance_sampling_level="sequence", beta=0.04)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in (4, 3, 2):
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

    _assert_equal(_run(torch.compile(logprobs, fullgraph=True), *inputs()), _run(logprobs, *inputs()))


def test_shape_checks_hold_under_compile():
    config = LossConfig(loss_type="grpo")
    args, kwargs = _loss_inputs(config)
    with pytest.raises(ValueError, match="advantages must have shape"):
        torch.compile(fused_grpo_loss, backend="eager")(*args[:4], torch.randn(3), **kwargs)


def _op_inputs(config, grad):
    """fastgrpo::grpo_head_loss's arguments for make_problem()."""
    (x, w, ids, mask, adv), kwargs = _loss_inputs(config)
    x, w, b = (t.detach().requires_grad_(grad) for t in (x, w, kwargs["bias"]))
    return (x, w, b, ids, mask, adv, None, kwargs["ref_logps"], None, torch.tensor(30.0), [grad] * 3,
            *ops.config_args(config))


@pytest.mark.parametrize("level,beta", LEVELS_AND_BETAS)
def test_opcheck_grpo_head_loss(level, beta):
    config = LossConfig(loss_type="dapo", importance_sampling_level=level, beta=beta)
    torch.library.opcheck(ops.grpo_head_loss_op, _op_inputs(config, grad=True))
    torch.library.opcheck(ops.grpo_head_loss_op, _op_inputs(config, grad=False))


@pytest.mark.parametrize("entropy", [False, True])
def test_opcheck_token_logprobs(entropy):
    p = make_problem()
    torch.library.opcheck(ops.token_logprobs_op, (*_head(p), p["ids"].clamp(min=0), 0.8, 3.0, entropy))


def test_opcheck_token_logprobs_backward():
    p = make_problem()
    x, w, b = (t.detach() for t in _head(p))
    g = torch.randn(p["ids"].shape, generator=torch.Generator().manual_seed(0))
    for wants_grad in ([True, True, True], [False, True, False]):
        args = (g, 0.3 * g, x, w, b, p["ids"].clamp(min=0), 1.0, None, wants_grad)
        torch.library.opcheck(ops.token_logprobs_backward_op, args)
