"""loss_type="vespo" (TRL 1.16's Variational Sequence-Level Soft Policy Optimization): the reference against TRL's own
`GRPOTrainer._compute_loss`, the default path against the float64 reference, and the options' checks.

VESPO weighs each sequence's policy term -A logp by phi(w) = e^lam w^k e^(-lam w), a detached function of the
sequence's importance ratio w (its summed log-ratio, plus the sampler's per-token log-ratios when given).
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close, assert_no_worse, leaf, make_head

from fastgrpo import grpo_head, reference
from fastgrpo.loss import LossConfig, fused_grpo_loss
from fastgrpo.loss_config import LOSS_TYPES, TOKEN_NORMALISED_LOSS_TYPES

# Options other than TRL's defaults, exact in fp32 (TRL picks k and lambda with a float32 torch.where, so inexact
# values would differ from fastgrpo's float64 ones by fp32 rounding), and k_pos = 0 (a weight of e^(lam (1 - w))).
CUSTOM = dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=0.75, vespo_lambda_neg=4.0)
ZERO_K = dict(vespo_k_pos=0.0, vespo_lambda_pos=0.5)


def vespo_problem(B, T, H, V, seed=0, drift=0.15, adv_per_token=False):
    """A loss problem with hidden [B, T, H], weight [V, H], bias [V], ids [B, T] (-100 on padding), mask [B, T] (a
    padded tail, an all-masked row when B > 2), old / ref logprobs [B, T] fp32 (garbage on masked positions), the
    sampler's per-token ratios iw [B, T] (0 on some tokens, as token_mask leaves them; garbage on masked positions),
    advantages [B] (or [B, T]) of both signs with an exact 0. Per-row drifts of old from the policy put each sequence's
    ratio w below and above 1."""
    hidden, weight, bias, ids = make_head((B, T + 1), H, V, seed=seed, scale=4.0, bias=True)
    hidden, ids = hidden[:, :-1], ids[:, 1:]  # non-contiguous, as `last_hidden_state[:, :-1]` is
    g = torch.Generator().manual_seed(seed + 1)
    mask = (torch.rand(B, T, generator=g) > 0.2).long()
    mask[0, 0] = 1
    if B > 1:
        mask[1, T // 2 + 1 :] = 0  # a padded tail
    if B > 2:
        mask[2] = 0  # an all-masked row
    ids = ids.masked_fill(mask == 0, -100)
    logps, _ = reference.token_logprobs(hidden, weight, ids.clamp(min=0), bias=bias)
    row_drift = drift * torch.randn(B, 1, generator=g, dtype=torch.float64)
    old = logps + row_drift + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    iw = torch.exp(0.05 * torch.randn(B, T, generator=g, dtype=torch.float64))
    iw[torch.rand(B, T, generator=g) < 0.05] = 0.0
    garbage = lambda t, value: t.float().masked_fill(mask == 0, value)
    adv = torch.randn((B, T) if adv_per_token else (B,), generator=g)
    adv.view(-1)[-1] = 0.0
    return dict(hidden=hidden, weight=weight, bias=bias, ids=ids, mask=mask, adv=adv, old=garbage(old, float("nan")),
                ref=garbage(ref, -float("inf")), iw=garbage(iw, -3.0))


def run(monkeypatch, backend, dtype, p, config, on_policy=False, sampler=False):
    monkeypatch.setenv("FASTGRPO_BACKEND", backend)
    x, w, b = leaf(p["hidden"], dtype), leaf(p["weight"], dtype), leaf(p["bias"], dtype)
    loss, metrics = fused_grpo_loss(
        x, w, p["ids"], p["mask"], p["adv"], bias=b, old_logps=None if on_policy else p["old"],
        ref_logps=p["ref"] if config.beta else None, config=config, importance_weights=p["iw"] if sampler else None,
    )
    loss.backward()
    return {"loss": loss.detach(), "d_hidden": x.grad, "d_weight": w.grad, "d_bias": b.grad}, metrics


def check(monkeypatch, dtype, p, config, **kw):
    """The default path's loss, gradients and metrics vs the float64 reference, no worse than the same-dtype one."""
    rounded = {k: (v.to(dtype).double() if k in ("hidden", "weight", "bias") else v) for k, v in p.items()}
    truth, truth_metrics = run(monkeypatch, "reference", torch.float64, rounded, config, **kw)
    same, _ = run(monkeypatch, "reference", dtype, p, config, **kw)
    fast, metrics = run(monkeypatch, "chunked", dtype, p, config, **kw)
    for name in truth:
        assert_no_worse(f"vespo/{dtype}/{name}", fast[name], same[name], truth[name], dtype)
    assert metrics.keys() == truth_metrics.keys()
    for name in truth_metrics:  # means of fp32 per-token values (phi: of per-sequence ones)
        assert_close(f"metric {name}", metrics[name].double().reshape(1), truth_metrics[name].double().reshape(1),
                     atol=1e-10 if dtype == torch.float64 else 2e-5)
    return truth, truth_metrics


# -- TRL's own code -------------------------------------------------------------------------------------------------


def trl_compute_loss(args, logps, entropies, inputs):
    """TRL 1.16's `GRPOTrainer._compute_loss`, run unchanged on a stand-in trainer whose model forward returns the
    given logps / entropies [B, T]: one process, no gradient accumulation, training mode. Returns (loss, metrics)."""
    from trl import GRPOTrainer

    sampler = "importance_sampling_ratio" in inputs
    trainer = SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, importance_sampling_level=args.importance_sampling_level,
        top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=None, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, use_vllm=sampler, vllm_importance_sampling_correction=sampler,
        current_gradient_accumulation_steps=1, model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, entropies, None),
    )
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


def trl_problem(seed, adv_per_token):
    """Per-token inputs in float64: logps [B, T] (finite everywhere, as a model's), old logps drifting per row so
    that w spans [1e-8, e^20] with both clamps hit (a token's log-ratio beyond 20, a sum beyond log 1e-8), the
    sampler's ratios (1 on masked positions, as TRL computes them; 0 on some tokens), advantages of both signs."""
    B, T = 7, 6
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2] = 0  # an all-masked row
    mask[5, 1:] = 0
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    drift = torch.tensor([-0.2, 0.15, 0.0, 0.9, -5.0, 0.05, 0.0], dtype=torch.float64)[:, None]
    old = logps + drift + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old[6, 2] = logps[6, 2] + 25.0  # one token's log-ratio below -20
    ref = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    iw = torch.exp(0.2 * torch.randn(B, T, generator=g, dtype=torch.float64))
    iw[0, 1] = iw[3, 3] = 0.0  # token_mask's rejected tokens
    iw = iw.masked_fill(mask == 0, 1.0)
    adv = torch.tensor([1.0, -0.8, 0.5, 0.7, -1.2, 0.0, 0.3], dtype=torch.float64)
    if adv_per_token:
        adv = adv[:, None] * (1 + torch.randn(B, T, generator=g, dtype=torch.float64))
    entropies = torch.rand(B, T, generator=g, dtype=torch.float64)
    return dict(logps=logps, mask=mask, old=old, ref=ref, iw=iw, adv=adv, entropies=entropies)


TRL_CASES = [
    pytest.param(options, level, beta, on_policy, sampler, adv_per_token,
                 id=f"{name}-{level}-beta{beta}-{'on' if on_policy else 'off'}{'-iw' if sampler else ''}"
                    f"{'-adv_per_token' if adv_per_token else ''}")
    for name, options, level, beta, on_policy, sampler, adv_per_token in [
        ("default", {}, "token", 0.0, False, False, False),
        ("default", {}, "token", 0.04, False, True, False),
        ("default", {}, "token", 0.04, True, False, False),
        ("default", {}, "token", 0.0, True, True, False),
        ("custom", CUSTOM, "token", 0.04, False, True, False),
        ("custom", CUSTOM, "token", 0.0, False, False, True),
        ("zero_k", ZERO_K, "token", 0.04, False, False, False),
        # TRL only warns here: VESPO's weight ignores the level, which changes just the KL's bias-correction ratio
        ("default", {}, "sequence", 0.04, False, True, False),
        ("custom", CUSTOM, "sequence", 0.04, False, False, True),
    ]
]


@pytest.mark.parametrize(("options", "level", "beta", "on_policy", "sampler", "adv_per_token"), TRL_CASES)
def test_reference_matches_trl(options, level, beta, on_policy, sampler, adv_per_token):
    """fastgrpo.reference.grpo_loss vs TRL's `_compute_loss` on the same float64 logprobs: loss, its gradient and
    the metrics. Same formulas in another summation order: within 1e-12 (fp64 rounding is ~1e-16 per op)."""
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False, loss_type="vespo", beta=beta,
                          importance_sampling_level=level, **options)
    config = LossConfig.from_trl(args)
    assert config.loss_type == "vespo" and all(getattr(config, k) == v for k, v in options.items())
    p = trl_problem(seed=len(options) + int(100 * beta), adv_per_token=adv_per_token)
    num_items = p["mask"].sum() + 5  # the generation batch's tokens, more than this micro-batch's
    inputs = {"prompt_ids": torch.zeros(7, 1, dtype=torch.long), "prompt_mask": torch.ones(7, 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(p["mask"]), "completion_mask": p["mask"], "advantages": p["adv"],
              "num_items_in_batch": num_items}
    if not on_policy:
        inputs["old_per_token_logps"] = p["old"]
    if beta:
        inputs["ref_per_token_logps"] = p["ref"]
    if sampler:
        inputs["importance_sampling_ratio"] = p["iw"]

    trl_logps = p["logps"].clone().requires_grad_()
    want, want_metrics = trl_compute_loss(args, trl_logps, p["entropies"], inputs)
    want.backward()

    logps = p["logps"].clone().requires_grad_()
    got, metrics = reference.grpo_loss(logps, p["mask"], p["adv"], old_logps=None if on_policy else p["old"],
                                       ref_logps=p["ref"] if beta else None, config=config,
                                       num_items_in_batch=num_items, entropies=p["entropies"],
                                       importance_weights=p["iw"] if sampler else None)
    got.backward()

    assert_close("loss", got.detach().reshape(1), want.detach().reshape(1), atol=1e-12, rtol=1e-12)
    assert_close("d logps", logps.grad, trl_logps.grad, atol=1e-12, rtol=1e-12)
    assert metrics.keys() == want_metrics.keys(), (sorted(metrics), sorted(want_metrics))
    for name, value in want_metrics.items():
        assert_close(f"metric {name}", metrics[name].reshape(1), torch.tensor([value], dtype=torch.float64),
                     atol=1e-12, rtol=1e-12)
    phi_is_one = metrics["vespo/phi_seq_mean"].item() == 1.0
    assert phi_is_one == (on_policy and not sampler), "phi is 1 exactly when no ratio moves w off 1"


def test_phi_matches_trls_helper():
    """vespo_weights equals TRL's `GRPOTrainer.get_gamma_weights`, and is detached, on float32 inputs that hit both
    clamps and an exp overflow of w's decay (phi 0)."""
    from trl import GRPOTrainer

    p = trl_problem(seed=3, adv_per_token=False)
    logps = p["logps"].float().requires_grad_()
    old, mask, iw, adv = p["old"].float(), p["mask"].float(), p["iw"].float(), p["adv"].float()[:, None]
    old[0] = logps[0].detach() - 10.0  # w = e^20 after the clamp: phi underflows to 0
    config = LossConfig(loss_type="vespo", **CUSTOM)
    options = dict(k_pos=1.5, lambda_pos=2.5, k_neg=0.75, lambda_neg=4.0)
    for weights in (None, iw):
        want = GRPOTrainer.get_gamma_weights(adv, logps - old, mask, weights, **options)
        got = reference.vespo_weights(logps, mask, adv, old, config, weights)
        assert not got.requires_grad and got.shape == (7, 1)
        assert_close("phi", got, want, atol=1e-6, rtol=1e-6)  # fp32: exp of log-phi near 20 in magnitude
        assert got[0].item() == 0.0


# -- the default path against the reference -------------------------------------------------------------------------

SHAPES = [(4, 9, 24, 150), (1, 1, 8, 33), (3, 17, 16, 257), (6, 5, 12, 64)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,T,H,V", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("on_policy,sampler", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["off", "on", "off-iw", "on-iw"])
def test_fused_matches_reference(monkeypatch, dtype, B, T, H, V, on_policy, sampler):
    p = vespo_problem(B, T, H, V, seed=B * T)
    config = LossConfig(loss_type="vespo", beta=0.04, **CUSTOM)
    truth, metrics = check(monkeypatch, dtype, p, config, on_policy=on_policy, sampler=sampler)
    assert truth["d_hidden"].abs().sum() > 0
    if on_policy and not sampler:
        assert metrics["vespo/phi_seq_mean"].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("options", [{}, CUSTOM, ZERO_K], ids=["default", "custom", "zero_k"])
def test_fused_per_token_advantages_and_sequence_level(monkeypatch, dtype, options):
    p = vespo_problem(4, 9, 24, 150, seed=7, adv_per_token=True)
    for level in ("token", "sequence"):
        config = LossConfig(loss_type="vespo", importance_sampling_level=level, beta=0.04, **options)
        check(monkeypatch, dtype, p, config, sampler=True)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
def test_fused_one_sign_of_advantage(monkeypatch, sign):
    """All advantages of one sign: only that sign's (k, lambda) act."""
    p = vespo_problem(4, 9, 24, 150, seed=2)
    p["adv"] = sign * (p["adv"].abs() + 0.1)
    check(monkeypatch, torch.float32, p, LossConfig(loss_type="vespo", **CUSTOM), sampler=True)


@pytest.mark.parametrize("chunk", ["3", "100000"])
def test_sequences_longer_than_a_chunk(monkeypatch, chunk):
    """Sequences longer than the chunk take two passes (their logprobs, then their logits again): the same result."""
    monkeypatch.setenv("FASTGRPO_CHUNK_TOKENS", chunk)
    check(monkeypatch, torch.float32, vespo_problem(3, 17, 16, 257, seed=5), LossConfig(loss_type="vespo", beta=0.04),
          sampler=True)


def test_whole_sequences_only_when_phi_reads_them(monkeypatch):
    """The default path keeps whole sequences in a chunk when phi reads their logprobs (off-policy) or the sampler's
    ratios; on-policy without them phi is 1 and tokens go chunk by chunk, one GEMM pass each."""
    seen = []
    units = grpo_head._units
    monkeypatch.setattr(grpo_head, "_units", lambda N, chunk, row_lengths: seen.append(row_lengths) or units(
        N, chunk, row_lengths))
    p = vespo_problem(4, 9, 24, 150, seed=1)
    config = LossConfig(loss_type="vespo")
    for on_policy, sampler in ((True, False), (False, False), (True, True)):
        run(monkeypatch, "chunked", torch.float32, p, config, on_policy=on_policy, sampler=sampler)
    lengths = (p["mask"] != 0).sum(-1)
    assert seen == [None] + [lengths[lengths > 0].tolist()] * 2


def test_masked_positions_are_ignored(monkeypatch):
    """Garbage (NaN, -inf, negative ratios) on masked positions of old, ref and the sampler's ratios changes nothing."""
    p = vespo_problem(4, 9, 24, 150, seed=4)
    masked = p["mask"] == 0
    clean = dict(p, old=p["old"].masked_fill(masked, 0.0), ref=p["ref"].masked_fill(masked, 0.0),
                 iw=p["iw"].masked_fill(masked, 1.0))
    config = LossConfig(loss_type="vespo", beta=0.04)
    for backend in ("chunked", "reference"):
        dirty, m1 = run(monkeypatch, backend, torch.float64, p, config, sampler=True)
        tidy, m2 = run(monkeypatch, backend, torch.float64, clean, config, sampler=True)
        for name in dirty:
            assert torch.equal(dirty[name], tidy[name]), name
        assert all(torch.equal(m1[k], m2[k]) for k in m1)


def test_deterministic(monkeypatch):
    p = vespo_problem(3, 17, 16, 257, seed=9)
    config = LossConfig(loss_type="vespo", beta=0.04)
    first, m1 = run(monkeypatch, "chunked", torch.float32, p, config, sampler=True)
    second, m2 = run(monkeypatch, "chunked", torch.float32, p, config, sampler=True)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert all(torch.equal(m1[k], m2[k]) for k in m1)


# -- options ---------------------------------------------------------------------------------------------------------


def test_loss_type_row_and_defaults_follow_trl():
    assert LOSS_TYPES["vespo"].policy == "vespo" and "vespo" in TOKEN_NORMALISED_LOSS_TYPES  # num_items_in_batch
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False)
    c = LossConfig()
    names = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    assert [getattr(c, n) for n in names] == [getattr(args, n) for n in names] == [2.0, 3.0, 3.0, 2.0]


def test_train_config_passes_the_options():
    from fastgrpo.train.config import TrainConfig

    train = TrainConfig(model_name_or_path="builtin", dataset_name="builtin", loss_type="vespo", **CUSTOM)
    config = train.loss_options()
    assert config.loss_type == "vespo" and all(getattr(config, k) == v for k, v in CUSTOM.items())


@pytest.mark.parametrize("field,value", [
    ("vespo_k_pos", -1.0), ("vespo_k_neg", float("nan")), ("vespo_k_pos", float("inf")),
    ("vespo_lambda_pos", 0.0), ("vespo_lambda_neg", -2.0), ("vespo_lambda_pos", float("inf")), ("vespo_k_neg", "3"),
])
def test_config_rejects(field, value):
    with pytest.raises((ValueError, TypeError)) as info:
        LossConfig(loss_type="vespo", **{field: value})
    message = str(info.value)
    assert field in message and "\n" not in message, message


@pytest.mark.parametrize("shape", [(4,), (4, 1)])
def test_per_sequence_importance_weights_are_refused(monkeypatch, shape):
    """VESPO folds the sampler's per-token log-ratios into w (TRL refuses its sequence_* sampling modes for it)."""
    p = vespo_problem(4, 9, 24, 150)
    p["iw"] = torch.ones(shape)
    with pytest.raises(ValueError, match=r"importance_weights must have shape \[4, 9\].*vespo"):
        run(monkeypatch, "chunked", torch.float32, p, LossConfig(loss_type="vespo"), sampler=True)


def test_compiled_is_one_graph_and_equals_eager(monkeypatch):
    """Under torch.compile every position is scored (padding weighed 0) and rows are whole: one graph, no break, and
    the eager result (aot_eager: the registered row ops' autograd without an Inductor compile)."""
    monkeypatch.setenv("FASTGRPO_BACKEND", "chunked")
    p = vespo_problem(3, 7, 16, 64, seed=6)
    config = LossConfig(loss_type="vespo", beta=0.04, **CUSTOM)

    def loss_and_grads(fn):
        x, w, b = leaf(p["hidden"], torch.float32), leaf(p["weight"], torch.float32), leaf(p["bias"], torch.float32)
        loss, metrics = fn(x, w, p["ids"], p["mask"], p["adv"], bias=b, old_logps=p["old"], ref_logps=p["ref"],
                           config=config, importance_weights=p["iw"])
        loss.backward()
        return [loss.detach(), x.grad, w.grad, b.grad, metrics["vespo/phi_seq_mean"]]

    torch._dynamo.reset()
    try:
        x, w, b = leaf(p["hidden"], torch.float32), leaf(p["weight"], torch.float32), leaf(p["bias"], torch.float32)
        explanation = torch._dynamo.explain(fused_grpo_loss)(x, w, p["ids"], p["mask"], p["adv"], bias=b,
                                                             old_logps=p["old"], ref_logps=p["ref"], config=config,
                                                             importance_weights=p["iw"])
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
        compiled = loss_and_grads(torch.compile(fused_grpo_loss, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    for name, got, want in zip(("loss", "d_hidden", "d_weight", "d_bias", "phi"), compiled,
                               loss_and_grads(fused_grpo_loss), strict=True):
        # fp32; the graph scores padding too (weighed 0), which regroups the sums over tokens: a few ulps
        assert_close(name, got, want, atol=1e-6, rtol=1e-6)
