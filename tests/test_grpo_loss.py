"""fused_grpo_loss / grpo_loss / GRPOLoss: every loss type and option, on every CPU path, vs the float64 reference."""

import itertools

import pytest
import torch
from helpers import H, assert_close, make_problem
from loss_helpers import check, run

from fastgrpo import reference
from fastgrpo.loss import GRPOLoss, LossConfig, fused_grpo_loss, grpo_loss
from fastgrpo.loss_config import LOSS_TYPES

CASES = list(itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04]))


@pytest.mark.parametrize("backend,dtype", [("chunked", torch.float32)])
@pytest.mark.parametrize("loss_type,level,beta", CASES)
def test_loss_types(monkeypatch, backend, dtype, loss_type, level, beta):
    config = LossConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_high=0.28,
                        max_completion_length=16)
    metrics = check(monkeypatch, backend, dtype, make_problem(), config)
    if loss_type in ("grpo", "dapo") and level == "token":
        assert metrics["clip_ratio/region_mean"] > 0, "inputs should exercise the clipped branch"


OPTIONS = [
    dict(delta=1.25),  # INTELLECT-2 two-sided clip
    dict(temperature=0.6),
    dict(use_bias_correction_kl=False, beta=0.1),
    dict(importance_sampling_level="sequence", delta=1.1, beta=0.02),
    dict(epsilon_low=0.1, epsilon_high=0.4, temperature=1.7),
]


@pytest.mark.parametrize("backend,dtype", [("chunked", torch.float32), ("chunked", torch.float64),
                                           ("chunked", torch.bfloat16)])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
def test_options(monkeypatch, backend, dtype, options, loss_type):
    options = dict(options)
    if loss_type == "cispo":
        options["epsilon_high"] = 1.2  # cispo's cap is absolute
    check(monkeypatch, backend, dtype, make_problem(seed=3), LossConfig(loss_type=loss_type, **options))


@pytest.mark.parametrize("backend", ["chunked"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "luspo", "cispo"])
def test_per_token_advantages_on_policy_and_num_items(monkeypatch, backend, loss_type):
    p = make_problem(seed=5, adv_per_token=True)
    for level in ("token", "sequence"):
        config = LossConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.04)
        check(monkeypatch, backend, torch.float32, p, config, on_policy=True)
        check(monkeypatch, backend, torch.float32, p, config, num_items=57)


@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch_is_zero(monkeypatch, backend, loss_type):
    p = make_problem(seed=7)
    p["mask"] = torch.zeros_like(p["mask"])
    p["ids"] = torch.full_like(p["ids"], -100)
    config = LossConfig(loss_type=loss_type, beta=0.04, importance_sampling_level="sequence")
    out, metrics = run(monkeypatch, backend, torch.float32, p, config)
    assert out["loss"].item() == 0.0
    for name in ("d_hidden", "d_weight", "d_bias"):
        assert torch.equal(out[name], torch.zeros_like(out[name])), name
    assert not metrics.get("kl", torch.tensor(0.0)).isnan() and not metrics["entropy"].isnan()


def test_masked_tokens_get_zero_gradient(monkeypatch):
    p = make_problem(seed=2)
    out, _ = run(monkeypatch, "chunked", torch.float32, p, LossConfig(beta=0.04))
    assert torch.equal(out["d_hidden"][p["mask"] == 0], torch.zeros(int((p["mask"] == 0).sum()), H))
    assert out["d_hidden"][p["mask"] != 0].abs().sum() > 0


@pytest.mark.parametrize("backend", ["chunked"])
def test_deterministic(monkeypatch, backend):
    p = make_problem(seed=4)
    config = LossConfig(loss_type="grpo", beta=0.04, importance_sampling_level="sequence")
    first, m1 = run(monkeypatch, backend, torch.float32, p, config)
    second, m2 = run(monkeypatch, backend, torch.float32, p, config)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert all(torch.equal(m1[k], m2[k]) for k in m1)


@pytest.mark.parametrize("backend", ["chunked"])
def test_grpo_loss_from_logps(monkeypatch, backend):
    """grpo_loss on given per-token logprobs agrees with the reference, gradients included."""
    p = make_problem(seed=6)
    logps = reference.token_logprobs(p["hidden"], p["weight"], p["ids"].clamp(min=0), bias=p["bias"])[0].float()
    config = LossConfig(loss_type="dr_grpo", beta=0.04, delta=1.3, max_completion_length=12)
    results = []
    for be in ("reference", backend):
        monkeypatch.setenv("FASTGRPO_BACKEND", be)
        x = logps.detach().clone().requires_grad_()
        loss, metrics = grpo_loss(x, p["mask"], p["adv"], old_logps=p["old"], ref_logps=p["ref"], config=config)
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    assert_close("loss", results[1][0], results[0][0], atol=1e-6)
    assert_close("d logps", results[1][1], results[0][1], atol=1e-7)
    for k in results[0][2]:
        assert_close(k, results[1][2][k].reshape(1), results[0][2][k].reshape(1), atol=1e-6)


def test_module_forwards_config(monkeypatch):
    p = make_problem(seed=8)
    monkeypatch.setenv("FASTGRPO_BACKEND", "chunked")
    module = GRPOLoss(loss_type="bnpo", beta=0.04)
    assert module.config == LossConfig(loss_type="bnpo", beta=0.04) and "bnpo" in repr(module)
    loss, _ = module(p["hidden"], p["weight"], p["ids"], p["mask"], p["adv"], bias=p["bias"], old_logps=p["old"],
                     ref_logps=p["ref"])
    want, _ = fused_grpo_loss(p["hidden"], p["weight"], p["ids"], p["mask"], p["adv"], bias=p["bias"],
                              old_logps=p["old"], ref_logps=p["ref"], config=module.config)
    assert torch.equal(loss, want)


def test_defaults_follow_trl():
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False)
    c = LossConfig()
    assert (c.loss_type, c.epsilon_low, c.epsilon_high, c.delta, c.beta, c.temperature) == (
        args.loss_type, args.epsilon, args.epsilon_high or args.epsilon, args.delta, args.beta, args.temperature)
    assert (c.importance_sampling_level, c.use_bias_correction_kl, c.max_completion_length) == (
        args.importance_sampling_level, args.use_bias_correction_kl, args.max_completion_length)
    assert (c.sapo_temperature_pos, c.sapo_temperature_neg) == (args.sapo_temperature_pos, args.sapo_temperature_neg)


def test_a_new_loss_type_is_one_row_of_the_table(monkeypatch):
    """A loss type is its row in LOSS_TYPES: one added there (a clipped policy normalised by the micro-batch's tokens)
    runs through the default path, the reference and the trainer's share scaling with nothing else touched, and
    equals the built-in loss type of the same row (bnpo)."""
    from fastgrpo.loss_config import LossType

    monkeypatch.setitem(LOSS_TYPES, "bnpo_again", LossType("clip", "tokens"))
    p = make_problem(seed=4)
    mine, mine_metrics = run(monkeypatch, "chunked", torch.float64, p, LossConfig(loss_type="bnpo_again", beta=0.04))
    bnpo, bnpo_metrics = run(monkeypatch, "chunked", torch.float64, p, LossConfig(loss_type="bnpo", beta=0.04))
    for name in bnpo:
        assert torch.equal(mine[name], bnpo[name]), name
    assert mine_metrics.keys() == bnpo_metrics.keys()
    check(monkeypatch, "chunked", torch.float32, p, LossConfig(loss_type="bnpo_again", beta=0.04))
    assert LossConfig(loss_type="bnpo_again").kind.share_scale(4, 1.5) == 1.5
    with pytest.raises(ValueError, match="normaliser"):
        LossType("clip", "per_token")
