"""Several processes on a hybrid model: a tiny Qwen3.5 (3 Gated DeltaNet layers and 1 attention layer) trains the
same on 2 processes x 4 sequences as on 1 process x 8, under FSDP2: each rank's engine keeps its own recurrent state
slots, and the groups it samples do not depend on which rank samples them."""

import pytest
import torch
from distributed_helpers import TOL, drive, one_process, options
from family_helpers import save_tiny_model
from train_helpers import assert_same_metrics

from fastgrpo.train.logs import read_metrics


@pytest.mark.slow
def test_two_processes_train_a_hybrid_model_as_one(tmp_path):
    model = save_tiny_model("qwen3_5_text", tmp_path / "qwen3_5")
    assets = {"model": model, "data": "builtin"}
    values = dict(max_completion_length=8, num_iterations=1, gradient_checkpointing=True)
    output = tmp_path / "fsdp"
    done = drive([options(assets, output, **values, parallelism="fsdp", per_device_train_batch_size=4,
                          params_file=str(output) + ".pt")], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics, params = one_process(options(assets, tmp_path / "one", **values))
    assert metrics[-1]["grad_norm"] > 0
    assert_same_metrics(metrics, read_metrics(output), tol=TOL)
    # Parameters within 1e-5 of the largest, as the Qwen2 tests: FSDP2 sums the 2 ranks' fp32 gradients in another
    # order than one process does.
    sharded = torch.load(str(output) + ".pt")
    largest = max(float(v.abs().max()) for v in params.values())
    worst = max(float((params[k] - sharded[k]).abs().max()) for k in params)
    assert worst <= 1e-5 * largest, worst / largest
