"""`fastgrpo train`'s loss options beyond the plain objective, against TRL 1.16: models that scale or softcap their
logits, the entropy bonus (entropy_coef) and the truncated importance-sampling correction against the sampler's
logprobs (TRL's vllm_importance_sampling_*).

Gradients of one optimizer step (2 micro-batches) are compared with a float64 ground truth: a float64 copy of the
model scored through its own forward (full logits, its logit transform included), fastgrpo.reference's policy term,
and TRL's scaling across micro-batches and entropy bonus written out below. The tiny model and dataset are
conftest's `assets`.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from loss_helpers import GRAD_TOLERANCE, assert_close_gradients, largest_difference, padded
from train_helpers import make_config
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GenerationConfig,
    GraniteConfig,
    GraniteForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from fastgrpo import reference
from fastgrpo.loss import token_logprobs
from fastgrpo.loss_config import TOKEN_NORMALISED_LOSS_TYPES
from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.train import Trainer, arithmetic
from fastgrpo.train import trainer as trainer_module
from fastgrpo.train import update as update_module
from fastgrpo.train.config import IMPORTANCE_SAMPLING_MODES
from fastgrpo.train.loading import PLAIN_HEAD, check_head
from fastgrpo.train.policy_loss import completion_hidden, lm_head

ONE_STEP = dict(max_steps=1, save_steps=0, eval_num_samples=1, max_grad_norm=0.0)  # the raw gradient of one step
# The paged engine implements neither sliding windows nor attention softcapping: every layer full, no attention cap.
GEMMA2 = dict(head_dim=16, layer_types=["full_attention"] * 2, sliding_window=64, attn_logit_softcapping=None)
HEADS = {  # model, config options, the head fastgrpo must apply
    "gemma2 softcap": (Gemma2ForCausalLM, Gemma2Config, dict(GEMMA2, final_logit_softcapping=1.0),
                       {"logit_scale": 1.0, "logit_softcap": 1.0}),
    "cohere logit_scale": (CohereForCausalLM, CohereConfig, dict(logit_scale=0.25),
                           {"logit_scale": 0.25, "logit_softcap": None}),
    "granite logits_scaling": (GraniteForCausalLM, GraniteConfig, dict(logits_scaling=4.0),
                               {"logit_scale": 0.25, "logit_softcap": None}),
    # Qwen2's forward has no cap: a config.json carrying one does not change what the model samples.
    "qwen2 inert softcap": (Qwen2ForCausalLM, Qwen2Config, dict(final_logit_softcapping=1.0), PLAIN_HEAD),
}  # fmt: skip


def tiny_model(model_class, config_class, **options):
    tokenizer = arithmetic.build_tokenizer()
    torch.manual_seed(0)
    model = model_class(config_class(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **options,
    ))  # fmt: skip
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    return model, tokenizer


def one_step(config, monkeypatch, perturb: float = 0.0) -> dict:
    """Trains one round; returns its trainer, the gradient at the optimizer step, the micro-batches of the update,
    the rollout, the sampler's logprobs (with Gaussian noise of std `perturb` added) and the logged metrics."""
    trainer = Trainer(config)
    out = {"trainer": trainer, "gradients": [], "batches": [], "rollouts": [], "sampled": []}
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: out["gradients"].append([p.grad.clone() for p in trainer.parameters]) or step()
    make_batch = update_module.micro_batch

    def recording_micro_batch(*args):
        mb = make_batch(*args)
        if torch.is_grad_enabled():  # the update's; the old / reference logprobs run under no_grad
            out["batches"].append(mb)
        return mb

    monkeypatch.setattr(update_module, "micro_batch", recording_micro_batch)
    update = trainer._update
    trainer._update = lambda rollout: out["rollouts"].append(rollout) or update(rollout)
    generate, noise = trainer.engine.generate, torch.Generator().manual_seed(1)

    def noisy(prompts, n=1, params=None, group_ids=None):
        outputs = generate(prompts, n=n, params=params, group_ids=group_ids)
        if n > 1:  # the training round's (evaluation samples one completion per prompt)
            for c in (c for group in outputs for c in group):
                c.logprobs = [lp + perturb * float(torch.randn((), generator=noise)) for lp in c.logprobs]
                out["sampled"].append(torch.tensor(c.logprobs))
        return outputs

    trainer.engine.generate = noisy
    trainer.train()
    (out["gradient"],), (out["rollout"],) = out.pop("gradients"), out.pop("rollouts")
    out["metrics"] = trainer.log.history[-1]
    return out


def reference_gradients(config, run: dict, importance_weights=None) -> list[torch.Tensor]:
    """The float64 gradient of the run's optimizer step, TRL 1.16's way. importance_weights(micro_batch) -> its
    weights, or None."""
    model = AutoModelForCausalLM.from_pretrained(config.model_name_or_path, dtype=torch.float64)
    options = dataclasses.replace(config.loss_options(), entropy_coef=0.0)  # the policy term; the bonus is below
    accumulation = config.gradient_accumulation_steps
    # TRL's dapo / cispo normaliser: num_items_in_batch (the round's loss tokens) * accumulation / steps_per_generation
    tokens = sum(map(sum, run["rollout"].loss_mask))
    num_items = tokens * accumulation / config.steps_per_generation
    for mb in run["batches"]:
        T = mb.mask.shape[1]
        rows = [model(torch.tensor([s])).logits[0, p - 1 : len(s) - 1].div(config.temperature).log_softmax(-1)
                for s, p in zip(mb.sequences, mb.prompt_lengths, strict=True)]  # [T_i, V]
        all_logps = torch.stack([F.pad(r, (0, 0, 0, T - len(r))) for r in rows])  # [b, T, V]
        logps = all_logps.gather(-1, mb.completion_ids[..., None])[..., 0]  # [b, T]
        entropies = -(all_logps.exp() * all_logps).sum(-1)  # [b, T]
        mask = mb.mask.double()
        policy, _ = reference.grpo_loss(
            logps, mask, mb.advantages.double(), config=options,
            old_logps=None if mb.old_logps is None else mb.old_logps.double(),
            num_items_in_batch=num_items if config.loss_type in TOKEN_NORMALISED_LOSS_TYPES else None,
            importance_weights=None if importance_weights is None else importance_weights(mb),
        )  # fmt: skip
        if config.loss_type not in TOKEN_NORMALISED_LOSS_TYPES:
            policy = policy / accumulation
        # TRL: the bonus is the micro-batch's mean token entropy over the accumulation steps, for every loss type
        bonus = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        (policy - config.entropy_coef * bonus).backward()
    return [p.grad for p in model.parameters()]


def trl_importance_weights(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, vllm_importance_sampling_ratio, transcribed."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


# -- models that scale or softcap their logits --------------------------------------------------------------------


@pytest.mark.parametrize("name", HEADS)
def test_head_applies_the_transform_the_model_samples_with(name):
    """The engine samples from the model's own forward; the head must score the same logits, so the transform
    check_head returns reproduces the sampler's logprobs and the other one does not."""
    model_class, config_class, options, want = HEADS[name]
    model, _ = tiny_model(model_class, config_class, **options)
    assert check_head(model) == want
    params = SamplingParams(temperature=0.8, max_new_tokens=6, seed=1)
    prompts = [[3, 4, 5], [6, 7]]
    outputs = Engine(model, block_size=16).generate(prompts, n=3, params=params)
    weight, bias = lm_head(model)
    other = {"logit_scale": 1.0, "logit_softcap": options.get("final_logit_softcapping")} if want == PLAIN_HEAD else (
        PLAIN_HEAD)
    errors = {"want": 0.0, "other": 0.0}
    with torch.no_grad():
        for prompt, group in zip(prompts, outputs, strict=True):
            for c in group:
                hidden = completion_hidden(model, [prompt + c.token_ids], [len(prompt)], len(c.token_ids), False)
                for key, head in (("want", want), ("other", other)):
                    logps, _ = token_logprobs(hidden, weight, torch.tensor([c.token_ids]), bias=bias,
                                              temperature=params.temperature, **head)  # [1, T]
                    errors[key] = max(errors[key], float((logps[0] - torch.tensor(c.logprobs)).abs().max()))
    # fp32 on the CPU: the paged engine's attention and the training forward round differently, ~5e-7.
    assert errors["want"] < 1e-5 and errors["other"] > 1e-3, errors


class DoubledLogits(Qwen2ForCausalLM):
    """A model whose forward transforms its logits without its config saying so (as remote code may)."""

    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        outputs.logits = outputs.logits * 2
        return outputs


class HeadBypassed(Qwen2ForCausalLM):
    """A model whose forward multiplies by the head's weight without calling the head module."""

    def forward(self, input_ids, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state  # [B, L, H]
        return CausalLMOutputWithPast(logits=F.linear(hidden, self.lm_head.weight))


def test_transforms_the_loss_cannot_reproduce_are_refused():
    model, _ = tiny_model(Qwen2ForCausalLM, Qwen2Config, output_multiplier=2.0)
    with pytest.raises(ValueError, match=r"model_name_or_path: Qwen2ForCausalLM sets config.output_multiplier=2.0: "):
        check_head(model)
    model, _ = tiny_model(DoubledLogits, Qwen2Config)
    with pytest.raises(ValueError, match="model_name_or_path: DoubledLogits's forward transforms the logits of its "
                                         "lm_head otherwise than its config says"):
        check_head(model)
    model, _ = tiny_model(HeadBypassed, Qwen2Config)
    with pytest.raises(ValueError, match="model_name_or_path: HeadBypassed's forward does not call its lm_head module"):
        check_head(model)


@pytest.mark.slow
def test_softcapped_model_trains_with_its_cap(tmp_path, assets, monkeypatch):
    """A Gemma-2-like softcap flows into the old logprobs and the loss: the training forward's logprobs equal the
    sampler's, and one step's gradient equals the float64 truth (the model's own forward, cap included)."""
    model, tokenizer = tiny_model(Gemma2ForCausalLM, Gemma2Config, **GEMMA2, final_logit_softcapping=1.0)
    model.save_pretrained(tmp_path / "gemma2")
    tokenizer.save_pretrained(tmp_path / "gemma2")
    config = make_config({**assets, "model": str(tmp_path / "gemma2")}, tmp_path, importance_sampling_correction=True,
                         entropy_coef=0.5, **ONE_STEP)
    run = one_step(config, monkeypatch)
    assert run["trainer"].loss_options.logit_softcap == 1.0
    assert run["metrics"]["sampling/sampling_logp_difference/max"] < 1e-5
    assert_close_gradients(run["gradient"], reference_gradients(config, run, lambda mb: mb.importance_weights.double()))


# -- entropy bonus ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", pytest.param("dapo", marks=pytest.mark.slow)])
def test_entropy_bonus_gradient_matches_trl(assets, tmp_path, monkeypatch, loss_type):
    """2 micro-batches: the bonus is each one's mean token entropy over the accumulation steps (not over dapo's
    token normaliser)."""
    # 0.5: the bonus moves the gradient by far more than the tolerance (checked below)
    config = make_config(assets, tmp_path, loss_type=loss_type, entropy_coef=0.5, temperature=0.9, **ONE_STEP)
    run = one_step(config, monkeypatch)
    assert len(run["batches"]) == config.gradient_accumulation_steps == 2
    want = reference_gradients(config, run)
    assert_close_gradients(run["gradient"], want)
    without = reference_gradients(dataclasses.replace(config, entropy_coef=0.0), run)
    assert largest_difference(without, want) > 1000 * GRAD_TOLERANCE
    # TRL's policy_loss: each micro-batch's loss before the bonus, as its loss type normalises it (dapo's add up to
    # the step's, grpo's are divided by the accumulation steps after); loss is the step's, entropy a micro-batch mean.
    metrics, shares = run["metrics"], 1 if loss_type == "grpo" else config.gradient_accumulation_steps
    assert metrics["entropy"] > 0
    assert math.isclose(metrics["loss"], shares * metrics["policy_loss"] - config.entropy_coef * metrics["entropy"],
                        rel_tol=1e-5, abs_tol=1e-7)


# -- importance-sampling correction against the sampler ------------------------------------------------------------


def test_importance_sampling_on_policy_changes_nothing(assets, tmp_path, monkeypatch):
    """On the CPU the sampler's logprobs equal the training forward's to ~1e-6: the ratio is 1, and the step's loss
    and gradient equal the uncorrected ones."""
    plain = one_step(make_config(assets, tmp_path / "plain", **ONE_STEP), monkeypatch)
    corrected = one_step(make_config(assets, tmp_path / "corrected", importance_sampling_correction=True, **ONE_STEP),
                         monkeypatch)
    metrics = corrected["metrics"]
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-5
    for name in ("min", "mean", "max"):
        assert abs(metrics[f"sampling/importance_sampling_ratio/{name}"] - 1) < 1e-5
    assert math.isclose(metrics["loss"], plain["metrics"]["loss"], rel_tol=1e-5)
    assert largest_difference(corrected["gradient"], [g.double() for g in plain["gradient"]]) < 1e-5


@pytest.mark.parametrize("mode", [m if m == "token_truncate" else pytest.param(m, marks=pytest.mark.slow)
                                  for m in IMPORTANCE_SAMPLING_MODES])  # token_truncate in the fast run
def test_importance_weights_follow_trl_and_reach_the_loss(assets, tmp_path, monkeypatch, mode):
    """Noise on the sampler's logprobs: the weights equal TRL's formula (both bounds hit), their metrics TRL's, and
    the step's gradient the float64 truth weighted by them, far from the uncorrected one."""
    clip_min, clip_max = 0.5, 2.0
    config = make_config(assets, tmp_path, importance_sampling_correction=True, importance_sampling_mode=mode,
                         importance_sampling_clip_min=clip_min, importance_sampling_clip_max=clip_max, **ONE_STEP)
    run = one_step(config, monkeypatch, perturb=0.5)
    rollout = run["rollout"]
    assert all(torch.equal(a, b) for a, b in zip(rollout.sampling_logps, run["sampled"], strict=True))
    old, sampling, mask = padded(rollout.old_logps), padded(rollout.sampling_logps), padded(rollout.loss_mask)
    want = trl_importance_weights(old, sampling, mask, mode, clip_min, clip_max)  # [N, T] or [N, 1]
    got = rollout.importance_weights
    got = got[:, None] if mode.startswith("sequence") else padded(got)
    valid = (mask != 0) if mode.startswith("token") else torch.ones_like(got, dtype=torch.bool)
    assert torch.allclose(got[valid], want[valid], rtol=1e-6, atol=0), (got, want)
    hits = want[valid]
    if mode.endswith("truncate"):
        assert (hits == clip_min).any() and (hits == clip_max).any() and ((hits > clip_min) & (hits < clip_max)).any()
    else:
        assert (hits == 0).any() and (hits != 0).any()
    flat = want.flatten() if mode.startswith("sequence") else want[mask != 0]
    delta = (old - sampling).abs()[mask != 0]
    expected = {"importance_sampling_ratio/min": flat.min(), "importance_sampling_ratio/mean": flat.mean(),
                "importance_sampling_ratio/max": flat.max(), "sampling_logp_difference/mean": delta.mean(),
                "sampling_logp_difference/max": delta.max()}
    for name, value in expected.items():
        assert math.isclose(run["metrics"][f"sampling/{name}"], float(value), rel_tol=1e-6), name

    def trl_weights(mb):  # TRL's weights of the micro-batch's samples, padded to its length
        rows = want[mb.index]
        return rows.double() if mode.startswith("sequence") else rows[:, : mb.mask.shape[1]].double()

    truth = reference_gradients(config, run, trl_weights)
    assert_close_gradients(run["gradient"], truth)
    assert largest_difference(reference_gradients(config, run), truth) > 1000 * GRAD_TOLERANCE


# -- options ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, message", [
    ({"importance_sampling_mode": "token"}, "importance_sampling_mode must be one of"),
    ({"importance_sampling_clip_max": -1.0}, "importance_sampling_clip_max must be None or >= 0"),
    ({"importance_sampling_clip_min": 3.0}, r"importance_sampling_clip_min \(3.0\) must be less than"),
    ({"importance_sampling_correction": True, "importance_sampling_mode": "token_truncate",
      "importance_sampling_clip_max": None}, "needs importance_sampling_clip_min or importance_sampling_clip_max"),
    ({"entropy_coef": math.nan}, "entropy_coef must be finite"),
    ({"entropy_coef": "much"}, "entropy_coef must be float"),
])  # fmt: skip
def test_bad_loss_options_are_named(assets, tmp_path, bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_config(assets, tmp_path, **bad)


def test_options_reach_the_loss_options(assets, tmp_path):
    config = make_config(assets, tmp_path, entropy_coef=0.1, gradient_accumulation_steps=2)
    assert config.loss_options().entropy_coef == 0.1
    grpo = dataclasses.replace(config, loss_type="grpo")
    assert trainer_module.model_loss_options(grpo, PLAIN_HEAD).entropy_coef == 0.1
    # dapo's loss is not divided by the accumulation steps: its bonus coefficient is
    options = trainer_module.model_loss_options(config, {"logit_scale": 0.5, "logit_softcap": 30.0})
    assert (options.entropy_coef, options.logit_scale, options.logit_softcap) == (0.05, 0.5, 30.0)
