"""`fastgrpo train` on 2 processes (torchrun, gloo, CPU) against 1 process with the same global batch.

A run must not depend on the number of processes: 2 processes at per_device_train_batch_size 4 log the same metrics
and end with the same parameters as 1 process at 8, under FSDP2 and DDP, for dapo, grpo and bnpo (each normalised
differently), with and without a reference model (beta) and an entropy bonus, over two passes per round
(num_iterations 2, so old logprobs too), and with LoRA. Observed: metrics within ~3e-7 relative, parameters within
~5e-6 of the largest entry (the tolerance is 1e-5). Resume works
at the same and at another number of processes; a rank that fails ends every rank with its error. Tools (the
calculator agent) and dynamic sampling run on 2 processes as on 1.
"""

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed_helpers import TOL, assert_same_parameters, drive, flags, one_process, options, torchrun
from safetensors import safe_open
from train_helpers import assert_same_metrics
from transformers import AutoModelForCausalLM

from fastgrpo.train import TrainConfig, Trainer, checkpoint
from fastgrpo.train.distributed import World
from fastgrpo.train.logs import read_metrics
from fastgrpo.train.update import merge_metrics


@pytest.fixture(scope="module")
def tied(assets, tmp_path_factory) -> dict:
    """The same model with its lm_head tied to the embeddings (as Qwen2.5-0.5B / 1.5B): under FSDP2 the head's weight
    is the root's sharded embedding table."""
    folder = tmp_path_factory.mktemp("tied") / "model"
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(folder)
    shutil.copy(Path(assets["model"]) / "tokenizer.json", folder)
    shutil.copy(Path(assets["model"]) / "tokenizer_config.json", folder)
    return {**assets, "model": str(folder)}


CASES = {  # name: (assets fixture, options)
    # dapo's loss is a sum over shares (x K), its entropy bonus a token mean (x the share's token fraction)
    "dapo-kl-entropy": ("tied", dict(loss_type="dapo", beta=0.04, entropy_coef=0.01)),
    # one held-out prompt: rank 1 evaluates nothing, yet joins FSDP2's all-gathers for the sampling round
    "grpo": ("tied", dict(loss_type="grpo", beta=0.0, eval_num_samples=1)),
    # bnpo: a token mean; sequence-level ratios (clip metrics averaged over samples); truncated completions masked
    "bnpo-sequence": ("tied", dict(loss_type="bnpo", entropy_coef=0.01, importance_sampling_level="sequence",
                                   mask_truncated_completions=True)),
    "lora-kl": ("assets", dict(use_peft=True, lora_r=4, lora_dropout=0.0, beta=0.04, learning_rate=1e-2)),
}


@pytest.mark.slow
def test_two_processes_train_as_one(assets, tied, tmp_path):
    """FSDP2 and DDP on 2 processes x 4 = 1 process x 8, metric by metric and parameter by parameter."""
    fixtures = {"assets": assets, "tied": tied}
    runs = []
    for parallelism in ("fsdp", "ddp"):
        for name, (fixture, values) in CASES.items():
            output = tmp_path / f"{parallelism}-{name}"
            runs.append(options(fixtures[fixture], output, **values, parallelism=parallelism,
                                per_device_train_batch_size=4, params_file=str(output) + ".pt"))
    done = drive(runs, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, (fixture, values) in CASES.items():
        metrics, params = one_process(options(fixtures[fixture], tmp_path / f"one-{name}", **values))
        assert metrics[-1]["grad_norm"] > 0
        for parallelism in ("fsdp", "ddp"):
            output = tmp_path / f"{parallelism}-{name}"
            assert_same_metrics(metrics, read_metrics(output), tol=TOL)
            assert_same_parameters(params, torch.load(str(output) + ".pt"))


@pytest.mark.slow
def test_two_processes_sample_dynamic_rounds_as_one(tied, tmp_path):
    """Dynamic sampling: 2 processes draw waves of groups, 1 process streams them through the engine; the same
    prompts are drawn, kept and dropped (dynamic/* metrics), and the runs train alike (FSDP2, the default)."""
    values = dict(dynamic_sampling=True, max_steps=3)
    output = tmp_path / "two"
    done = drive([options(tied, output, **values, per_device_train_batch_size=4, params_file=str(output) + ".pt")],
                 tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics, params = one_process(options(tied, tmp_path / "one", **values))
    rows = metrics[1:]
    assert all(r["dynamic/kept_groups"] == 4 for r in rows)
    assert sum(r["dynamic/drawn_groups"] for r in rows) > 3 * 4, "no round dropped a group"
    assert_same_metrics(metrics, read_metrics(output), tol=TOL)
    assert_same_parameters(params, torch.load(str(output) + ".pt"))


@pytest.mark.slow
def test_two_processes_run_tools_as_one(tmp_path):
    """An agent under torchrun: the built-in calculator task (recipes/calculator-agent.yaml's model, data and `add`
    tool) on 2 processes x 16 rollouts = 1 process x 32: the same tool calls (tools/* metrics gathered over both),
    metrics and parameters (FSDP2, the default)."""
    recipes = Path(__file__).parents[1] / "recipes"
    values = dict(model_name_or_path=str(recipes / "calculator" / "model"),
                  dataset_name=str(recipes / "calculator" / "data"), prompt_column="prompt", answer_column="answer",
                  tools=[f"{recipes / 'calculator' / 'tools.py'}:add"], max_tool_calling_iterations=1,
                  max_completion_length=48, num_generations=8, reward_funcs=["accuracy"], loss_type="dapo",
                  learning_rate=1e-3, per_device_train_batch_size=32, max_steps=2, save_steps=0, eval_num_samples=16,
                  report_to=["none"], disable_tqdm=True, seed=7, ddp_timeout=120)
    output = tmp_path / "two"
    done = drive([{**values, "output_dir": str(output), "per_device_train_batch_size": 16,
                   "params_file": str(output) + ".pt"}], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics, params = one_process({**values, "output_dir": str(tmp_path / "one")})
    assert all(r["tools/call_frequency"] > 0 for r in metrics[1:])
    assert_same_metrics(metrics, read_metrics(output), tol=TOL)
    assert_same_parameters(params, torch.load(str(output) + ".pt"))


@pytest.mark.slow
def test_torchrun_fastgrpo_train_shards_by_default(tied, tmp_path):
    """`torchrun -m fastgrpo train` on 2 processes: FSDP2 by default; only rank 0 writes logs, plot and the summary;
    the last checkpoint is sharded (DCP) and holds the whole model exported with save_pretrained, equal to what one
    process trains."""
    values = options(tied, tmp_path / "two", per_device_train_batch_size=4, save_steps=2, beta=0.04)
    done = torchrun("-m", "fastgrpo", "train", *flags(values))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("fastgrpo: held-out accuracy") == 1
    metrics, params = one_process(options(tied, tmp_path / "one", beta=0.04))
    run = tmp_path / "two"
    assert_same_metrics(metrics, read_metrics(run), tol=TOL)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4  # the evaluation before training, 3 steps
    assert (run / "training_curves.png").is_file()
    last = run / "checkpoint-3"
    assert checkpoint.is_sharded(last) and sorted(p.name for p in (last / "dcp").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    assert checkpoint.verify(last) == 3 and checkpoint.verify(run / "checkpoint-2") == 2
    assert not (run / "checkpoint-2" / "model.safetensors").exists()  # exported at the end only
    exported = AutoModelForCausalLM.from_pretrained(last).state_dict()
    assert_same_parameters({k: params[k] for k in exported}, exported)
    saved = lambda folder: sorted(safe_open(folder / "model.safetensors", "pt").keys())
    assert saved(last) == saved(tmp_path / "one" / "checkpoint-3")  # the tied head once, as one process saves it


class Killed(Exception):
    pass


@pytest.mark.slow
def test_resume_at_two_and_at_one_process(tied, tmp_path, monkeypatch):
    """A 2-process run killed right after its checkpoint of step 2, resumed with 2 and with 1 process, ends where an
    unbroken run does; so does a 1-process run killed there and resumed with 2 (its optimizer.pt sharded by FSDP2)."""
    values = dict(max_steps=4, save_steps=2, beta=0.04, lr_scheduler_type="linear")
    killed = tmp_path / "killed"
    first = options(tied, killed, **values, per_device_train_batch_size=4, params_file=str(tmp_path / "unused.pt"))
    done = drive([first], tmp_path, "--die-after-save", 2)
    assert done.returncode != 0 and checkpoint.latest(killed).name == "checkpoint-2"
    assert checkpoint.is_sharded(checkpoint.latest(killed))
    shutil.copytree(killed, tmp_path / "again")
    _, unbroken = one_process(options(tied, tmp_path / "unbroken", **values))

    alone = Trainer(TrainConfig(**options(tied, tmp_path / "alone", **values)))
    save = alone.save

    def save_then_die():
        path = save()
        if alone.step == 2:
            raise Killed
        return path

    monkeypatch.setattr(alone, "save", save_then_die)
    with pytest.raises(Killed):
        alone.train()
    assert not checkpoint.is_sharded(checkpoint.latest(tmp_path / "alone"))

    resumed = [{**first, "resume": True, "params_file": str(tmp_path / "two.pt")},
               {**first, "output_dir": str(tmp_path / "alone"), "resume": True,
                "params_file": str(tmp_path / "from-one.pt")}]
    done = drive(resumed, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_parameters(unbroken, torch.load(tmp_path / "two.pt"))
    assert_same_parameters(unbroken, torch.load(tmp_path / "from-one.pt"))

    _, one = one_process(options(tied, tmp_path / "again", **values, resume=True))
    assert_same_parameters(unbroken, one)


FAILING_REWARD = """
import os, time

def reward(prompts, completions, **columns):
    if os.environ["RANK"] == "1":
        if os.environ.get("HANG"):
            time.sleep(600)
        raise RuntimeError("rank one's reward is broken")
    return [0.0] * len(completions)
"""


@pytest.mark.parametrize("hang", [False, True])
@pytest.mark.slow
def test_a_failing_rank_stops_every_rank(tied, tmp_path, hang):
    """A reward that raises on rank 1 ends both ranks with its error; one that hangs there ends rank 0 when the
    collective's timeout (ddp_timeout) runs out, and torchrun then stops rank 1."""
    (tmp_path / "failing_reward.py").write_text(FAILING_REWARD)
    values = options(tied, tmp_path / "run", per_device_train_batch_size=4, reward_funcs=["failing_reward:reward"],
                     ddp_timeout=10)
    start = time.monotonic()
    done = torchrun("-m", "fastgrpo", "train", *flags(values), timeout=240,
                    env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                         "HANG": "1" if hang else ""})
    assert done.returncode != 0
    assert time.monotonic() - start < 180
    if hang:
        assert "rank 0: no answer from every process within ddp_timeout=10 s" in done.stderr, done.stderr[-3000:]
    else:
        assert ("fastgrpo train: error: rank 1 failed in sampling and rewards: RewardError: reward function "
                "'failing_reward:reward' raised RuntimeError: rank one's reward is broken") in done.stderr, (
                    done.stderr[-3000:])


FAILING_ON_RANK_1 = """
import os


def failing(what):
    if os.environ["RANK"] == "1" and os.environ["FAIL"] == what:
        raise RuntimeError(f"rank one's {what} is broken")


def reward(prompts, completions, **columns):
    failing("reward")
    return [float(i % 2) for i in range(len(completions))]


def rollout(prompts, trainer):
    failing("rollout")
    n = len(prompts)
    return {"prompt_ids": [[1, 2]] * n, "completion_ids": [[3, 4]] * n, "logprobs": None}
"""


@pytest.mark.parametrize("failing", ["reward", "rollout"])
@pytest.mark.slow
def test_a_rank_failing_before_the_first_step_leaves_no_run(tied, tmp_path, failing):
    """Issue 41: a reward function or rollout_func that raises on rank 1 before step 1 is done: rank 0 removes what
    the run wrote, as one process does (before: the folder stayed, and the same command was then refused)."""
    (tmp_path / "failing_on_rank_1.py").write_text(FAILING_ON_RANK_1)
    run = tmp_path / "run"
    values = options(tied, run, per_device_train_batch_size=4, ddp_timeout=60, parallelism="ddp",
                     reward_funcs=["failing_on_rank_1:reward"],
                     **({"rollout_func": "failing_on_rank_1:rollout"} if failing == "rollout" else {}))
    done = torchrun("-m", "fastgrpo", "train", *flags(values), timeout=240,
                    env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "FAIL": failing})
    assert done.returncode != 0
    said = {"reward": "reward function 'failing_on_rank_1:reward' raised RuntimeError: rank one's reward is broken",
            "rollout": "rollout_func 'failing_on_rank_1:rollout' raised RuntimeError: rank one's rollout is broken"}
    assert "fastgrpo train: error: rank 1 failed in " in done.stderr, done.stderr[-3000:]
    assert said[failing] in done.stderr, done.stderr[-3000:]
    assert not run.exists(), sorted(p.name for p in run.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp_step_on_gpus(tied, tmp_path):
    """One FSDP2 step on the GPUs there are (NCCL; bf16 weights, fp32 gradient reduction): two GPUs, or one GPU as a
    group of one process."""
    gpus = min(torch.cuda.device_count(), 2)
    values = options(tied, tmp_path / "run", per_device_train_batch_size=16 // gpus, max_steps=1, beta=0.04,
                     bf16=True, parallelism="fsdp")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), "-m",
               "fastgrpo", "train", *flags(values)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = read_metrics(tmp_path / "run")[1:]
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0 and row["peak_memory_gib"] > 0
    assert checkpoint.is_sharded(tmp_path / "run" / "checkpoint-1")


# -- the pieces, in one process ---------------------------------------------------------------------------------------


def test_shares_cover_the_batch_in_order():
    for n in (0, 1, 5, 8):
        for size in (1, 2, 3):
            shares = [World(rank, size).share(n) for rank in range(size)]
            assert [i for share in shares for i in share] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_merged_metrics_are_those_of_the_whole_micro_batch():
    # Two micro-batches; rank 0 and rank 1 hold (loss tokens, samples) shares of each.
    rank0 = ({"loss": [0.5], "kl": [0.2, 0.4], "clip_ratio/low_min": [0.1, math.nan], "clip_ratio/high_max": [0.3, 0.0],
              "clip_ratio/low_mean": [0.5, 0.0], "grad_norm": [2.0]}, [(3, 4), (0, 4)])
    rank1 = ({"loss": [0.25], "kl": [0.8, 0.1], "clip_ratio/low_min": [0.2, 0.0], "clip_ratio/high_max": [0.1, 0.2],
              "clip_ratio/low_mean": [1.0, 0.5], "grad_norm": [2.0]}, [(1, 4), (2, 4)])
    merged = merge_metrics([rank0, rank1], sequence_level=False)
    assert merged["loss"] == [0.75] and merged["grad_norm"] == [2.0]
    assert merged["kl"] == pytest.approx([(0.2 * 3 + 0.8 * 1) / 4, 0.1])  # a share without tokens weighs nothing
    assert merged["clip_ratio/low_min"] == [0.1, 0.0] and merged["clip_ratio/high_max"] == [0.3, 0.2]
    assert merged["clip_ratio/low_mean"] == pytest.approx([(0.5 * 3 + 1.0) / 4, 0.5])
    by_samples = merge_metrics([rank0, rank1], sequence_level=True)  # sequence-level ratios: a mean over samples
    assert by_samples["clip_ratio/low_mean"] == pytest.approx([0.75, 0.25])
    assert merge_metrics([rank0], sequence_level=False) is rank0[0]
