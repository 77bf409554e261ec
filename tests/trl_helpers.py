"""Helpers of the tests that compare fastgrpo's FastGRPOTrainer with stock trl.GRPOTrainer (tests/test_trl_trainer.py
explains the setup and the tolerances): a tiny fp32 Qwen2 saved offline, a recording trainer trained for two SGD steps
on TRL's own sampling, and the comparison of two such runs (completions, losses, first-step gradients, parameters,
loss metrics), with the largest differences seen kept in _MAX_DIFF."""

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
from helpers import tiny_config  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

# Both trainers run in fp32 on the same completions; they differ only in how the logprobs and the loss are summed
# (TRL: its chunked fused head dividing logits by T; fastgrpo: its chunked path multiplying
# by 1/T, other blockings), ~1e-7 relative per op, amplified at most ~10x through the log-softmax over V = 43 and
# sums over <= 128 tokens. Observed maxima (printed at module teardown with -s): losses and metrics use <= 0.3 of
# their tolerance, first-step gradients differ by <= 7e-7 x max|grad|, parameters after two
# steps by <= 2e-7.
# - Losses: rtol 1e-5 / atol 1e-6 (the atol covers losses that are ~0 because the group advantages sum to 0).
# - Gradients at the first step: per parameter, max|diff| <= 1e-5 x max|TRL's gradient| (entries near
#   cancellation carry large relative error, so the bound scales with the largest entry, as in test_trl_parity).
# - Parameters after two steps: max|diff| <= 1e-5 absolute. With lr = LR, two steps move some weight of every case
#   by 5e-3 to 7e-2 (checked: > 100 x the tolerance), so a formula difference (a wrong normaliser, a missing
#   mask) shows up far above it, while gradient differences of ~1e-6 relative move the runs apart by ~1e-7. LR is
#   small because the tiny model is sensitive (its std-0.02 embeddings set the direction of the normalised residual
#   stream): at lr 0.01 one case's first step moved logprobs by several nats, its k3 KL reached ~700 and the two
#   runs ended 1.6e-5 apart, rounding amplified by an ill-conditioned second step rather than a formula difference.
# - Metrics: rtol 1e-5 / atol 1e-6 as the losses (they are means of the same per-token quantities).
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_REL = 1e-5
PARAM_ATOL = 1e-5
LR = 0.003

VOCAB_WORDS = 40  # + 3 special tokens: EOS (id 1) is sampled often enough that completions of every length occur
PAD_ID, EOS_ID = 0, 1
MAX_COMPLETION_LENGTH = 8
BATCH, GROUP = 4, 4  # per-device batch (micro-batch) and completions per prompt
METRIC_PREFIXES = ("kl", "entropy", "clip_ratio/", "cispo_clip_ratio", "vespo/")

# Per loss type: GRPOConfig options beyond the axes (each a LossConfig field of the same meaning).
EXTRA = {
    "grpo": {"epsilon": 0.2, "delta": 1.5, "temperature": 0.7},
    "bnpo": {"epsilon": 0.1},
    "dr_grpo": {"epsilon": 0.2, "epsilon_high": 0.25},
    "dapo": {"epsilon": 0.2, "epsilon_high": 0.28},
    "luspo": {"epsilon": 0.15, "temperature": 1.3},
    "cispo": {"epsilon": 0.2, "epsilon_high": 1.1, "temperature": 0.7},  # epsilon_high is CISPO's ratio cap
    "sapo": {"sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.2},
    "vespo": {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 0.75, "vespo_lambda_neg": 4.0},
}


# quantity -> max difference seen (grad_rel: / max|grad|; x/tol: the fraction of the tolerance used), printed at
# module teardown (visible with -s).
_MAX_DIFF = {}


def _record(what, value):
    _MAX_DIFF[what] = max(_MAX_DIFF.get(what, 0.0), value)


def _tolerance_used(got, want):
    """max |got - want| / (atol + rtol |want|) under LOSS_TOL: 1 is the limit (NaN pairs count as 0)."""
    used = (got.double() - want.double()).abs() / (LOSS_TOL["atol"] + LOSS_TOL["rtol"] * want.double().abs())
    return used.nan_to_num(0.0).max().item()


def _save_tiny_qwen2(path, tokenizer, head_std=0.5, tie_word_embeddings=False):
    """A tiny fp32 Qwen2 with lm_head weights of std head_std, and the tokenizer, saved offline to path."""
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = tiny_config(Qwen2Config, len(tokenizer))
    config.tie_word_embeddings = tie_word_embeddings
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # a non-trivial head: random init std 0.02 makes every distribution almost uniform
        model.lm_head.weight.normal_(0.0, head_std)
    model.save_pretrained(path)


def _reward(completion_ids, **kwargs):
    """A rule reward that varies within each group: the fraction of words with an id divisible by 3."""
    return [sum(i % 3 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def _dataset(n=8):
    """n prompts of 1 to 4 words (so that they are left-padded)."""
    return datasets.Dataset.from_dict({"prompt": [" ".join(f"w{(7 * i + j) % VOCAB_WORDS}" for j in range(1 + i % 4))
                                                  for i in range(n)]})


def _config(path, **options):
    defaults = dict(
        output_dir=str(path / "out"), per_device_train_batch_size=BATCH, num_generations=GROUP,
        max_completion_length=MAX_COMPLETION_LENGTH, max_steps=2, optim="sgd", learning_rate=LR,
        lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
        logging_steps=1, seed=0,
    )
    return GRPOConfig(**{**defaults, **options})


class _FirstGradients(TrainerCallback):
    """Copies every parameter's gradient just before the first optimizer step (after accumulation)."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: _whole(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _whole(t):
    """A tensor's whole value: FSDP2's sharded parameters and gradients gathered (a collective), others as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _recording(cls):
    """cls recording what a run must agree on: micro-step losses, completions, the token masks TRL computes."""

    class Recording(cls):
        def __init__(self, *args, **kwargs):
            self.losses, self.completions, self.masks = [], [], []
            super().__init__(*args, **kwargs)

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(loss.item())
            return loss

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            self.completions.append([list(ids) for ids in completion_ids_list])
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

        def get_high_entropy_mask(self, entropies, mask, threshold):
            keep = super().get_high_entropy_mask(entropies, mask, threshold)
            self.masks.append(("entropy", keep.clone(), mask.bool()))
            return keep

        def get_off_policy_mask(self, advantages, per_token_logps, sampling_per_token_logps, mask,
                                off_policy_threshold):
            keep = cls.get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                           off_policy_threshold)
            self.masks.append(("off_policy", keep.clone(), mask.sum(1, keepdim=True) > 0))
            return keep

    return Recording


def _train(path, tokenizer, trainer_cls, model=None, train=True, **kwargs):
    """A (recording) trainer_cls trained for two steps; kwargs: GRPOConfig options and trainer arguments."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("peft_config", "eval_dataset", "processing_class")}
    kwargs.setdefault("processing_class", tokenizer)
    gradients = _FirstGradients()
    trainer = _recording(trainer_cls)(
        model=model or Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32), reward_funcs=_reward,
        args=_config(path, **options), train_dataset=_dataset(), callbacks=[gradients], **kwargs,
    )
    if train:
        trainer.train()
    trainer.first_grads = gradients.grads
    return trainer


def _loss_metrics(trainer):
    """The logged loss metrics per optimizer step: [{name: value}]."""
    rows = [{k: v for k, v in log.items() if k.startswith(METRIC_PREFIXES)} for log in trainer.state.log_history]
    return [row for row in rows if row]


def _assert_mixed_lengths(completions):
    lengths = [len(ids) for batch in completions for ids in batch]
    assert min(lengths) < MAX_COMPLETION_LENGTH == max(lengths), f"want finished and truncated completions: {lengths}"


def _assert_same_training(stock, fast, initial, mixed_lengths=True):
    """Completions, micro-step losses, first-step gradients, final parameters and loss metrics all agree."""
    assert stock.completions and fast.completions == stock.completions, "the completions differ"
    if mixed_lengths:
        _assert_mixed_lengths(stock.completions)

    assert len(fast.losses) == len(stock.losses) == 2 * stock.args.gradient_accumulation_steps
    # (On-policy grpo / luspo / sapo losses are ~0 in value, the group advantages summing to 0; their gradients
    # are not, which the parameter check below makes sure of.)
    losses, stock_losses = (torch.tensor(run.losses, dtype=torch.float64) for run in (fast, stock))
    _record("loss", (losses - stock_losses).abs().max().item())
    _record("loss/tol", _tolerance_used(losses, stock_losses))
    torch.testing.assert_close(losses, stock_losses, **LOSS_TOL)

    assert fast.first_grads.keys() == stock.first_grads.keys() and stock.first_grads
    for name, want in stock.first_grads.items():
        diff, scale = (fast.first_grads[name] - want).abs().max().item(), want.abs().max().item()
        _record("grad_rel", diff / max(scale, 1e-30))
        assert diff <= GRAD_REL * scale, f"grad of {name}: max|diff| {diff:.3e} > {GRAD_REL} * max|grad| {scale:.3e}"

    moved = 0.0
    fast_params = {name: _whole(p) for name, p in fast.model.named_parameters()}
    for name, p in stock.model.named_parameters():
        p = _whole(p)
        diff = (fast_params[name] - p).abs().max().item()
        moved = max(moved, (p - initial[name]).abs().max().item())
        _record("param", diff)
        assert diff <= PARAM_ATOL, f"{name} after two steps: max|diff| {diff:.3e} > {PARAM_ATOL}"
    assert moved > 100 * PARAM_ATOL, f"the parameters barely moved ({moved:.1e}): the comparison would be vacuous"

    metrics, stock_metrics = _loss_metrics(fast), _loss_metrics(stock)
    assert len(stock_metrics) == 2 and [m.keys() for m in metrics] == [m.keys() for m in stock_metrics]
    for step, (got, want) in enumerate(zip(metrics, stock_metrics, strict=True)):
        for name, value in want.items():
            _record("metric/tol", _tolerance_used(torch.tensor(got[name]), torch.tensor(value)))
            torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(value), equal_nan=True,
                                       msg=lambda m, name=name, step=step: f"step {step} {name}: {m}", **LOSS_TOL)
    return stock_metrics


def _initial(path):
    return dict(Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
