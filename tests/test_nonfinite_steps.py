"""A NaN or inf never reaches the weights (issue 41): whatever its source, the rewards (finite values whose group
spread overflows float32), a rollout_func's logprobs (None, which TRL reads as NaN, under the importance-sampling
correction), or the model (a weight that is inf, a forward that overflows, an update that overflows the weights),
`fastgrpo train` stops before the optimizer step with one line and exit 1, and no checkpoint ever holds a non-finite
weight. A run stopped before its first step leaves no folder behind; one stopped later keeps its checkpoints.

The model and data are conftest's `assets` (a tiny random Qwen2 on the arithmetic task), through `fastgrpo train`."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastgrpo.cli import main
from fastgrpo.train import checkpoint
from fastgrpo.train.logs import read_metrics

FUNCTIONS = '''
import math


def spread(completions, **kwargs):
    """Finite in float32, but (x - mean)^2 of the group overflows it."""
    return [3e38 if i % 2 else -3e38 for i in range(len(completions))]


def spread_from_step_2(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 0:
        return [float(i) for i in range(len(completions))]
    return spread(completions)


def varied(completions, **kwargs):
    return [float(i % 3) for i in range(len(completions))]


def _rollout(n, logprob):
    return {"prompt_ids": [[1, 2]] * n, "completion_ids": [[3, 4]] * n, "logprobs": [[logprob, -0.5]] * n}


def rollout_none_logprob(prompts, trainer):
    return _rollout(len(prompts), None)


def rollout_nan_logprob(prompts, trainer):
    return _rollout(len(prompts), math.nan)
'''


@pytest.fixture
def functions(tmp_path) -> Path:
    (tmp_path / "nonfinite_functions.py").write_text(FUNCTIONS)
    return tmp_path / "nonfinite_functions.py"


def train_args(assets: dict, run: Path, *extra: str) -> list[str]:
    return ["train", "--model-name-or-path", assets["model"], "--dataset-name", assets["data"], "--output-dir",
            str(run), "-G", "4", "--per-device-train-batch-size", "8", "--max-completion-length", "4",
            "--eval-num-samples", "2", "--report-to", "none", "--disable-tqdm", "--seed", "3", *extra]


@pytest.fixture
def optimizer_steps(monkeypatch) -> list[int]:
    """Grows by one per optimizer step taken (AdamW.step), in this process."""
    taken, step = [], torch.optim.AdamW.step

    def counted(self, *args, **kwargs):
        taken.append(1)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    return taken


def stopped(capsys, argv: list[str]) -> str:
    """`fastgrpo <argv>` exits 1 with one line on stderr and no traceback: that line, less its prefix."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("fastgrpo train: error: "), lines
    return lines[0].removeprefix("fastgrpo train: error: ")


def assert_every_checkpoint_finite(run: Path) -> None:
    for folder in checkpoint.checkpoints(run) if run.exists() else []:
        for name, tensor in load_file(folder / "model.safetensors").items():
            assert torch.isfinite(tensor).all(), (folder, name)


def test_rewards_whose_group_spread_overflows_stop_the_step(assets, tmp_path, capsys, functions, optimizer_steps):
    run = tmp_path / "run"
    line = stopped(capsys, train_args(assets, run, "--reward-funcs", f"{functions}:spread", "--max-steps", "1"))
    assert line.startswith("the weighted rewards of prompt group 0 are [-3e+38, 3e+38, -3e+38, 3e+38]: their mean or "
                           "standard deviation overflows float32, where advantages are computed"), line
    assert optimizer_steps == [] and not run.exists()


def test_a_later_step_that_overflows_keeps_the_earlier_checkpoint(assets, tmp_path, capsys, functions,
                                                                   optimizer_steps):
    """Step 1 trains and is saved; step 2's rewards overflow: no optimizer step, checkpoint-1 stays the last one."""
    run = tmp_path / "run"
    line = stopped(capsys, train_args(assets, run, "--reward-funcs", f"{functions}:spread_from_step_2",
                                      "--max-steps", "2", "--save-steps", "1"))
    assert "overflows float32" in line, line
    assert optimizer_steps == [1]  # step 1's only
    assert [p.name for p in checkpoint.checkpoints(run)] == ["checkpoint-1"]
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
    assert_every_checkpoint_finite(run)


@pytest.mark.parametrize("function, shown", [("rollout_none_logprob", "nan"), ("rollout_nan_logprob", "nan")])
def test_rollout_logprobs_that_are_not_numbers_stop_the_step(assets, tmp_path, capsys, functions, optimizer_steps,
                                                              function, shown):
    """TRL reads a None logprob as NaN; the importance-sampling correction then makes the loss NaN (every saved weight
    NaN, exit 0, before the fix)."""
    run = tmp_path / "run"
    line = stopped(capsys, train_args(assets, run, "--rollout-func", f"{functions}:{function}",
                                      "--reward-funcs", f"{functions}:varied", "--importance-sampling-correction",
                                      "--importance-sampling-mode", "token_truncate", "--max-steps", "1"))
    assert line == (f"step 1: the logprob of sample 0's completion token 0 is {shown} in --rollout-func's logprobs "
                    "(None is read as NaN), which --importance-sampling-correction needs for every token in the loss; "
                    "return a finite logprob for each, or turn the correction off; the step was stopped before the "
                    "optimizer (no weight changed)")
    assert optimizer_steps == [] and not run.exists()


@pytest.fixture
def broken_model(assets, tmp_path):
    """A copy of the tiny model with one weight set to `value`."""

    def broken(value: float, name: str = "model.layers.0.mlp.down_proj.weight") -> str:
        folder = tmp_path / f"model-{value}"
        shutil.copytree(assets["model"], folder)
        weights = load_file(folder / "model.safetensors")
        weights[name].view(-1)[0] = value
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        return str(folder)

    return broken


@pytest.mark.parametrize("options, said", [
    ((), "the loss is nan and the gradient norm nan: the weights already hold NaN or inf "
         "(model.layers.0.mlp.down_proj.weight); the step was stopped before the optimizer (no weight changed)"),
    (("--num-iterations", "2"), "the logprob of sample 0's completion token 0 is nan in the policy's logprobs (its "
                                "no-grad forward): the model computes non-finite values; the step was stopped before "
                                "the optimizer (no weight changed)"),
], ids=["in_the_update", "in_the_old_logprobs"])  # fmt: skip
def test_a_model_that_computes_nan_stops_the_step(assets, tmp_path, capsys, functions, optimizer_steps,
                                                  broken_model, options, said):
    run = tmp_path / "run"
    line = stopped(capsys, [*train_args(assets, run, "--reward-funcs", f"{functions}:varied", "--max-steps", "1",
                                        *options), "--model-name-or-path", broken_model(float("inf"))])
    assert line == f"step 1: {said}", line
    assert optimizer_steps == [] and not run.exists()


def test_a_forward_that_overflows_stops_the_step(assets, tmp_path, capsys, functions, optimizer_steps, broken_model):
    """Finite weights, one of them 1e38: the forward overflows to inf and NaN."""
    run = tmp_path / "run"
    model = broken_model(1e38, "model.layers.0.input_layernorm.weight")
    line = stopped(capsys, [*train_args(assets, run, "--reward-funcs", f"{functions}:varied", "--max-steps", "1"),
                            "--model-name-or-path", model])
    assert line.startswith("step 1: the loss is nan and the gradient norm "), line
    assert line.endswith("the model's forward or backward overflowed (a lower --learning-rate, --max-grad-norm, or "
                         "--bf16 off may help); the step was stopped before the optimizer (no weight changed)"), line
    assert optimizer_steps == [] and not run.exists()


def test_an_update_that_overflows_the_weights_writes_no_checkpoint(assets, tmp_path, capsys, functions):
    """Finite gradients, but learning rate x weight decay (1e40) past float32: the weights become inf; the checkpoint
    of that step is not written (before the fix: every saved weight NaN or inf, exit 0)."""
    run = tmp_path / "run"
    line = stopped(capsys, train_args(assets, run, "--reward-funcs", f"{functions}:varied", "--max-steps", "2",
                                      "--save-steps", "1", "--learning-rate", "1e10", "--weight-decay", "1e30"))
    assert line.startswith("step 1: the optimizer step made weights NaN or inf (model."), line
    assert line.endswith("from finite gradients (the learning rate, or it times --weight-decay, overflows float32), "
                         "so checkpoint-1 was not written"), line
    assert checkpoint.checkpoints(run) == [] and [r["step"] for r in read_metrics(run)] == [0, 1]
