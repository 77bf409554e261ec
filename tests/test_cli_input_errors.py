"""Bad input to `fastgrpo train` and the engine: refused before anything runs, with an error that names what to fix
(the option, the file and line, the function and sample), leaving every file outside the run as it was.

The tiny model and dataset come from conftest's `assets` fixture; a failing run's output_dir is tmp_path / "run",
its inputs live in tmp_path / "in".
"""

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from cli_helpers import untouched
from helpers import tiny_config
from train_helpers import make_config
from transformers import GPT2Config, Qwen2Config, Qwen2ForCausalLM

from fastgrpo.bench import environment, results_stem
from fastgrpo.bench import loss as loss_bench
from fastgrpo.bench import sampling as sampling_bench
from fastgrpo.bench import trl_step as trl_bench
from fastgrpo.cli import main
from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.sampling.engine import context_window
from fastgrpo.train import TrainConfig
from fastgrpo.train.data import PromptOrder, load_rows, prepare
from fastgrpo.train.loading import load_tokenizer
from fastgrpo.train.rewards import RewardError, Rewards


@pytest.fixture
def inputs(tmp_path) -> Path:
    (tmp_path / "in").mkdir()
    return tmp_path / "in"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def train_error(capsys, *args) -> str:
    """stderr of a `fastgrpo train` that must fail before training."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# -- config values -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_one_generation_per_prompt_is_refused(assets, tmp_path, scale_rewards):
    with pytest.raises(ValueError, match=r"num_generations must be >= 2, got 1"):
        make_config(assets, tmp_path, num_generations=1, scale_rewards=scale_rewards)


def test_float_options_take_numeric_strings_as_yaml_and_trl_do(assets, inputs):
    path = inputs / "run.yaml"
    path.write_text(f"model_name_or_path: {assets['model']}\ndataset_name: {assets['data']}\nlearning_rate: 1e-4\n"
                    "epsilon_high: 2E-1\nreward_funcs: [accuracy, length]\nreward_weights: [1, 5e-1]\n")
    config = TrainConfig.from_yaml(path)
    assert (config.learning_rate, config.epsilon_high, config.reward_weights) == (1e-4, 0.2, [1.0, 0.5])
    assert all(type(v) is float for v in (config.learning_rate, config.epsilon_high, *config.reward_weights))
    for line, message in (("learning_rate: 1e-4x", r"learning_rate must be float, got '1e-4x' \(str\)"),
                          ("warmup_ratio: .nan", "warmup_ratio must be finite"),
                          ("beta: 'inf'", "beta must be finite"),
                          ("reward_weights: [one]", r"reward_weights must be list\[float\]"),
                          ("max_steps: '10'", "max_steps must be int")):
        path.write_text(f"model_name_or_path: {assets['model']}\ndataset_name: {assets['data']}\n{line}\n")
        with pytest.raises((TypeError, ValueError), match=message):
            TrainConfig.from_yaml(path)


def test_seed_out_of_range_is_named_with_its_range(assets, tmp_path, capsys):
    for seed in (2**70, 2**32, -1):
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32\)"):
            make_config(assets, tmp_path, seed=seed)
    err = train_error(capsys, "--model-name-or-path", assets["model"], "--dataset-name", assets["data"],
                      "--output-dir", str(tmp_path / "run"), "--seed", str(2**70))
    assert f"seed must be in [0, 2**32) (numpy's and transformers.set_seed's range), got {2**70}" in err
    assert not (tmp_path / "run").exists()
    # The largest seed is usable everywhere it goes: the data order (seed * 1_000_003 + epoch) and torch.
    largest = make_config(assets, tmp_path, seed=2**32 - 1).seed
    assert len(PromptOrder(10, largest).next(25)) == 25
    torch.manual_seed(largest)


# -- config files --------------------------------------------------------------------------------------------------


def test_yaml_duplicate_key_names_the_key_and_both_lines(assets, inputs, capsys):
    path = inputs / "run.yaml"
    path.write_text(f"model_name_or_path: {assets['model']}\nlearning_rate: 1.0e-3\ndataset_name: {assets['data']}\n"
                    "learning_rate: 1.0e-6\n")
    with pytest.raises(ValueError, match=r"config file .*run\.yaml, line 4, column 1: duplicate key "
                                         r"'learning_rate' \(first on line 2\)"):
        TrainConfig.from_yaml(path)
    path.write_text("reward_funcs: [accuracy]\nreward_weights: [1.0]\n  \nsave_steps: 1\nreward_funcs: [format]\n")
    with untouched(inputs):
        err = train_error(capsys, "--config", str(path))
    assert "line 5, column 1" in err and "duplicate key 'reward_funcs' (first on line 1)" in err


@pytest.mark.parametrize("text, where, problem", [
    ("learning_rate: 1.0e-4\n\tbeta: 0.1\n", "line 2, column 1", "found character '\\t'"),
    ("reward_funcs: [accuracy, format\nbeta: 0.1\n", "line 2, column 5", "expected ',' or ']'"),
    ("[model]\nname = 'qwen'\n", "line 2, column 1", "expected '<document start>'"),
    ("max_steps: 10\n'unclosed\n", "line 3, column 1", "found unexpected end of stream"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "line 1", "not UTF-8 text (byte 0x89)"),
    ("beta: 0.1\n\x07bell: 1\n", "line 2, column 1", "special characters are not allowed"),
])  # fmt: skip
def test_non_yaml_config_names_the_file_and_line(inputs, capsys, text, where, problem):
    path = inputs / "config.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as info:
        TrainConfig.from_yaml(path)
    message = str(info.value)
    assert message.startswith(f"config file {path}, {where}") and problem in message and "\n" not in message, message
    with untouched(inputs):
        assert f"config file {path}, {where}" in train_error(capsys, "--config", str(path))


# -- data files ----------------------------------------------------------------------------------------------------


GOOD = {"prompt": "1+2=", "answer": "3"}


@pytest.mark.parametrize("name, content, message", [
    ("train.jsonl", "", "holds no rows"),
    ("train.jsonl", "\n  \n\n", "holds no rows"),
    ("train.jsonl", [GOOD, "", '{"prompt": "2+2=", "answer": }'], r"line 3, column 30: not valid JSON"),
    ("train.jsonl", [GOOD, GOOD, '{"prompt": "2+2=", "answer": "4"']
     , r"line 3, column 33: not valid JSON \(Expecting ',' delimiter\)"),
    ("train.jsonl", [GOOD, '["2+2=", "4"]'], "line 2: a row must be a JSON object, got list"),
    ("train.json", '[{"prompt": "1+2=", "answer": "3"},\n {"prompt": "2+2=" "answer": "4"}]', "line 2, column 20"),
    ("train.json", "[]", "holds no rows"),
    ("train.json", '[{"prompt": "1+2="}, 7]', "row 2: a row must be a JSON object, got int"),
    ("train.jsonl", b'{"prompt": "1+2="}\n{"prompt": "\xff"}\n', r"line 2: not UTF-8 text \(byte 0xff\)"),
    ("train.parquet", "not parquet", "not a readable parquet file"),
])  # fmt: skip
def test_bad_data_file_names_the_file_and_line(assets, tmp_path, inputs, name, content, message):
    path = inputs / name
    if isinstance(content, list):
        write_jsonl(path, content)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for dataset_name in (path, inputs):  # the file itself, and a folder of split files
        config = make_config(assets, tmp_path, dataset_name=str(dataset_name), dataset_test_split=None)
        with untouched(inputs), pytest.raises(ValueError, match=f"dataset file {path}[ ,:].*{message}") as info:
            load_rows(config, "train")
        assert "\n" not in str(info.value)


def test_null_answer_is_refused_naming_file_row_line_and_column(assets, tmp_path, inputs, capsys):
    """Refused rather than skipped: a null answer is a broken row, and skipping it would silently shrink the data."""
    path = write_jsonl(inputs / "train.jsonl", [GOOD, "", {"prompt": "2+2=", "answer": None}, GOOD])
    config = make_config(assets, tmp_path, dataset_name=str(path), dataset_test_split=None)
    with untouched(inputs), pytest.raises(ValueError, match=rf"{path}, row 2 \(line 3\): answer column 'answer' is "
                                                            "null or missing"):
        prepare(load_rows(config, "train"), load_tokenizer(config), config, "train")
    write_jsonl(path, [GOOD, {"prompt": "2+2="}])  # no answer key at all
    with pytest.raises(ValueError, match=rf"{path}, row 2 \(line 2\): answer column 'answer' is null or missing"):
        prepare(load_rows(config, "train"), load_tokenizer(config), config, "train")
    held_out = write_jsonl(inputs / "test.jsonl", [GOOD, GOOD, {"prompt": "1+1=", "answer": None}])
    write_jsonl(path, [GOOD])
    run = tmp_path / "run"
    with untouched(inputs, Path(assets["model"])):
        err = train_error(capsys, "--model-name-or-path", assets["model"], "--dataset-name", str(path),
                          "--dataset-test-split", str(held_out), "--output-dir", str(run), "--num-generations", "2",
                          "--max-completion-length", "5")
    assert f"{held_out}, row 3 (line 3): answer column 'answer' is null" in err
    assert not run.exists() or not any(run.iterdir())
    config = make_config(assets, tmp_path, dataset_name=str(path), dataset_test_split=None, answer_column=None)
    write_jsonl(path, [GOOD, {"prompt": "2+2=", "answer": None}])
    assert len(prepare(load_rows(config, "train"), load_tokenizer(config), config, "train").rows) == 2


# -- the context window --------------------------------------------------------------------------------------------


def test_prompt_past_the_context_window_is_refused_naming_row_and_options(assets, tmp_path, inputs):
    """The assets model has 64 positions; its tokenizer is one token per character."""
    long_prompt = "1" * 61 + "+1="  # 64 tokens
    path = write_jsonl(inputs / "train.jsonl", [GOOD, GOOD, {"prompt": long_prompt, "answer": "2"}])

    def prepared(**overrides):
        config = make_config(assets, tmp_path, dataset_name=str(path), dataset_test_split=None, **overrides)
        return prepare(load_rows(config, "train"), load_tokenizer(config), config, "train")

    with pytest.raises(ValueError, match=rf"{path}, row 3 \(line 3\): the prompt has 64 tokens \(max_prompt_length="
                                         r"None\), which with max_completion_length=5 exceed the model's context "
                                         r"window of 64 positions; lower max_prompt_length to 59 or less"):
        prepared(max_prompt_length=None)
    with pytest.raises(ValueError, match=r"row 3 .*the prompt has 60 tokens \(max_prompt_length=60\), which with "
                                         r"max_completion_length=5 exceed .* lower max_prompt_length to 59 or less"):
        prepared(max_prompt_length=60)
    with pytest.raises(ValueError, match=rf"max_completion_length=64 leaves no room for a prompt in the context "
                                         rf"window of {assets['model']} \(64 positions\); lower it below 64"):
        prepared(max_completion_length=64)
    prompts = prepared(max_prompt_length=59)  # cut to fit: 59 + 5 = 64 positions
    assert len(prompts.token_ids[2]) == 59 and prompts.prompts[2] == long_prompt


def test_engine_refuses_to_sample_past_the_context_window():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(Qwen2Config, 16)).eval()  # 64 positions
    engine = Engine(model)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] has 60 tokens: with max_new_tokens=5 they reach past "
                                         "the model's context window of 64 positions"):
        engine.generate([[3] * 10, [3] * 60], params=SamplingParams(max_new_tokens=5, stop_token_ids=()))
    (out,) = engine.generate([[3] * 59], params=SamplingParams(max_new_tokens=5, stop_token_ids=(), seed=0))
    assert len(out[0].token_ids) == 5
    assert context_window(GPT2Config(n_positions=128)) == 128
    unknown = types.SimpleNamespace(get_text_config=lambda: types.SimpleNamespace(hidden_size=32))
    assert context_window(unknown) is None  # unknown: nothing is checked


def test_engine_refuses_a_pool_larger_than_memory_before_building_it():
    """10**12 pages: refused before the pool's page lists (48 bytes a page) are built."""
    model = Qwen2ForCausalLM(tiny_config(Qwen2Config, 16)).eval()
    with pytest.raises(ValueError, match=r"num_blocks=1000000000000 pages of \d+ bytes take more than the [\d.]+ GiB "
                                         r"available on cpu; at most \d+"):
        Engine(model, num_blocks=10**12).generate([[3] * 4], params=SamplingParams(max_new_tokens=2, stop_token_ids=()))


def test_the_pool_check_reads_the_process_address_space_limit():
    """A process under RLIMIT_AS (ulimit -v) has less room than MemAvailable says: the KV pool check reads the limit
    (and a cgroup v2 memory.max), so a pool that fits the machine but not the process is refused in one line."""
    code = (
        "import resource, torch\n"
        "from transformers import Qwen2Config, Qwen2ForCausalLM\n"
        "from fastgrpo.sampling import Engine, SamplingParams\n"
        "from fastgrpo.sampling.engine import available_memory\n"
        "free = available_memory(torch.device('cpu'))\n"
        "model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2,"
        " num_attention_heads=4, num_key_value_heads=4)).eval()\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2**30 * 6, resource.RLIM_INFINITY))\n"
        "limited = available_memory(torch.device('cpu'))\n"
        "assert limited < min(free, 2**30 * 6), (limited, free)\n"
        "pages = int(1.5 * limited) // (2 * 2 * 16 * 4 * 16 * 4)\n"  # 1.5x the room, in pages of 16 positions
        "try:\n"
        "    Engine(model, num_blocks=pages).generate([[3] * 4], params=SamplingParams(max_new_tokens=2,"
        " stop_token_ids=()))\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.fullmatch(r"num_blocks=\d+ pages of \d+ bytes take more than the [\d.]+ GiB available on cpu; at most "
                        r"\d+\n", out.stdout), out.stdout


# -- rewards -------------------------------------------------------------------------------------------------------


REWARDS = """
import numpy as np
import torch

def huge(prompts, completions, **kw):
    return [0.0, 1e39, 0.0]

def big(prompts, completions, **kw):
    return [0.0, 0.0, 3e38]

def scalars(prompts, completions, **kw):
    return [np.float32(0.5), np.float64(-1.0), np.int64(2)]

def tensors(prompts, completions, **kw):
    return [torch.tensor(0.25), torch.tensor(3), torch.tensor(1.5, dtype=torch.float64)]

def vector(prompts, completions, **kw):
    return [torch.tensor([1.0]), 0.0, 0.0]

def flag(prompts, completions, **kw):
    return [0.0, np.bool_(True), 0.0]
"""


def test_rewards_must_be_finite_in_float32_naming_function_and_sample(inputs):
    module = inputs / "my_rewards.py"
    module.write_text(REWARDS)
    prompts, completions, ids = ["p0", "p1", "p2"], ["a", "bb", "ccc"], [[1], [2, 2], [3, 3, 3]]
    score = lambda names, weights=None: Rewards([f"{module}:{n}" for n in names], weights, 8)(
        prompts, completions, ids, {})
    with pytest.raises(RewardError, match=r"'.*my_rewards\.py:huge' returned 1e\+39 for sample 1 \(prompt 'p1', "
                                          r"completion 'bb'\); rewards must be numbers finite in float32"):
        score(["huge"])
    with pytest.raises(RewardError, match=r"weighted sum of the rewards is not finite in float32 for sample 2 .*"
                                          r"'ccc'.*my_rewards\.py:big': 3\.0\d*e\+38.*reward_weights \[2\.0\]"):
        score(["big"], [2.0])
    for name, shown in (("vector", r"tensor\(\[1\.\]\) for sample 0"), ("flag", r"(np\.)?True_? for sample 1")):
        with pytest.raises(RewardError, match=f":{name}' returned {shown}"):
            score([name])
    per_function, total = score(["scalars", "tensors"], [1.0, 2.0])
    assert per_function.dtype == torch.float32
    assert per_function.tolist() == [[0.5, 0.25], [-1.0, 3.0], [2.0, 1.5]] and total.tolist() == [1.0, 5.0, 5.0]


# -- models and datasets that are not there ------------------------------------------------------------------------


def test_missing_local_paths_are_named_without_asking_the_hub(assets, tmp_path, inputs, capsys):
    (inputs / "not-a-model").mkdir()
    (inputs / "not-a-model" / "notes.txt").write_text("x")
    run = tmp_path / "run"
    cases = [
        ("--model-name-or-path", "./models/qwen", "--model-name-or-path: ./models/qwen does not exist (a local path, "
                                                  "so the hub was not asked)"),
        ("--model-name-or-path", str(inputs / "nowhere"), f"--model-name-or-path: {inputs / 'nowhere'} does not exist"),
        ("--model-name-or-path", "~/no/such/model", "--model-name-or-path: ~/no/such/model does not exist"),
        ("--model-name-or-path", str(inputs / "not-a-model"), f"--model-name-or-path: the folder {inputs}/not-a-model "
                                                              "is not a transformers model (it holds no config.json)"),
        ("--dataset-name", "./data/gsm8k", "--dataset-name: ./data/gsm8k does not exist (a local path, so the hub was "
                                           "not asked)"),
        ("--dataset-name", str(inputs / "nowhere"), f"--dataset-name: {inputs / 'nowhere'} does not exist"),
    ]
    for option, value, message in cases:
        args = {"--model-name-or-path": assets["model"], "--dataset-name": assets["data"], "--output-dir": str(run),
                option: value}
        with untouched(inputs, Path(assets["model"]).parent):
            err = train_error(capsys, *[x for pair in args.items() for x in pair], "--num-generations", "2")
        assert f"fastgrpo train: error: {message}" in err, err
        assert err.count("\n") == 1, err


OFFLINE = """
import sys
from fastgrpo.bench import environment, results_stem
from fastgrpo.bench import loss as loss_bench
from fastgrpo.bench import sampling as sampling_bench
from fastgrpo.bench import trl_step as trl_bench
from fastgrpo.cli import main

for args in sys.argv[1:]:
    try:
        main(["train", *args.split("|")])
    except SystemExit as e:
        print("exit", e.code, flush=True)
"""


@pytest.mark.slow
def test_offline_hub_names_say_what_was_looked_for_and_where(assets, tmp_path, inputs):
    """The hub is not reachable from the tests: offline mode answers at once, where the network would retry."""
    home = inputs / "hf-home"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(home)}
    common = f"--output-dir|{tmp_path / 'run'}|--num-generations|2"
    cases = [f"--model-name-or-path|fastgrpo-tests/no-such-model|--dataset-name|{assets['data']}|{common}",
             f"--model-name-or-path|{assets['model']}|--dataset-name|fastgrpo-tests/no-such-data|{common}"]
    with untouched(inputs, Path(assets["model"]).parent):
        done = subprocess.run([sys.executable, "-c", OFFLINE, *cases], capture_output=True, text=True, env=env,
                              timeout=300)
    assert done.stdout.split() == ["exit", "2", "exit", "2"], done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("fastgrpo train: error:")]
    assert len(errors) == 2, done.stderr[-3000:]
    model_error, data_error = errors
    assert ("--model-name-or-path: cannot load 'fastgrpo-tests/no-such-model' from huggingface.co (offline mode: not "
            f"asked) and the cache {home / 'hub'}: OSError") in model_error
    assert ("--dataset-name: cannot load 'fastgrpo-tests/no-such-data' from huggingface.co (offline mode: not asked) "
            f"and the cache {home / 'datasets'}: ConnectionError") in data_error


# -- fastgrpo bench ------------------------------------------------------------------------------------------------


SUITES = {"loss": ("loss", loss_bench), "sampling": ("sampling", sampling_bench), "trl": ("trl-step", trl_bench)}


@pytest.mark.parametrize("suite", SUITES)
def test_bench_where_every_method_failed_exits_nonzero_and_keeps_earlier_results(tmp_path, monkeypatch, suite):
    name, module = SUITES[suite]
    monkeypatch.setattr(module.harness, "run_in_child", lambda *args: (None, "RuntimeError: boom"))
    stem = results_stem(name, environment(torch.device("cpu")))
    earlier = {tmp_path / f"{stem}.json": "the day's good results", tmp_path / f"{stem}.md": "| fastgrpo | 1.0 |"}
    for path, text in earlier.items():
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", suite, "--quick", "--device", "cpu", "--out-dir", str(tmp_path)])
    assert all(path.read_text() == text for path, text in earlier.items())
    failed_run = tmp_path / f"{stem}-2.json"
    rows = json.loads(failed_run.read_text())["rows"]
    assert rows and all(row["error"] == "RuntimeError: boom" for row in rows)
    assert exit_info.value.code == f"every method failed ({len(rows)} runs); their errors are in {failed_run}"


def test_bench_bad_arguments_fail_before_anything_runs(tmp_path, monkeypatch):
    for _, module in SUITES.values():  # (the suites call the shared harness's runner)
        monkeypatch.setattr(module.harness, "run_in_child", lambda *args: pytest.fail("a benchmark ran"))
    results = tmp_path / "results.md"
    results.write_text("keep")
    for suite in SUITES:
        for out_dir in (results, results / "sub"):
            with pytest.raises(SystemExit, match=f"--out-dir {out_dir} must be a folder, but {results} is a file"):
                main(["bench", suite, "--quick", "--device", "cpu", "--out-dir", str(out_dir)])
    with pytest.raises(SystemExit, match=r"--tokens must be >= 10 \(10% of them are masked\), got 5"):
        main(["bench", "loss", "--quick", "--tokens", "5", "--device", "cpu", "--out-dir", str(tmp_path / "out")])
    assert results.read_text() == "keep" and [p.name for p in tmp_path.iterdir()] == ["results.md"]
