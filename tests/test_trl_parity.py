"""Parity with TRL 1.16: `trl.GRPOTrainer._compute_loss` and `fastgrpo.loss.fused_grpo_loss` on the same inputs.

A tiny fp32 Qwen2 model and a word-level tokenizer are built offline and saved to a temporary folder; one
`GRPOTrainer` is built per case (construction takes ~20 ms here). The batch is written by hand (left-padded prompts,
right-padded completions, one empty completion, mixed-sign advantages), and TRL's loss, logged metrics and
parameter gradients are compared with fastgrpo's, computed from the same model's backbone hidden states and lm_head.

Each case fixes one loss type, beta (0, or 0.04 with `ref_per_token_logps`), importance_sampling_level and policy
("on": no `old_per_token_logps`; "off": `old_per_token_logps` perturbed far enough from the policy to clip). Each runs
on fastgrpo's default path (on the CPU: PyTorch row passes), the "reference" backend and, where CUDA is available,
the default path on a CUDA copy of the model (cuBLAS GEMMs and the Triton row kernels; skipped without CUDA).
"""

import copy

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
from helpers import tiny_config, torch_threads, word_tokenizer  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fastgrpo.loss import LossConfig, fused_grpo_loss  # noqa: E402
from fastgrpo.loss_config import LOSS_TYPES  # noqa: E402
from fastgrpo.reference import token_logprobs  # noqa: E402

# Both sides are fp32 throughout. TRL scores tokens with its own chunked fused head (dividing the logits by the
# temperature) and fastgrpo with its chunked path / full logits (multiplying by 1/T, other
# matmul blockings), so they differ only by fp32 rounding: ~1e-7 relative per op, amplified at most ~10x through the
# log-softmax over V ~ 300 and the sums over ~25 tokens. rtol 1e-5 / atol 1e-6 leaves ~10x margin above that while any
# formula difference (normaliser, mask, clipping, KL correction) shows up at >= 1e-3. Gradients go through the
# softmax Jacobian and the 2-layer backbone's backward, summed in different orders: their rounding error scales with
# the largest terms summed, not with each entry (entries near cancellation carry large *relative* error), so each
# parameter's gradient is compared as max|diff| <= GRAD_REL * max|TRL's gradient| (observed: ~2.5e-6).
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_REL = 2e-5
# On a GPU, the backbone copy runs cuBLAS / SDPA fp32 kernels with other reduction orders (TF32 off: torch's default),
# so the CUDA variant allows more rounding, still far below a formula error.
CUDA_LOSS_TOL = {"rtol": 1e-4, "atol": 1e-5}
CUDA_GRAD_REL = 1e-3

VOCAB_WORDS = 293  # + 3 special tokens = 296
PAD_ID, EOS_ID = 0, 1
B, P, T = 6, 5, 7  # batch, prompt length, completion length
MAX_COMPLETION_LENGTH = 8  # dr_grpo's normaliser; deliberately != T
PROMPT_PAD = [0, 2, 0, 1, 3, 0]  # left padding per prompt
COMPLETION_LENGTHS = [7, 5, 1, 0, 3, 6]  # one empty completion (all masked), one full
ADVANTAGES = [1.0, -0.8, 0.5, 0.7, -1.2, 0.0]
# Per-row mean of old - current logprobs in the off-policy cases, so that the per-sequence ratios exp(-drift) land in
# every branch: row 0 clipped high (A > 0), row 1 clipped low (A < 0), row 4 above delta = 1.5 with A < 0 (two-sided
# clipping), rows 2-3 inside the trust region. Zero-mean per-token noise on top spreads the token-level ratios.
OLD_ROW_DRIFT = [-0.3, 0.4, 0.0, 0.05, -0.5, 0.2]

# Per loss type: TRL config options beyond the shared ones; each maps to the LossConfig field of the same meaning.
EXTRA = {
    "grpo": {"epsilon": 0.2, "delta": 1.5, "temperature": 0.7},
    "bnpo": {"epsilon": 0.1},
    "dr_grpo": {"epsilon": 0.2, "epsilon_high": 0.25},
    "dapo": {"epsilon": 0.2, "epsilon_high": 0.28},
    "luspo": {"epsilon": 0.15, "temperature": 1.3},
    "cispo": {"epsilon": 0.2, "epsilon_high": 1.25, "temperature": 0.7},  # epsilon_high is CISPO's ratio cap
    "sapo": {"epsilon": 0.2, "sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.2},
    "vespo": {"epsilon": 0.2},
}
BACKENDS = ["auto", "reference", "cuda"]

CASES = [
    pytest.param(loss_type, beta, level, policy, id=f"{loss_type}-beta{beta}-{level}-{policy}")
    for loss_type in LOSS_TYPES
    for beta in (0.0, 0.04)
    for level in ("token", "sequence")
    for policy in ("on", "off")
]

# (backend, quantity) -> max |fastgrpo - TRL| seen (grad_rel: relative to max|grad|; loss/tol: the fraction of the
# loss tolerance used), printed at module teardown (visible with -s).
_MAX_DIFF = {}


def _record(backend, what, a, b):
    diff = (torch.as_tensor(a, dtype=torch.float64).cpu() - torch.as_tensor(b, dtype=torch.float64).cpu()).abs()
    diff = diff[~torch.isnan(diff)]
    value = diff.max().item() if diff.numel() else 0.0
    key = (backend, what)
    _MAX_DIFF[key] = max(_MAX_DIFF.get(key, 0.0), value)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_max_diffs():
    # The tensors here are tiny: intra-op threads only add OpenMP spin-waits, which made this module ~7x slower on a
    # 2-core machine with one other busy process.
    with torch_threads(1):
        yield
    if _MAX_DIFF:
        print("\nTRL parity, max |fastgrpo - TRL| (grad_rel: / max|grad|; loss/tol: / tolerance):")
        for (backend, what), value in sorted(_MAX_DIFF.items()):
            print(f"  {backend:>10} {what:<8} {value:.3e}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny fp32 Qwen2 and a word-level tokenizer, saved offline to a temporary folder."""
    path = tmp_path_factory.mktemp("trl_parity")
    tokenizer = word_tokenizer(VOCAB_WORDS)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(Qwen2Config, len(tokenizer), PAD_ID, EOS_ID)).float()
    with torch.no_grad():  # a non-trivial head: random init std 0.02 makes every distribution almost uniform
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path, tokenizer


@pytest.fixture(scope="module")
def batch():
    """The hand-written GRPO batch (the keys TRL's `_compute_loss` reads) and noise for old / ref logprobs."""
    gen = torch.Generator().manual_seed(1234)
    prompt_ids = torch.randint(3, VOCAB_WORDS + 3, (B, P), generator=gen)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    for row, pad in enumerate(PROMPT_PAD):
        prompt_ids[row, :pad] = PAD_ID
        prompt_mask[row, :pad] = 0
    completion_ids = torch.randint(3, VOCAB_WORDS + 3, (B, T), generator=gen)
    completion_mask = torch.zeros(B, T, dtype=torch.long)
    for row, length in enumerate(COMPLETION_LENGTHS):
        completion_mask[row, :length] = 1
        if 0 < length < T:
            completion_ids[row, length - 1] = EOS_ID
        completion_ids[row, length:] = PAD_ID
    old_noise = 0.5 * torch.randn(B, T, generator=gen)
    row_mean = lambda x: (x * completion_mask).sum(-1, keepdim=True) / completion_mask.sum(-1, keepdim=True).clamp(1)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGES),
        # Off-policy drift, large enough that ratios leave [1 - eps, 1 + eps] both ways, also per sequence.
        "old_noise": old_noise - row_mean(old_noise) + torch.tensor(OLD_ROW_DRIFT)[:, None],
        "ref_noise": 0.3 * torch.randn(B, T, generator=gen),
        # Masked positions of old / ref logprobs hold arbitrary finite values: both sides must ignore them.
        "masked_fill": -torch.rand(B, T, generator=gen),
    }


def _backbone_hidden(model, batch):
    """The hidden states that predict each completion token, computed as TRL's fused head computes them."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1).to(model.device)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).to(model.device)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return hidden[:, P - 1 : P + T - 1]


def _param_grads(model):
    return {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """fastgrpo's backend: the FASTGRPO_BACKEND value (None: unset) and the device fastgrpo's side runs on."""
    name = request.param
    if name == "auto":
        monkeypatch.delenv("FASTGRPO_BACKEND", raising=False)
        return name, torch.device("cpu")
    if name == "reference":
        monkeypatch.setenv("FASTGRPO_BACKEND", "reference")
        return name, torch.device("cpu")
    if not torch.cuda.is_available():  # cuda: the default path on a CUDA copy of the model
        pytest.skip("needs CUDA")
    monkeypatch.delenv("FASTGRPO_BACKEND", raising=False)
    return name, torch.device("cuda")


def _check_parity(workdir, batch, backend, loss_type, beta, level, policy, num_items_in_batch):
    """TRL's `_compute_loss` vs `fused_grpo_loss`: loss, logged metrics and every parameter's gradient."""
    path, tokenizer = workdir
    backend_name, device = backend
    extra = EXTRA[loss_type]
    args = GRPOConfig(
        output_dir=str(path / "out"), per_device_train_batch_size=B, num_generations=3,
        gradient_accumulation_steps=1, steps_per_generation=1, max_completion_length=MAX_COMPLETION_LENGTH,
        loss_type=loss_type, beta=beta, importance_sampling_level=level, use_bias_correction_kl=True,
        report_to=[], use_cpu=True, bf16=False, save_strategy="no", logging_strategy="no", seed=0, **extra,
    )
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5"] * 3}), processing_class=tokenizer,
    )
    model = trainer.model
    model.train()
    # Set by Trainer's training loop: 1 with no accumulation, so TRL's loss is one micro-batch's, unscaled.
    trainer.current_gradient_accumulation_steps = 1
    assert trainer.args.steps_per_generation == 1 and trainer.accelerator.num_processes == 1

    config = LossConfig(
        loss_type=loss_type, epsilon_low=extra["epsilon"], epsilon_high=extra.get("epsilon_high"),
        delta=extra.get("delta"), beta=beta, temperature=extra.get("temperature", 1.0),
        importance_sampling_level=level, use_bias_correction_kl=True, max_completion_length=MAX_COMPLETION_LENGTH,
        sapo_temperature_pos=extra.get("sapo_temperature_pos", 1.0),
        sapo_temperature_neg=extra.get("sapo_temperature_neg", 1.05),
    )
    assert (trainer.temperature, trainer.epsilon_low, trainer.epsilon_high) == (
        config.temperature, config.epsilon_low, config.epsilon_high)

    mask = batch["completion_mask"]
    with torch.no_grad():
        logps_now, _ = token_logprobs(_backbone_hidden(model, batch), model.lm_head.weight,
                                      batch["completion_ids"], temperature=config.temperature)
    shifted = lambda noise: torch.where(mask.bool(), logps_now + noise, batch["masked_fill"])
    old_logps = shifted(batch["old_noise"]) if policy == "off" else None
    ref_logps = shifted(batch["ref_noise"]) if beta != 0.0 else None

    # -- TRL --
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    inputs["num_items_in_batch"] = num_items_in_batch
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    trainer._metrics["train"].clear()
    model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = _param_grads(model)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert all(len(v) == 1 for v in trainer._metrics["train"].values())

    # -- fastgrpo --
    ours_model = model if device.type == "cpu" else copy.deepcopy(model).to(device)
    ours_model.zero_grad(set_to_none=True)
    to = lambda t: None if t is None else t.to(device)
    loss, metrics = fused_grpo_loss(
        _backbone_hidden(ours_model, batch), ours_model.lm_head.weight, to(batch["completion_ids"]), to(mask),
        to(batch["advantages"]), old_logps=to(old_logps), ref_logps=to(ref_logps), config=config,
        num_items_in_batch=to(num_items_in_batch),
    )
    loss.backward()
    grads = _param_grads(ours_model)

    loss_tol, grad_rel = (LOSS_TOL, GRAD_REL) if device.type == "cpu" else (CUDA_LOSS_TOL, CUDA_GRAD_REL)
    _record(backend_name, "loss", loss.detach(), trl_loss.detach())
    _record(backend_name, "loss/tol", (loss.detach().cpu() - trl_loss.detach()).abs()
            / (loss_tol["atol"] + loss_tol["rtol"] * trl_loss.detach().abs()), 0.0)
    torch.testing.assert_close(loss.detach().cpu(), trl_loss.detach(), **loss_tol)

    assert set(metrics) == set(trl_metrics), f"metric names: fastgrpo {sorted(metrics)}, TRL {sorted(trl_metrics)}"
    for name, trl_value in trl_metrics.items():
        _record(backend_name, "metrics", metrics[name], trl_value)
        torch.testing.assert_close(metrics[name].double().cpu(), torch.tensor(trl_value, dtype=torch.float64),
                                   equal_nan=True, msg=lambda m, name=name: f"metric {name}: {m}", **loss_tol)

    assert set(grads) == set(trl_grads)
    for name, trl_grad in trl_grads.items():
        scale = trl_grad.abs().max().item()
        diff = (grads[name] - trl_grad).abs().max().item()
        _record(backend_name, "grad_rel", diff / max(scale, 1e-30), 0.0)
        assert diff <= grad_rel * scale, f"grad of {name}: max|diff| {diff:.3e} > {grad_rel} * max|grad| {scale:.3e}"
    assert trl_grads["lm_head.weight"].abs().max() > 0

    return trl_metrics


@pytest.mark.parametrize(("loss_type", "beta", "level", "policy"), CASES)
def test_compute_loss_matches_trl(workdir, batch, backend, loss_type, beta, level, policy):
    metrics = _check_parity(workdir, batch, backend, loss_type, beta, level, policy, batch["completion_mask"].sum())
    # The off-policy cases must exercise the clipping branches (else the clip metrics and min() are untested).
    if policy == "off" and loss_type not in ("sapo", "vespo"):
        if loss_type == "cispo":
            assert metrics["cispo_clip_ratio"] > 0, metrics
        else:
            assert metrics["clip_ratio/high_mean"] > 0 and metrics["clip_ratio/low_mean"] > 0, metrics


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_num_items_in_batch_normalises_like_trl(workdir, batch, backend, loss_type):
    """dapo / cispo divide by `num_items_in_batch` (TRL: times num_processes * steps_per_generation / accumulation
    steps, all 1 here), not by the batch's own token count: pass a count other than `completion_mask.sum()`."""
    num_items = batch["completion_mask"].sum() * 3 + 1
    _check_parity(workdir, batch, backend, loss_type, 0.04, "token", "off", num_items)
