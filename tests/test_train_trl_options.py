"""TRL 1.16's loss-side options in `fastgrpo train` and in the drop-in: top_entropy_quantile (the policy term on the
highest-entropy tokens only), off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence mask) and adaptive
entropy control (use_adaptive_entropy, entropy_target, entropy_coef_min / _max / _delta).

The ground truth is TRL's own `GRPOTrainer._compute_loss`, run unchanged on a stand-in trainer (`trl_stand_in`): its
get_high_entropy_mask, get_off_policy_mask, entropy bonus and adaptive controller.
- The loss: `masked_grpo_loss` on the same float64 logprobs and entropies (loss, both gradients, metrics).
- The controller: the coefficient applied and logged over ten optimizer steps that cross the target both ways and
  hit both bounds.
- `fastgrpo train`: every optimizer step's gradient equals TRL's loss on a float64 copy of the model at that step
  (its own forward, full logits); the controller's state, the logged metric names, bad values, resume.
- Two processes train as one (slow).
- The drop-in against stock TRL, compared as tests/test_trl_trainer.py compares them.
"""

import dataclasses
import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from loss_helpers import GRAD_TOLERANCE, assert_close_gradients, largest_difference, padded
from train_helpers import assert_same_metrics, killed_then_resumed, make_config
from transformers import AutoModelForCausalLM

from fastgrpo.loss_config import TOKEN_NORMALISED_LOSS_TYPES, LossConfig
from fastgrpo.train import Trainer
from fastgrpo.train import update as update_module
from fastgrpo.train.logs import read_metrics
from fastgrpo.train.policy_loss import BONUS_ENTROPY, EntropyControl, TokenMasks, masked_grpo_loss

trl = pytest.importorskip("trl")

# The same float64 formulas as TRL's, summed in another order: ~1e-16 per op (as tests/test_vespo.py).
EXACT = dict(atol=1e-12, rtol=1e-12)


def trl_stand_in(args, accumulation: int = 1):
    """What TRL 1.16's `GRPOTrainer._compute_loss` reads of its trainer, for one process in training mode, with the
    model's forward replaced: set `.forward = (logps, entropies)` [B, T] before each `.compute_loss(inputs)`, and
    `.accelerator.sync_gradients` on the last micro-batch of an optimizer step. `args`: a GRPOConfig, or a TrainConfig
    (the same names). The masks TRL computes are recorded in `.masks`: (kind, keep, the tokens or rows it rules)."""
    from trl import GRPOTrainer

    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda t, reduction: t,
                                  gather=lambda t: t, gather_for_metrics=lambda t: t,
                                  pad_across_processes=lambda t, dim, pad_index: t)
    stand_in = SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        max_completion_length=args.max_completion_length, importance_sampling_level=args.importance_sampling_level,
        top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=args.off_policy_mask_threshold,
        entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy, _last_world_entropy=math.inf,
        _entropy_window_stats=None, aux_loss_enabled=False, use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=accumulation, model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)}, accelerator=accelerator, forward=None, masks=[],
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
    )  # fmt: skip

    def high_entropy_mask(entropies, mask, threshold):
        keep = GRPOTrainer.get_high_entropy_mask(stand_in, entropies, mask, threshold)
        stand_in.masks.append(("entropy", keep, mask.bool()))
        return keep

    def off_policy_mask(**kwargs):
        keep, mask = GRPOTrainer.get_off_policy_mask(**kwargs), kwargs["mask"].bool()
        stand_in.masks.append(("off_policy", keep, mask if keep.shape[1] > 1 else mask.any(1, keepdim=True)))
        return keep

    stand_in.get_high_entropy_mask, stand_in.get_off_policy_mask = high_entropy_mask, off_policy_mask
    stand_in._get_per_token_logps_and_entropies = lambda *args, **kwargs: (*stand_in.forward, None)
    stand_in.compute_loss = lambda inputs: GRPOTrainer._compute_loss(stand_in, None, inputs)
    return stand_in


def assert_masks_acted(stand_in, kinds: int) -> None:
    """Each kind of mask TRL computed kept some of the tokens / rows it ruled and dropped others, over all its calls."""
    kept, ruled = defaultdict(int), defaultdict(int)
    for kind, keep, region in stand_in.masks:
        kept[kind] += int((keep.bool() & region).sum())
        ruled[kind] += int(region.sum())
    assert len(kept) == kinds and all(0 < kept[kind] < ruled[kind] for kind in kept), (dict(kept), dict(ruled))


def grpo_config(**options):
    return trl.GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False, **options)


# -- the loss ------------------------------------------------------------------------------------------------------


def loss_problem(seed: int, adv_per_token: bool = False) -> dict:
    """float64 per-token inputs [B, T]: logprobs, entropies (finite garbage off the mask, which must not matter), a
    mask with padded tails and an all-masked row, old and sampling logprobs drifting per row (the negative-advantage
    rows' KL falls on both sides of a threshold of 0.1 for each), reference logprobs, advantages of both signs."""
    B, T = 6, 8
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2] = 0
    mask[4, 2:] = 0
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    entropies = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    adv = torch.tensor([1.0, -0.7, 0.4, -1.1, 0.6, -0.2], dtype=torch.float64)
    if adv_per_token:
        adv = adv[:, None] * (1 + 0.5 * randn(B, T))
    drift = lambda *rows: torch.tensor(rows, dtype=torch.float64)[:, None] + 0.02 * randn(B, T)  # KL per row
    return dict(logps=logps, entropies=entropies, mask=mask, adv=adv, old=logps + drift(0.3, 0.4, 0, -0.2, 0.2, 0.03),
                sampling=logps + drift(-0.3, 0.05, 0, 0.5, 0.1, -0.4), ref=logps + 0.2 * randn(B, T))


def fastgrpo_loss(args, p, masks: TokenMasks, on_policy: bool, sampler: bool, num_items):
    """masked_grpo_loss of problem `p` with TRL's `args`: (loss, metrics, d logps, d entropies)."""
    logps, entropies = p["logps"].clone().requires_grad_(), p["entropies"].clone().requires_grad_()
    masks = dataclasses.replace(masks, sampling_logps=p["sampling"] if sampler else None)
    loss, metrics = masked_grpo_loss(
        logps, entropies, p["mask"], p["adv"], masks=masks, config=LossConfig.from_trl(args),
        old_logps=None if on_policy else p["old"], ref_logps=p["ref"] if args.beta else None,
        num_items_in_batch=num_items if args.loss_type in TOKEN_NORMALISED_LOSS_TYPES else None,
    )  # fmt: skip
    loss.backward()
    return loss.detach(), metrics, logps.grad, entropies.grad


def trl_inputs(p, on_policy: bool, sampler: bool, num_items) -> dict:
    B = p["mask"].shape[0]
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(p["mask"]), "completion_mask": p["mask"], "advantages": p["adv"],
              "num_items_in_batch": num_items, "ref_per_token_logps": p["ref"]}
    if not on_policy:
        inputs["old_per_token_logps"] = p["old"]
    if sampler:
        inputs["sampling_per_token_logps"] = p["sampling"]
    return inputs


LOSS_CASES = {  # name: (GRPOConfig options, on-policy, the sampler's logprobs given, per-token advantages)
    "grpo-top20": (dict(loss_type="grpo", top_entropy_quantile=0.2), False, False, False),
    "dapo-top50-bonus-kl": (dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.3, beta=0.04), False,
                            False, False),
    "bnpo-top0-bonus-sequence": (dict(loss_type="bnpo", top_entropy_quantile=0.0, entropy_coef=0.2,
                                      importance_sampling_level="sequence"), False, False, False),
    "dr_grpo-off-policy-old": (dict(loss_type="dr_grpo", off_policy_mask_threshold=0.1), False, False, False),
    "cispo-off-policy-sampler-bonus": (dict(loss_type="cispo", off_policy_mask_threshold=0.1, entropy_coef=0.1,
                                            epsilon_high=1.5), True, True, False),
    "sapo-both-bonus": (dict(loss_type="sapo", top_entropy_quantile=0.4, off_policy_mask_threshold=0.1,
                             entropy_coef=-0.05), False, True, False),
    "luspo-both-per-token-advantages": (dict(loss_type="luspo", top_entropy_quantile=0.6, off_policy_mask_threshold=0.1,
                                             beta=0.04), False, False, True),
}  # fmt: skip


@pytest.mark.parametrize("name", LOSS_CASES)
def test_masked_loss_matches_trl(name):
    """masked_grpo_loss vs TRL's `_compute_loss` on the same float64 logprobs and entropies: loss, its gradients with
    respect to both (the entropy bonus over the kept tokens), and every metric TRL logs; both masks drop some tokens
    and keep others."""
    options, on_policy, sampler, adv_per_token = LOSS_CASES[name]
    args = grpo_config(**options)
    p = loss_problem(seed=len(name), adv_per_token=adv_per_token)
    num_items = p["mask"].sum() + 5  # the generation batch's tokens, more than this micro-batch's
    stand_in = trl_stand_in(args)
    logps, entropies = p["logps"].clone().requires_grad_(), p["entropies"].clone().requires_grad_()
    stand_in.forward = (logps, entropies)
    want = stand_in.compute_loss(trl_inputs(p, on_policy, sampler, num_items))
    want.backward()
    masks = TokenMasks(args.top_entropy_quantile, args.off_policy_mask_threshold, args.entropy_coef)
    got, metrics, d_logps, d_entropies = fastgrpo_loss(args, p, masks, on_policy, sampler, num_items)

    assert_close("loss", got.reshape(1), want.detach().reshape(1), **EXACT)
    assert_close("d logps", d_logps, logps.grad, **EXACT)
    if args.entropy_coef:
        assert_close("d entropies", d_entropies, entropies.grad, **EXACT)
    else:  # no bonus: the entropies only pick tokens
        assert d_entropies is None and entropies.grad is None
    logged = {k: v[-1] for k, v in stand_in._metrics["train"].items() if k != "entropy_coef"}
    ours = {k: v for k, v in metrics.items() if k != BONUS_ENTROPY and (k != "policy_loss" or args.entropy_coef)}
    assert ours.keys() == logged.keys(), (sorted(ours), sorted(logged))
    for key, value in logged.items():  # TRL averages the clip indicators in float32 (`.float()`): rtol 1e-6
        assert_close(f"metric {key}", ours[key].reshape(1), torch.tensor([value], dtype=torch.float64), atol=1e-12,
                     rtol=1e-6)
    assert_masks_acted(stand_in, ("top_entropy_quantile" in options) + ("off_policy_mask_threshold" in options))


@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_adaptive_coefficient_follows_trls_controller(quantile):
    """Ten optimizer steps of two micro-batches whose mean entropy over the bonus tokens (all loss tokens, or the top
    half) crosses entropy_target both ways: the coefficient each step applies (read off TRL's gradient with respect
    to the entropies), the one it logs after the step, and the entropy it measured equal EntropyControl's; the
    sequence rises and falls, hits entropy_coef_max and entropy_coef_min, and applies 0 after a step above target."""
    accumulation = 2
    args = grpo_config(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.03, entropy_target=1.0,
                       entropy_coef_delta=0.02, entropy_coef_min=0.01, entropy_coef_max=0.07,
                       top_entropy_quantile=quantile, gradient_accumulation_steps=accumulation)
    stand_in, control = trl_stand_in(args, accumulation), EntropyControl.of(args)
    # The window's mean entropy is ~1 (all tokens) or ~1.5 (the top half) times these: above and below the target.
    scales = [1.6, 0.4, 0.5, 0.3, 0.45, 1.5, 1.4, 2.0, 1.7, 0.2] if quantile == 1.0 else [
        1.1, 0.3, 0.35, 0.2, 0.3, 1.0, 0.9, 1.3, 1.1, 0.15]
    applied, logged = [], []
    for step, factor in enumerate(scales):
        coef, window = control.applied(), []
        for micro in range(accumulation):
            p = loss_problem(seed=10 * step + micro)
            p["entropies"] = p["entropies"] * factor
            entropies = p["entropies"].clone().requires_grad_()
            stand_in.forward = (p["logps"].clone().requires_grad_(), entropies)
            stand_in.accelerator.sync_gradients = micro == accumulation - 1
            want = stand_in.compute_loss(trl_inputs(p, False, False, None))
            want.backward()
            # fastgrpo's bnpo loss is divided by the accumulation steps after the loss: so is its bonus
            masks = TokenMasks(quantile, None, coef)
            got, metrics, _, d_entropies = fastgrpo_loss(args, p, masks, False, False, None)
            assert_close("loss", got.reshape(1) / accumulation, want.detach().reshape(1), **EXACT)
            d_entropies = torch.zeros_like(entropies) if d_entropies is None else d_entropies  # coefficient 0
            assert_close("d entropies", d_entropies / accumulation, entropies.grad, **EXACT)
            window.append(metrics[BONUS_ENTROPY])
        summed, count = torch.stack(window).sum(0).tolist()
        control.update(summed / max(count, 1.0))
        assert math.isclose(control.last_entropy, stand_in._last_world_entropy, rel_tol=1e-12)
        applied.append(coef)
        logged.append(control.coef)
    assert logged == stand_in._metrics["train"]["entropy_coef"]
    assert applied[0] == 0.0 and 0.0 in applied[1:] and max(applied) > 0  # none before a measurement or above
    assert args.entropy_coef_max in logged and args.entropy_coef_min in logged
    steps = list(zip(logged, logged[1:], strict=False))  # (before, after)
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps)


def test_controller_state_round_trips():
    """The state a checkpoint keeps (JSON), and a controller restored from it continues where the first one was."""
    args = SimpleNamespace(entropy_coef=0.05, entropy_target=0.2, entropy_coef_min=0.0, entropy_coef_max=1.0,
                           entropy_coef_delta=0.005)
    control = EntropyControl.of(args)
    assert control.applied() == 0.0  # no step measured yet: no bonus (TRL's last entropy starts at inf)
    assert control.state_dict() == {"entropy_coef": 0.05, "last_entropy": None}
    control.update(0.1)
    restored = EntropyControl.of(args)
    restored.load_state_dict(json.loads(json.dumps(control.state_dict())))
    assert restored == control and restored.applied() == control.coef > 0.05


# -- fastgrpo train ------------------------------------------------------------------------------------------------


def run(config, monkeypatch, perturb: float = 0.0) -> dict:
    """Trains `config`; returns its trainer, per optimizer step (the parameters it started from, its gradient), the
    update's micro-batches in order with their rollouts, and the metrics logged per step. `perturb`: the std of
    Gaussian noise on the sampler's logprobs (the sampling logprobs the off-policy mask compares with)."""
    trainer = Trainer(config)
    out = {"trainer": trainer, "steps": [], "batches": []}
    step = trainer.optimizer.step

    def recording_step():
        parameters = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        out["steps"].append((parameters, [p.grad.clone() for p in trainer.parameters]))
        return step()

    trainer.optimizer.step = recording_step
    make_batch = update_module.micro_batch

    def recording_micro_batch(rollout, index, device):
        mb = make_batch(rollout, index, device)
        if torch.is_grad_enabled():  # the update's; the old / reference logprobs run under no_grad
            out["batches"].append((rollout, mb))
        return mb

    monkeypatch.setattr(update_module, "micro_batch", recording_micro_batch)
    generate, noise = trainer.engine.generate, torch.Generator().manual_seed(1)

    def noisy(prompts, n=1, params=None, group_ids=None, **kwargs):
        outputs = generate(prompts, n=n, params=params, group_ids=group_ids, **kwargs)
        for c in (c for group in outputs for c in group):
            c.logprobs = [lp + perturb * float(torch.randn((), generator=noise)) for lp in c.logprobs]
        return outputs

    trainer.engine.generate = noisy
    trainer.train()
    out["metrics"] = [row for row in trainer.log.history if row["step"] > 0]
    return out


def trl_replay(config, run: dict) -> tuple[list[list[torch.Tensor]], SimpleNamespace]:
    """TRL's gradient of each optimizer step of `run`: its own `_compute_loss` (on a stand-in, one process) on every
    micro-batch, from a float64 copy of the model at that step through its own forward (full logits); and the
    stand-in after the last step (its adaptive controller)."""
    model = AutoModelForCausalLM.from_pretrained(config.model_name_or_path, dtype=torch.float64)
    stand_in = trl_stand_in(config, config.gradient_accumulation_steps)
    stand_in.use_vllm = stand_in.vllm_importance_sampling_correction = config.importance_sampling_correction
    accumulation, gradients = config.gradient_accumulation_steps, []
    assert len(run["batches"]) == accumulation * len(run["steps"])
    for s, (parameters, _) in enumerate(run["steps"]):
        model.load_state_dict({name: value.double() for name, value in parameters.items()})
        model.zero_grad(set_to_none=True)
        for j, (rollout, mb) in enumerate(run["batches"][s * accumulation : (s + 1) * accumulation]):
            T = mb.mask.shape[1]
            rows = [model(torch.tensor([q])).logits[0, n - 1 : len(q) - 1].div(config.temperature).log_softmax(-1)
                    for q, n in zip(mb.sequences, mb.prompt_lengths, strict=True)]  # [T_i, V]
            all_logps = torch.stack([F.pad(r, (0, 0, 0, T - len(r))) for r in rows])  # [b, T, V]
            logps = all_logps.gather(-1, mb.completion_ids[..., None])[..., 0]  # [b, T]
            entropies = -(all_logps.exp() * all_logps).sum(-1)  # [b, T]
            # TRL ranks the entropies in fp32 (get_high_entropy_mask's .float()) and compares them unrounded; a float64
            # entropy that lands exactly on the quantile would then drop below its own rounded value. fastgrpo trains
            # in fp32, where it cannot: the replay's entropies are their fp32 values (their gradient unchanged).
            entropies = entropies + (entropies.float().double() - entropies).detach()
            stand_in.forward = (logps, entropies)
            stand_in.accelerator.sync_gradients = j == accumulation - 1
            b = len(mb.index)
            inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long),
                      "prompt_mask": torch.ones(b, 1, dtype=torch.long), "completion_ids": mb.completion_ids,
                      "completion_mask": mb.mask.double(), "advantages": mb.advantages.double(),
                      "num_items_in_batch": torch.tensor(float(sum(map(sum, rollout.loss_mask))))}
            if mb.old_logps is not None:
                inputs["old_per_token_logps"] = mb.old_logps.double()
            if mb.ref_logps is not None:
                inputs["ref_per_token_logps"] = mb.ref_logps.double()
            if mb.importance_weights is not None:
                weights = mb.importance_weights.double()
                inputs["importance_sampling_ratio"] = weights[:, None] if weights.dim() == 1 else weights
            if rollout.sampling_logps is not None:
                inputs["sampling_per_token_logps"] = padded([rollout.sampling_logps[i] for i in mb.index]).double()
            stand_in.compute_loss(inputs).backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
    return gradients, stand_in


FEW_STEPS = dict(save_steps=0, eval_num_samples=1, max_grad_norm=0.0)  # raw gradients
TRAIN_CASES = {  # name: (options, sampler noise)
    # 2 micro-batches: the quantile and the bonus's token count are each micro-batch's
    "grpo-top30-bonus": (dict(loss_type="grpo", top_entropy_quantile=0.3, entropy_coef=0.5, temperature=0.9,
                              max_steps=1), 0.0),
    # the sampler's logprobs (importance_sampling_correction keeps them) off by noise: whole sequences drop
    "dapo-off-policy-sampler": (dict(loss_type="dapo", off_policy_mask_threshold=0.05, beta=0.04,
                                     importance_sampling_correction=True, importance_sampling_mode="token_truncate",
                                     max_steps=1), 0.5),
    # on-policy, no IS correction: the mask still measures from the sampler's logprobs, as TRL from vLLM's
    "grpo-off-policy-sampler-on-policy": (dict(loss_type="grpo", off_policy_mask_threshold=0.05, max_steps=1), 0.5),
    # 4 optimizer steps (2 per round): the coefficient applied from the second on, measured on the top half
    "bnpo-adaptive-top50": (dict(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.2, entropy_target=10.0,
                                 entropy_coef_delta=0.3, entropy_coef_max=0.8, top_entropy_quantile=0.5,
                                 steps_per_generation=4, max_steps=2), 0.0),
    # the adaptive bonus on the fused path, with both masks off
    "dapo-adaptive": (dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.2, entropy_target=10.0,
                           entropy_coef_delta=0.3, num_iterations=2, max_steps=1), 0.0),
}  # fmt: skip


@pytest.mark.parametrize("name", TRAIN_CASES)
def test_training_matches_trl(assets, tmp_path, monkeypatch, name):
    """Every optimizer step's gradient equals TRL's loss on a float64 copy of the model; the adaptive controller ends
    where TRL's does and the run logs TRL's metrics (policy_loss, entropy_coef with a bonus)."""
    options, perturb = TRAIN_CASES[name]
    config = make_config(assets, tmp_path, **FEW_STEPS, **options)
    got = run(config, monkeypatch, perturb)
    want, stand_in = trl_replay(config, got)
    for (_, gradient), truth in zip(got["steps"], want, strict=True):
        assert_close_gradients(gradient, truth)
    assert_masks_acted(stand_in, (config.top_entropy_quantile < 1) + (config.off_policy_mask_threshold is not None))
    trainer, metrics = got["trainer"], got["metrics"]
    assert all(BONUS_ENTROPY not in row for row in metrics)
    bonus = config.entropy_coef != 0.0 or config.use_adaptive_entropy
    assert all(("policy_loss" in row) == bonus and ("entropy_coef" in row) == bonus for row in metrics)
    if config.use_adaptive_entropy:
        control = trainer.entropy_control
        assert control.coef == stand_in.entropy_coef and control.coef > config.entropy_coef
        assert math.isclose(control.last_entropy, stand_in._last_world_entropy, rel_tol=1e-5)
        per_round = len(got["steps"]) // config.max_steps
        coefficients = stand_in._metrics["train"]["entropy_coef"]
        for k, row in enumerate(metrics):
            assert math.isclose(row["entropy_coef"], sum(coefficients[k * per_round : (k + 1) * per_round]) / per_round)
        # the bonus it applied after the first step changed the gradients beyond the tolerance
        stand_in_without = dict(options, use_adaptive_entropy=False, entropy_coef=0.0)
        plain, _ = trl_replay(make_config(assets, tmp_path / "plain", **FEW_STEPS, **stand_in_without), got)
        assert largest_difference(plain[-1], want[-1]) > 1000 * GRAD_TOLERANCE


@pytest.mark.parametrize("bad, message", [
    ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile must be in \[0, 1\], got 1.5"),
    ({"top_entropy_quantile": -0.1}, r"top_entropy_quantile must be in \[0, 1\], got -0.1"),
    ({"top_entropy_quantile": math.nan}, "top_entropy_quantile must be finite"),
    ({"off_policy_mask_threshold": -0.5}, r"off_policy_mask_threshold must be None or >= 0 \(a mean KL in nats\), "
                                          "got -0.5"),
    ({"use_adaptive_entropy": "yes"}, "use_adaptive_entropy must be bool"),
    ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, r"entropy_coef_min \(0.5\) must be <= entropy_coef_max "
                                                         r"\(0.1\)"),
    ({"entropy_coef_delta": -0.01}, "entropy_coef_delta must be >= 0, got -0.01"),
    ({"entropy_target": -1.0}, "entropy_target must be >= 0, got -1.0"),
])  # fmt: skip
def test_bad_values_are_refused_naming_the_option(assets, tmp_path, bad, message):
    with pytest.raises((ValueError, TypeError), match=message) as error:
        Trainer(make_config(assets, tmp_path, **bad))
    assert "\n" not in str(error.value)


def test_resume_keeps_the_adaptive_controller(assets, tmp_path, monkeypatch):
    """A run killed after its step-2 checkpoint and resumed logs what the unbroken run logs, the coefficient
    included, and ends with its controller: the checkpoint carries the coefficient and the last step's entropy."""
    settings = dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=10.0,
                    entropy_coef_delta=0.05, top_entropy_quantile=0.5)
    resumed = killed_then_resumed(assets, tmp_path, monkeypatch, **settings)
    unbroken = read_metrics(tmp_path / "a" / "run")
    assert_same_metrics(unbroken, read_metrics(tmp_path / "b" / "run"))
    coefficients = [row["entropy_coef"] for row in unbroken if row["step"] > 0]
    assert coefficients == pytest.approx([0.15, 0.2, 0.25, 0.3])  # raised every step: the entropy is below 10
    assert resumed.entropy_control.coef == pytest.approx(0.3) and resumed.entropy_control.last_entropy < 10.0


# -- several processes ---------------------------------------------------------------------------------------------

TWO_PROCESS_CASES = {
    # bnpo: a token mean per micro-batch, each share scaled by its token share; the quantile over both shares' tokens
    "bnpo-top50-adaptive": dict(loss_type="bnpo", top_entropy_quantile=0.5, use_adaptive_entropy=True,
                                entropy_coef=0.1, entropy_target=10.0, entropy_coef_delta=0.1),
    # grpo: a mean per sequence, each share scaled by 1; the bonus's count is the global micro-batch's kept tokens
    "grpo-top30-bonus": dict(loss_type="grpo", top_entropy_quantile=0.3, entropy_coef=0.3),
}  # fmt: skip


@pytest.mark.slow
def test_two_processes_train_as_one(assets, tmp_path):
    """FSDP2 and DDP on 2 processes x 4 = 1 process x 8 with the masks and the (adaptive) bonus: the same metrics,
    entropy_coef included, and parameters (test_distributed.py's comparison and tolerance)."""
    from distributed_helpers import TOL, assert_same_parameters, drive, one_process, options

    runs = []
    for parallelism in ("fsdp", "ddp"):
        for name, values in TWO_PROCESS_CASES.items():
            output = tmp_path / f"{parallelism}-{name}"
            runs.append(options(assets, output, **values, parallelism=parallelism, per_device_train_batch_size=4,
                                params_file=str(output) + ".pt"))
    done = drive(runs, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, values in TWO_PROCESS_CASES.items():
        metrics, params = one_process(options(assets, tmp_path / f"one-{name}", **values))
        assert all(row["entropy_coef"] > 0 for row in metrics if row["step"] > 0)
        for parallelism in ("fsdp", "ddp"):
            output = tmp_path / f"{parallelism}-{name}"
            assert_same_metrics(metrics, read_metrics(output), tol=TOL)
            assert_same_parameters(params, torch.load(str(output) + ".pt"))


# -- the drop-in against stock TRL ---------------------------------------------------------------------------------

DROP_IN_CASES = {
    # the coefficient rises from 0.05 each step (entropy below the target): applied from the second step on
    "dapo-adaptive": dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0,
                          entropy_coef_delta=0.2, gradient_accumulation_steps=2, steps_per_generation=4),
    # with the top-entropy mask: the bonus and the controller's entropy over the kept tokens
    "grpo-adaptive-top40": dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0,
                                entropy_coef_delta=0.2, top_entropy_quantile=0.4, gradient_accumulation_steps=2),
    # the static bonus over the kept tokens
    "bnpo-bonus-top40": dict(loss_type="bnpo", entropy_coef=0.2, top_entropy_quantile=0.4, num_iterations=2),
}  # fmt: skip


@pytest.mark.parametrize("name", DROP_IN_CASES)
def test_drop_in_matches_trl(name, tmp_path):
    """FastGRPOTrainer trains as stock TRL (tests/test_trl_trainer.py's comparison: completions, losses, first-step
    gradients, parameters after two steps, metrics) and logs the same policy_loss and entropy_coef; the adaptive
    controller ends in TRL's state, which TRL's checkpoint keeps; the bonus changed the training."""
    from helpers import word_tokenizer
    from trl import GRPOTrainer
    from trl_helpers import EXTRA, LOSS_TOL, PARAM_ATOL, _assert_same_training, _initial, _train
    from trl_helpers import _save_tiny_qwen2 as save_tiny_qwen2

    from fastgrpo.integrations.trl import FastGRPOTrainer

    tokenizer = word_tokenizer(40)
    save_tiny_qwen2(tmp_path, tokenizer)
    options = DROP_IN_CASES[name]
    options = {**EXTRA[options["loss_type"]], **options, "save_strategy": "steps", "save_steps": 1}
    stock = _train(tmp_path, tokenizer, GRPOTrainer, **options)
    fast = _train(tmp_path, tokenizer, FastGRPOTrainer, **options)
    _assert_same_training(stock, fast, _initial(tmp_path))
    for key in ("policy_loss", "entropy_coef"):
        logged = [[log[key] for log in run.state.log_history if key in log] for run in (fast, stock)]
        assert len(logged[1]) == 2
        torch.testing.assert_close(torch.tensor(logged[0]), torch.tensor(logged[1]), **LOSS_TOL)
    adaptive = options.get("use_adaptive_entropy", False)
    if adaptive:
        assert fast.entropy_coef == stock.entropy_coef > options["entropy_coef"]
        assert math.isclose(fast._last_world_entropy, stock._last_world_entropy, rel_tol=1e-5)
        saved = json.loads((tmp_path / "out" / "checkpoint-2" / "entropy_ctrl_state.json").read_text())
        assert saved == {"entropy_coef": fast.entropy_coef, "last_world_entropy": fast._last_world_entropy}
    # Without the bonus (adaptive: a target it never reaches) the parameters end far from the bonus's.
    plain = _train(tmp_path, tokenizer, FastGRPOTrainer, **{**options, **(
        {"entropy_target": 0.0} if adaptive else {"entropy_coef": 0.0})})
    moved = max((p - q).abs().max().item() for p, q in zip(fast.model.parameters(), plain.model.parameters(),
                                                          strict=True))
    assert moved > 10 * PARAM_ATOL, moved
