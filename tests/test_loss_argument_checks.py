"""The loss API's argument checks (fused_grpo_loss, grpo_loss, GRPOLoss, LossConfig, token_logprobs, the backend
variable): bad input gets a clear ValueError/TypeError naming the argument; nothing runs on it."""

import pytest
import torch

from fastgrpo.loss import GRPOLoss, LossConfig, fused_grpo_loss, grpo_loss, resolve_backend, token_logprobs

B, T, H, V = 2, 5, 8, 32


def good():
    return dict(hidden=torch.randn(B, T, H), weight=torch.randn(V, H), completion_ids=torch.randint(0, V, (B, T)),
                completion_mask=torch.ones(B, T), advantages=torch.randn(B))


def call(config=None, **changes):
    args = {**good(), **changes}
    kw = {k: args.pop(k) for k in ("bias", "old_logps", "ref_logps", "num_items_in_batch") if k in args}
    return fused_grpo_loss(*args.values(), config=LossConfig() if config is None else config, **kw)


@pytest.mark.parametrize("changes,error,words", [
    (dict(hidden=torch.randn(B, T, H + 1)), ValueError, "hidden"),
    (dict(hidden=torch.randn(B, T)), ValueError, "hidden"),
    (dict(hidden=torch.randint(0, 3, (B, T, H))), TypeError, "hidden"),
    (dict(weight=torch.randn(V, H, dtype=torch.float64)), TypeError, "weight"),
    (dict(weight=torch.randn(V)), ValueError, "weight"),
    (dict(bias=torch.randn(V + 1)), ValueError, "bias"),
    (dict(completion_ids=torch.randn(B, T)), TypeError, "token_ids"),
    (dict(completion_ids=torch.randint(0, V, (B, T + 1))), ValueError, "token_ids"),
    (dict(completion_ids=torch.full((B, T), V)), ValueError, "[0, 32)"),
    (dict(completion_ids=torch.full((B, T), -1)), ValueError, "token_ids"),
    (dict(completion_mask=torch.ones(B, T + 1)), ValueError, "completion_mask"),
    (dict(advantages=torch.randn(B + 1)), ValueError, "advantages"),
    (dict(advantages=torch.tensor([1.0, float("nan")])), ValueError, "advantages must be finite"),
    (dict(advantages=torch.tensor([1.0, float("inf")])), ValueError, "advantages must be finite"),
    (dict(advantages=torch.ones(B, dtype=torch.long)), TypeError, "advantages"),
    (dict(old_logps=torch.randn(B, T + 1)), ValueError, "old_logps"),
    (dict(ref_logps=torch.randn(B, 1)), ValueError, "ref_logps"),
    (dict(num_items_in_batch=-3), ValueError, "num_items_in_batch"),
    (dict(weight=torch.randn(V, H, device="meta")), ValueError, "device"),
])
def test_fused_loss_rejects(changes, error, words):
    with pytest.raises(error, match=None) as info:
        call(**changes)
    assert words in str(info.value), str(info.value)


def test_missing_ref_logps_when_beta():
    with pytest.raises(ValueError, match="ref_logps is required"):
        call(config=LossConfig(beta=0.04))


def test_out_of_range_ids_on_masked_tokens_are_ignored():
    ids = torch.randint(0, V, (B, T))
    ids[0, -2:] = -100
    mask = torch.ones(B, T)
    mask[0, -2:] = 0
    loss, _ = call(completion_ids=ids, completion_mask=mask)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("field,value", [
    ("loss_type", "ppo"), ("epsilon_low", -0.1), ("epsilon_high", float("nan")), ("beta", -1.0),
    ("temperature", 0.0), ("delta", 0.0), ("importance_sampling_level", "token_level"),
    ("max_completion_length", 0), ("use_bias_correction_kl", "yes"), ("sapo_temperature_neg", -1.0),
])
def test_config_rejects(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        LossConfig(**{field: value})


def test_config_rejects_wrong_type():
    with pytest.raises(TypeError, match="config"):
        call(config={"loss_type": "grpo"})
    with pytest.raises(ValueError, match="either config or keyword"):
        GRPOLoss(LossConfig(), beta=0.1)


def test_token_logprobs_rejects():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.randn(3, H), torch.randn(V, H), torch.zeros(3, dtype=torch.long), temperature=-1.0)
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs(torch.randn(3, H), torch.randn(V, H), torch.tensor([0, 1, V]))
    with pytest.raises(TypeError, match="token_ids"):
        token_logprobs(torch.randn(3, H), torch.randn(V, H), torch.zeros(3, dtype=torch.bool))


def test_grpo_loss_rejects():
    with pytest.raises(ValueError, match="logps"):
        grpo_loss(torch.randn(B), torch.ones(B), torch.randn(B), config=LossConfig())
    with pytest.raises(ValueError, match="completion_mask"):
        grpo_loss(torch.randn(B, T), torch.ones(B, T - 1), torch.randn(B), config=LossConfig())


def test_backend_env(monkeypatch):
    monkeypatch.setenv("FASTGRPO_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="FASTGRPO_BACKEND"):
        resolve_backend()
    monkeypatch.setenv("FASTGRPO_BACKEND", "fused")  # the fully fused kernels were removed (benchmarks/NOTES.md)
    with pytest.raises(ValueError, match="'auto', 'chunked', 'reference'"):
        resolve_backend()
    monkeypatch.setenv("FASTGRPO_BACKEND", "auto")
    assert resolve_backend() == "chunked"


def test_loss_inputs_are_checked_before_any_logprob_work(monkeypatch):
    from fastgrpo import grpo_head

    def boom(*args, **kwargs):
        raise AssertionError("the logprobs ran before the loss inputs were checked")

    monkeypatch.setattr(grpo_head, "grpo_head_loss", boom)
    with pytest.raises(ValueError, match="advantages"):
        call(advantages=torch.randn(B, T + 2))
    with pytest.raises(ValueError, match="ref_logps is required"):
        call(config=LossConfig(beta=0.1))
