"""The learning-rate schedule: transformers' schedule names and formulas (a linear warm-up from 0, then the shape),
as a torch LambdaLR. The four common shapes are written out here, so that a plain run does not import transformers'
Trainer stack (which imports peft, and through it bitsandbytes); any other name goes to transformers' get_scheduler."""

import math
from dataclasses import dataclass

import torch

SHAPES = ("linear", "cosine", "constant", "constant_with_warmup")


@dataclass
class LRFactor:
    """The factor on the base learning rate at optimizer step `step`: `step / warmup` during the warm-up, then
    linear: (total - step) / (total - warmup), down to 0; cosine: half a cosine period from 1 to 0; constant: 1
    (plain "constant" has no warm-up)."""

    shape: str
    warmup: int
    total: int

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        if self.shape in ("constant", "constant_with_warmup"):
            return 1.0
        if self.shape == "linear":
            return max(0.0, (self.total - step) / max(1, self.total - self.warmup))
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def lr_scheduler(name: str, optimizer: torch.optim.Optimizer, warmup: int, total: int):
    """transformers' `get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)`."""
    if name in SHAPES:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, LRFactor(name, 0 if name == "constant" else warmup, total))
    from transformers import SchedulerType, get_scheduler

    names = [kind.value for kind in SchedulerType]
    if name not in names:
        raise ValueError(f"lr_scheduler_type: {name!r} is not one of transformers' schedules {names}")
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
