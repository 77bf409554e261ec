"""What a user meets first, through the command line: their own reward modules, data rows checked at load, reward
functions that return what is not a reward, `fastgrpo plan`, `--resume` with changed or missing files, `--help` and
`--version`. Every error is one line naming the option, file, row or function, with a non-zero exit."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastgrpo.cli import main
from fastgrpo.train import checkpoint
from fastgrpo.train.config import DEFAULT_RECIPE
from fastgrpo.train.logs import read_metrics

TINY = ["--max-completion-length", "4", "-G", "4", "--per-device-train-batch-size", "8", "--eval-num-samples", "4",
        "--report-to", "none", "--disable-tqdm", "--seed", "3"]  # fmt: skip


def train_args(assets, out: Path, *extra: str) -> list[str]:
    return ["train", "--model-name-or-path", assets["model"], "--dataset-name", assets["data"], "--output-dir",
            str(out), *TINY, *extra]


def fails(capsys, argv: list[str], code: int = 2) -> str:
    """`fastgrpo <argv>` exits with `code`, printing one line on stderr: that line."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def data_with(tmp_path: Path, rows: list[dict]) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


# -- the user's own modules ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_reward_module_in_the_working_directory_imports_from_the_console_script(assets, tmp_path):
    script = Path(sys.executable).parent / "fastgrpo"
    if not script.is_file():
        pytest.skip("the fastgrpo console script is not installed beside this Python")
    (tmp_path / "mymod.py").write_text("def short(completions, **kwargs):\n"
                                       "    return [-len(c) for c in completions]\n")
    argv = train_args(assets, tmp_path / "run", "--reward-funcs", "mymod:short", "--max-steps", "1",
                      "--save-steps", "0")[1:]
    done = subprocess.run([str(script), "train", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rewards/short/mean" in (tmp_path / "run" / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_a_user_reward_function_on_the_builtin_task_prints_no_third_party_line(tmp_path):
    """`fastgrpo train --reward-funcs my.py:fn accuracy`: the reward function gets a transformers TrainerState, whose
    import pulls in peft and bitsandbytes; bitsandbytes logged "Failed to load CPU gemm_4bit_forward from
    kernels-community ..." as it was imported on a CPU with AVX512-BF16 (issue 41). stderr holds fastgrpo's own line
    only; stdout the progress and the summary."""
    (tmp_path / "my.py").write_text("def fn(completions, **kwargs):\n    return [-len(c) / 10 for c in completions]\n")
    done = subprocess.run([sys.executable, "-m", "fastgrpo", "train", "--reward-funcs", "my.py:fn", "accuracy",
                           "--max-steps", "1", "--eval-num-samples", "8", "--output-dir", "run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        f"fastgrpo train: no --config: the built-in arithmetic recipe ({DEFAULT_RECIPE})"], done.stderr
    assert all(line.startswith(("step 1/1", "fastgrpo: held-out accuracy")) for line in done.stdout.splitlines()), (
        done.stdout)
    assert "rewards/fn/mean" in (tmp_path / "run" / "metrics.jsonl").read_text()


# -- data rows, checked at load -------------------------------------------------------------------------------------


@pytest.fixture
def templated(assets, tmp_path) -> str:
    """The tiny model with a chat template that, as many do, raises on a role it does not know."""
    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings["chat_template"] = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                                 "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                                 "{{ m['content'] }}{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    return str(model)


def data_error(capsys, assets, tmp_path, model: str, rows: list[dict]) -> str:
    return fails(capsys, train_args(assets, tmp_path / "run", "--dataset-name", str(data_with(tmp_path, rows)),
                                    "--model-name-or-path", model))


def test_rows_mixing_strings_and_messages_are_refused_naming_the_row(assets, tmp_path, capsys, templated):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}]
    line = data_error(capsys, assets, tmp_path, templated, rows)
    assert "train.jsonl, row 2 (line 2)" in line and "messages here but text in the split's first row" in line


def test_message_content_null_is_refused_naming_the_row(assets, tmp_path, capsys, templated):
    rows = [{"prompt": [{"role": "user", "content": None}], "answer": "2"}]
    line = data_error(capsys, assets, tmp_path, templated, rows)
    assert "train.jsonl, row 1 (line 1)" in line and "{'role': str, 'content': str}" in line


def test_a_role_the_chat_template_refuses_is_one_line_naming_the_row(assets, tmp_path, capsys, templated):
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"},
            {"prompt": [{"role": "robot", "content": "2+2="}], "answer": "4"}]
    line = data_error(capsys, assets, tmp_path, templated, rows)
    assert "train.jsonl, row 2 (line 2), prompt column 'prompt'" in line and "unknown role robot" in line


# -- reward functions that return what is not a reward ---------------------------------------------------------------


REWARDS = '''
import numpy as np


def too_few(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def words(completions, **kwargs):
    return ["good" for _ in completions]


def as_numpy(completions, **kwargs):
    return np.array([float(len(c)) for c in completions])


def short_log_extra(completions, log_extra, **kwargs):
    log_extra("note", ["x"])
    return [0.0 for _ in completions]


def late(completions, trainer_state, **kwargs):
    return [0.0] * (len(completions) - (trainer_state.global_step >= 1))
'''


@pytest.fixture
def rewards_file(tmp_path) -> Path:
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return tmp_path / "my_rewards.py"


@pytest.mark.parametrize("function, said", [
    ("too_few", "must return a sequence of 8 numbers (one per completion), got 7 values"),
    ("words", "returned 'good' for sample 0"),
    ("short_log_extra", "log_extra('note', ...) was given 1 values; it takes one per completion of the call (8)"),
])  # fmt: skip
def test_bad_reward_values_are_one_line_exit_1(assets, tmp_path, capsys, rewards_file, function, said):
    line = fails(capsys, train_args(assets, tmp_path / "run", "--reward-funcs", f"{rewards_file}:{function}",
                                    "--max-steps", "1", "--log-completions"), code=1)
    assert line.startswith(f"fastgrpo train: error: reward function '{rewards_file}:{function}'") and said in line
    assert not (tmp_path / "run").exists()  # no step done: the run's files and the folder it made are gone


def test_a_reward_error_after_a_step_keeps_the_run(assets, tmp_path, capsys, rewards_file):
    """What a run wrote is discarded only when no step was done: a failure in step 2 keeps step 1's metrics."""
    line = fails(capsys, train_args(assets, tmp_path / "run", "--reward-funcs", f"{rewards_file}:late",
                                    "--max-steps", "2"), code=1)
    assert "reward function" in line and "got 7 values" in line
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_a_numpy_array_of_rewards_is_accepted_as_trl_does(assets, tmp_path, rewards_file):
    main(train_args(assets, tmp_path / "run", "--reward-funcs", f"{rewards_file}:as_numpy", "--max-steps", "1",
                    "--save-steps", "0"))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["rewards/as_numpy/mean"] > 0


# -- fastgrpo plan ---------------------------------------------------------------------------------------------------


def test_plan_honours_kv_cache_blocks_and_loss_chunk_tokens(capsys):
    main(["plan", "--device", "cpu"])
    default = capsys.readouterr().out
    main(["plan", "--device", "cpu", "--kv-cache-blocks", "100000", "--loss-chunk-tokens", "512"])
    out = capsys.readouterr().out
    assert "kv_blocks 100000" in out and "loss_chunk_tokens 512" in out
    assert "kv_blocks 100000" not in default
    assert out.splitlines()[0].startswith("fastgrpo plan: the built-in model on cpu")


def test_plan_columns_are_apart_and_without_memory_it_says_what_to_pass(capsys):
    main(["plan"])
    out = capsys.readouterr().out.splitlines()
    header = out[1]
    assert "logprobs  train: forward  train: loss  train: backward" in header
    assert out[-1].startswith("no --gpu-memory given: pass the device's memory")


# -- the KV pool ---------------------------------------------------------------------------------------------------


def test_kv_cache_blocks_too_few_or_too_many_is_refused_before_loading(assets, tmp_path, capsys):
    """--kv-cache-blocks against one prompt group's pages (-G 4 completions of 4 tokens after a prompt of under 12:
    4 pages of 16 tokens) and against the memory there is (10**9 pages of 8 KiB: 7.5 TiB), before the model loads:
    the engine would say the first only at the first evaluation, in its own names, and build the second's page
    lists until the kernel killed the process."""
    said = fails(capsys, train_args(assets, tmp_path / "few", "--kv-cache-blocks", "1"))
    assert said == ("fastgrpo train: error: --kv-cache-blocks 1 is too few: sampling needs a prompt's pages and one "
                    "completion's (of up to --max-completion-length 4 tokens; the --num-generations 4 completions can "
                    "run one after another), 2 pages of 16 tokens; give at least 2, or leave it unset to size the pool "
                    "from --sampling-memory-fraction")
    said = fails(capsys, train_args(assets, tmp_path / "many", "--kv-cache-blocks", str(10**9)))
    assert said.startswith("fastgrpo train: error: --kv-cache-blocks 1000000000 is too many: the KV pool would take "
                           "7629.4 GiB (8192 bytes a page), and "), said
    assert "GiB is available (MemAvailable in /proc/meminfo); at most " in said
    assert not (tmp_path / "few").exists() and not (tmp_path / "many").exists()
    main(train_args(assets, tmp_path / "two", "--kv-cache-blocks", "2", "--max-steps", "1"))  # the engine's least


# -- --resume --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_steps(assets, tmp_path_factory) -> Path:
    """A finished 2-step run with checkpoints at steps 1 and 2, started with --overwrite-output-dir."""
    out = tmp_path_factory.mktemp("two") / "run"
    main(train_args(assets, out, "--max-steps", "2", "--save-steps", "1", "--save-total-limit", "2",
                    "--overwrite-output-dir"))
    return out


@pytest.fixture
def run_copy(two_steps, tmp_path) -> Path:
    shutil.copytree(two_steps, tmp_path / "run")
    return tmp_path / "run"


def test_resume_of_an_overwrite_run_works_and_counts_the_steps_it_ran(run_copy, capsys):
    main(["train", "--output-dir", str(run_copy), "--resume", "--max-steps", "3"])
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "steps 3-3 in" in summary and "resumed from step 2 (3 steps in" in summary


def test_resume_with_changed_options_says_so_and_keeps_the_earlier_config(run_copy, capsys):
    """Issue 41: a resume that changes options (not the model's or optimizer's, which are refused) says in one line
    what changed and keeps the config steps 1-2 ran with in config_history.yaml; config.yaml holds the new one."""
    earlier = yaml.safe_load((run_copy / "config.yaml").read_text())
    main(["train", "--output-dir", str(run_copy), "--resume", "--max-steps", "3", "--temperature", "0.9"])
    history = run_copy / "config_history.yaml"
    assert capsys.readouterr().err.splitlines() == [
        "fastgrpo train: resuming at step 2 with changed options: --temperature 1.0 -> 0.9, --max-steps 2 -> 3; steps "
        f"up to 2 ran with the earlier ones, kept in {history}"]
    assert yaml.safe_load(history.read_text()) == [{"until_step": 2, "config": earlier}]
    now = yaml.safe_load((run_copy / "config.yaml").read_text())
    assert (now["temperature"], now["max_steps"]) == (0.9, 3)
    shutil.rmtree(run_copy / "checkpoint-3")  # as if killed before it: resumed from step 2 again, nothing changed
    main(["train", "--output-dir", str(run_copy), "--resume"])
    assert "changed options" not in capsys.readouterr().err
    assert yaml.safe_load(history.read_text()) == [{"until_step": 2, "config": earlier}]
    main(["train", "--output-dir", str(run_copy), "--resume", "--max-steps", "4"])  # from step 3: one more entry
    assert [e["until_step"] for e in yaml.safe_load(history.read_text())] == [2, 3]


def test_resume_refuses_another_model(run_copy, capsys, tmp_path, assets):
    other = tmp_path / "other"
    shutil.copytree(assets["model"], other)
    line = fails(capsys, ["train", "--output-dir", str(run_copy), "--resume", "--max-steps", "3",
                          "--model-name-or-path", str(other)])
    assert f"resume: --model-name-or-path '{other}', the run's is '{assets['model']}'" in line


def test_resume_without_the_runs_config_yaml_is_refused(run_copy, capsys):
    (run_copy / "config.yaml").unlink()
    line = fails(capsys, ["train", "--output-dir", str(run_copy), "--resume", "--max-steps", "3"])
    assert f"--resume: {run_copy / 'config.yaml'} is missing" in line


def test_a_checkpoint_without_config_json_falls_back_to_the_previous_one(run_copy):
    (run_copy / "checkpoint-2" / "config.json").unlink()
    with pytest.warns(UserWarning, match=r"checkpoint-2/config.json is missing; resuming from .*checkpoint-1"):
        assert checkpoint.resume_point(run_copy) == (run_copy / "checkpoint-1", 1)


# -- --help and --version ----------------------------------------------------------------------------------------------


def test_help_gives_one_default_per_option_and_the_recipes_values(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "train in bfloat16 (default: on CUDA yes, on CPU no) --gradient" in text
    assert "(default: 1e-06) [built-in recipe: 0.0003]" in text


def test_version(capsys):
    import fastgrpo

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"fastgrpo {fastgrpo.__version__}"



@pytest.mark.parametrize("argv, said", [
    (["--max-steps", "x"], "argument --max-steps: invalid int value: 'x' (see fastgrpo train --help)"),
    (["--loss-type", "foo"], "argument --loss-type: invalid choice: 'foo'"),
    (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
    (["--kv-cache-blocks", "0"], "--kv-cache-blocks must be at least 1 (or None), got 0"),
    (["--gpu-memory", "lots"], "--gpu-memory: 'lots' is not a memory size"),
    (["--dataset-name", "/nonexistent"], "--dataset-name: /nonexistent does not exist"),
    (["--config", "missing.yaml"], "config file missing.yaml does not exist"),
    (["--reward-funcs", "nomodule:fn"], "reward function 'nomodule:fn': cannot import 'nomodule'"),
    (["--lr-scheduler-type", "nope"], "--lr-scheduler-type: 'nope' is not one of transformers' schedules"),
])  # fmt: skip
def test_bad_options_are_one_line_naming_the_flag(tmp_path, capsys, argv, said):
    with pytest.raises(SystemExit) as stop:
        main(["train", *argv, "--output-dir", str(tmp_path / "run"), "--max-completion-length", "4"])
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "no --config: the built-in" not in line]
    assert len(lines) == 1 and lines[0].startswith("fastgrpo train: error: ") and said in lines[0], lines
