"""fastgrpo's learning-rate schedules give transformers' get_scheduler's rates, step for step."""

import pytest
import torch
from transformers import get_scheduler

from fastgrpo.train.schedule import SHAPES, lr_scheduler


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 10), (5, 5), (2, 7)])
def test_schedule_equals_transformers(name, warmup, total):
    ours = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    a = lr_scheduler(name, ours, warmup, total)
    b = get_scheduler(name, theirs, num_warmup_steps=warmup, num_training_steps=total)
    for _ in range(total + 2):
        assert a.get_last_lr() == b.get_last_lr()
        ours.step(), theirs.step(), a.step(), b.step()


def test_other_names_go_to_transformers():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert type(lr_scheduler("inverse_sqrt", optimizer, 2, 10)).__name__ == "LambdaLR"
    with pytest.raises(ValueError):
        lr_scheduler("no_such_schedule", optimizer, 0, 10)
