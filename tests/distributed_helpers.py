"""Helpers of the multi-process tests: `fastgrpo train` options for the tiny assets, torchrun on 2 processes (CPU,
gloo) driving tests/distributed_driver.py, the same run on 1 process, and the tolerance the two are compared at."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fastgrpo.train import TrainConfig, Trainer
from fastgrpo.train.logs import read_metrics

DRIVER = Path(__file__).parent / "distributed_driver.py"
TOL = 1e-5  # metrics (relative, or absolute near 0) and parameters (of the largest entry)


def options(assets, output_dir: Path, **overrides) -> dict:
    values = dict(model_name_or_path=assets["model"], dataset_name=assets["data"], output_dir=str(output_dir),
                  num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                  max_completion_length=5, learning_rate=3e-3, max_steps=3, save_steps=0, eval_num_samples=8,
                  report_to=["none"], disable_tqdm=True, seed=7, reward_funcs=["accuracy", "length"],
                  num_iterations=2, ddp_timeout=120)
    return {**values, **overrides}


def torchrun(*args, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *map(str, args)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)


def flags(values: dict) -> list[str]:
    """The options as `fastgrpo train` command-line flags (True as a bare flag)."""
    out = []
    for key, value in values.items():
        out += [f"--{key.replace('_', '-')}", *(map(str, value) if isinstance(value, list) else
                                                  [] if value is True else [str(value)])]
    return out


def drive(configs: list[dict], tmp_path: Path, *extra) -> subprocess.CompletedProcess:
    path = tmp_path / f"configs-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(configs))
    return torchrun(DRIVER, path, *extra)


def one_process(values: dict) -> tuple[list[dict], dict]:
    trainer = Trainer(TrainConfig(**values))
    trainer.train()
    return read_metrics(trainer.output_dir), {k: v.clone() for k, v in trainer.model.state_dict().items()}


def assert_same_parameters(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    largest = max(float(v.abs().max()) for v in a.values())
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= TOL * largest, (worst, largest)
