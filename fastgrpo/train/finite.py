"""No non-finite number reaches the weights: the guards of a training step and of a checkpoint.

A NaN or inf from any source turns the loss, then every gradient, then every weight into NaN within one optimizer
step, and a checkpoint then saves them. Three checks stop that, each with one line naming the source:

    check_inputs(rollout, rewards, ...)   before the update: the rewards' group statistics (float32, as TRL computes
                                          advantages: +-3e38 rewards are finite but their spread is not), the
                                          sampler's logprobs that the importance-sampling correction reads, the
                                          old and reference logprobs (the model's no-grad forwards), on loss tokens
    check_step(loss, grad_norm, ...)      before each optimizer step: the loss and the gradient's norm (clip_grad_norm_
                                          computes it anyway; one device sync per optimizer step, one flag exchanged
                                          over the processes so that every rank refuses together)
    check_weights(model, ...)             before a checkpoint is written: the weights after the last optimizer step
                                          (finite gradients can still overflow them: a learning rate times a weight
                                          decay past float32's range)

A refused step raises NonFiniteError: `fastgrpo train` prints its line and exits 1; the weights in memory are those of
the last optimizer step taken, and no checkpoint holds anything past it.
"""

import math
from collections.abc import Callable

import torch

from fastgrpo.train.rollout import Rollout, nanstd


class NonFiniteError(RuntimeError):
    """A loss, gradient, weight or input of the loss that is NaN or infinite; the message names where it came from."""


def _first_bad(values: list[torch.Tensor], masks: list[list[int]]) -> tuple[int, int, float] | None:
    """(sample, token, value) of the first non-finite value on a loss token (mask 1), or None."""
    for i, (row, mask) in enumerate(zip(values, masks, strict=True)):
        bad = ~torch.isfinite(row[: len(mask)]) & torch.tensor(mask, dtype=torch.bool)[: len(row)]
        if bad.any():
            t = int(bad.nonzero()[0])
            return i, t, float(row[t])
    return None


def check_rewards(rewards: torch.Tensor, per_func: torch.Tensor, names: list[str], num_generations: int,
                  per_function: bool) -> None:
    """rewards [N] (weighted sums), per_func [N, F]: the mean and standard deviation of every group's scorable rewards
    (of each function's, with `per_function`: GDPO normalises those) must be finite in float32, or the advantages are
    silently 0 or wrong (TRL computes them in float32 too)."""
    columns = [(f"reward function {name!r}", per_func[:, j]) for j, name in enumerate(names)] if per_function else []
    for what, values in [*columns, ("the weighted rewards", rewards)]:
        grouped = values.view(-1, num_generations)  # [P, G]
        counted = (~grouped.isnan()).sum(1) >= 2
        spread = torch.nanmean(grouped, 1).isfinite() & nanstd(grouped, 1).isfinite()
        bad = (counted & ~spread).nonzero()
        if len(bad):
            g = int(bad[0])
            shown = ", ".join("None" if math.isnan(x) else f"{x:.6g}" for x in grouped[g].tolist())
            raise NonFiniteError(f"{what} of prompt group {g} are [{shown}]: their mean or standard deviation "
                                 "overflows float32, where advantages are computed, so every advantage of the group "
                                 "would be 0 or wrong; scale the rewards down (|reward| well below 1e19)")


def check_inputs(step: int, rollout: Rollout, importance_sampling: bool, rollout_func: bool,
                 last_checkpoint: Callable[[], str]) -> None:
    """The inputs of the loss, on loss tokens: the sampler's logprobs the importance-sampling correction reads, the
    old logprobs (the policy's no-grad forward) and the reference's."""
    masks = rollout.loss_mask
    sources = []
    if importance_sampling and rollout.sampling_logps is not None:
        said = ("--rollout-func's logprobs (None is read as NaN)" if rollout_func else "the sampler's logprobs")
        sources.append((rollout.sampling_logps, f"{said}, which --importance-sampling-correction needs for every "
                                                "token in the loss; return a finite logprob for each, or turn the "
                                                "correction off"))
    if rollout.old_logps is not None:
        sources.append((rollout.old_logps, "the policy's logprobs (its no-grad forward): the model computes "
                                           "non-finite values"))
    if rollout.ref_logps is not None:
        sources.append((rollout.ref_logps, "the reference model's logprobs (its no-grad forward): the model computes "
                                           "non-finite values"))
    for values, said in sources:
        found = _first_bad(values, masks)
        if found is not None:
            i, t, value = found
            raise NonFiniteError(f"step {step}: the logprob of sample {i}'s completion token {t} is {value} in "
                                 f"{said}; the step was stopped before the optimizer (no weight changed)"
                                 f"{last_checkpoint()}")


def _non_finite_parameter(model: torch.nn.Module) -> str | None:
    """The name of the first parameter (this process's shard) that holds a NaN or inf."""
    for name, parameter in model.named_parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if not torch.isfinite(local).all():
            return name
    return None


def check_step(step: int, loss: torch.Tensor, grad_norm: torch.Tensor, world, model: torch.nn.Module,
               last_checkpoint: Callable[[], str]) -> None:
    """Before optimizer step: loss (this process's share) and grad_norm (the whole gradient's) finite on every
    process, else NonFiniteError on every process, before any weight changes."""
    bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    if world.size > 1:  # the loss is each process's own: one flag over all of them, so that all stop together
        bad = world.any_rank(bad)
    if not bad.item():
        return
    weights = _non_finite_parameter(model)
    source = (f"the weights already hold NaN or inf ({weights})" if weights is not None else
              "the model's forward or backward overflowed (a lower --learning-rate, --max-grad-norm, or --bf16 off "
              "may help)")
    raise NonFiniteError(f"step {step}: the loss is {float(loss):g} and the gradient norm {float(grad_norm):g}: "
                         f"{source}; the step was stopped before the optimizer (no weight changed)"
                         f"{last_checkpoint()}")


def check_weights(step: int, model: torch.nn.Module, world, last_checkpoint: Callable[[], str]) -> None:
    """Before checkpoint-<step> is written: every weight finite (on every process), else NonFiniteError and no
    checkpoint."""
    name = _non_finite_parameter(model)
    bad = torch.tensor(name is not None, device=next(model.parameters()).device)
    if world.size > 1:
        bad = world.any_rank(bad)
    if bad.item():
        where = f" ({name})" if name is not None else " (on another process)"
        raise NonFiniteError(f"step {step}: the optimizer step made weights NaN or inf{where} from finite gradients "
                             "(the learning rate, or it times --weight-decay, overflows float32), so "
                             f"checkpoint-{step} was not written{last_checkpoint()}")


def last_checkpoint_said(latest) -> str:
    """The end of a NonFiniteError's line: where the run can go on from (nothing when it has no checkpoint)."""
    return "" if latest is None else f"; the last checkpoint, {latest}, is untouched (--resume continues from it)"
