"""Bad agent input to `fastgrpo train` (issue 31): a tool, environment_factory or rollout_func that cannot work is
refused in one line naming the option as a flag, with a non-zero exit and no traceback, leaving no output folder
behind (a rollout_func's output, which only sampling shows, before the first update); and a tool that hangs is cut at
tool_timeout, reported to the model and counted as a failure, while the step and the run go on.

The model is a tiny random Qwen2 with a byte-level tokenizer and a Qwen2.5-style tool template (tools_helpers.py),
saved once per module with conversational arithmetic data; the bad functions live in one file, FUNCTIONS."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import ScriptedEngine, build_agent_assets
from cli_helpers import untouched
from tools_helpers import QWEN_STYLE_TEMPLATE, byte_tokenizer

from fastgrpo.cli import main
from fastgrpo.train import TrainConfig, Trainer
from fastgrpo.train.rewards import load_function

FUNCTIONS = '''
import asyncio
import threading


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def no_hint(a, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


def undocumented_argument(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first
    """
    return a + b


class Adder:
    def __call__(self, a: int) -> int:
        return a


NOT_CALLABLE = 3


class NoReset:
    def look(self) -> str:
        """Looks around."""
        return "a room"


class BrokenInit:
    def __init__(self):
        raise RuntimeError("no database")

    def reset(self, **row) -> None:
        return None


class UnhintedMethod:
    def reset(self, **row) -> None:
        return None

    def move(self, where) -> str:
        """Moves.

        Args:
            where: the place
        """
        return where


def _rollout(n, **changes):
    """A well-formed rollout of n samples, two prompt and two completion tokens each, with `changes`."""
    return {"prompt_ids": [[1, 2]] * n, "completion_ids": [[3, 4]] * n, "logprobs": [[-0.5, -0.5]] * n, **changes}


def rollout_raises(prompts, trainer):
    raise RuntimeError("the sampler is down")


def rollout_list(prompts, trainer):
    return [[3, 4]] * len(prompts)


def rollout_no_logprobs_key(prompts, trainer):
    out = _rollout(len(prompts))
    del out["logprobs"]
    return out


def rollout_one_too_many(prompts, trainer):
    return _rollout(len(prompts) + 1)


def rollout_empty_completion(prompts, trainer):
    n = len(prompts)
    return _rollout(n, completion_ids=[[]] + [[3, 4]] * (n - 1), logprobs=[[]] + [[-0.5, -0.5]] * (n - 1))


def rollout_float_token(prompts, trainer):
    return _rollout(len(prompts), completion_ids=[[3, 4.0]] * len(prompts))


def rollout_past_vocabulary(prompts, trainer):
    return _rollout(len(prompts), completion_ids=[[3, 100_000]] * len(prompts))


def rollout_short_logprobs(prompts, trainer):
    return _rollout(len(prompts), logprobs=[[-0.5]] * len(prompts))


def rollout_env_mask_two(prompts, trainer):
    return _rollout(len(prompts), env_mask=[[1, 2]] * len(prompts))


def rollout_logprobs_none(prompts, trainer):
    return _rollout(len(prompts), logprobs=None)


def rollout_good(prompts, trainer):
    return _rollout(len(prompts))


# -- the hanging tools, and a reward function that keeps what it was given --

RELEASE = threading.Event()  # set by the test when it ends: until then `hang` never returns
SEEN = []  # the completions (messages) of every call of `record`


def hang() -> str:
    """Never returns (until the test releases it)."""
    RELEASE.wait()
    return "late"


async def ahang() -> str:
    """Never returns."""
    await asyncio.Event().wait()
    return "late"


def record(completions, **columns) -> list[float]:
    SEEN.append(completions)
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def agent_assets(tmp_path_factory) -> dict:
    """{"model": a tiny Qwen2 with the tool template, "data": 4 train and 4 test rows, "functions": FUNCTIONS's file,
    "other": a second file with a tool named add}."""
    root = tmp_path_factory.mktemp("agent_assets")
    assets = build_agent_assets(root)
    (root / "agent_inputs_functions.py").write_text(FUNCTIONS)
    (root / "agent_inputs_other.py").write_text(FUNCTIONS.split("\n\n\ndef no_hint")[0])  # imports and add
    for path in ("agent_inputs_functions.py", "agent_inputs_other.py"):  # loaded (and byte-compiled) once, here
        load_function(f"{root / path}:add")
    return {**assets, "functions": str(root / "agent_inputs_functions.py"),
            "other": str(root / "agent_inputs_other.py")}


def train_args(assets: dict, run: Path) -> list[str]:
    """A run as small as fastgrpo allows: 2 completions of 8 tokens per step, one step, 2 held-out prompts."""
    return ["train", "--model-name-or-path", assets["model"], "--dataset-name", assets["data"], "--output-dir",
            str(run), "--num-generations", "2", "--per-device-train-batch-size", "2", "--max-completion-length", "8",
            "--max-steps", "1", "--eval-num-samples", "2", "--save-steps", "0", "--report-to", "none",
            "--disable-tqdm"]


def refused(capsys, args: list[str], code: int) -> str:
    """The one line a `fastgrpo train` that must fail writes to stderr (exit `code`, no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("fastgrpo train: error: "), err
    return err.removeprefix("fastgrpo train: error: ").rstrip("\n")


def spec(assets: dict, name: str) -> str:
    return f"{assets['functions']}:{name}"


def refused_before_the_run(capsys, assets: dict, tmp_path: Path, *extra: str) -> str:
    """The error of a run refused while it loads: no input changed, and no output folder left behind (the run locks
    it before it loads, and removes it with its lock when it is refused)."""
    run = tmp_path / "run"
    with untouched(Path(assets["model"]).parent, tmp_path / "in"):
        said = refused(capsys, [*train_args(assets, run), *extra], code=2)
    assert not run.exists()
    return said


# -- tools ---------------------------------------------------------------------------------------------------------

# (case, the --tools specs (":name": FUNCTIONS's, "other:add": the second file's, else as written), what the line says)
TOOLS = [
    ("not_module_function", ["add"], ": 'add' must be written 'module:function' or 'file.py:function'"),
    ("missing_file", ["/nowhere/tools.py:add"], ": '/nowhere/tools.py:add': cannot import '/nowhere/tools.py': "
                                                "/nowhere/tools.py does not exist"),
    ("missing_function", [":subtract"], "has no callable 'subtract'"),
    ("not_callable", [":NOT_CALLABLE"], "has no callable 'NOT_CALLABLE'"),
    ("a_class", [":Adder"], ":Adder is a type; a tool must be a function or method (def or async def)"),
    ("no_type_hint", [":no_hint"], ":no_hint: Argument a is missing a type hint in function no_hint"),
    ("no_docstring", [":no_docstring"], ":no_docstring: Cannot generate JSON schema for no_docstring because it has "
                                        "no docstring"),
    ("undocumented_argument", [":undocumented_argument"], "the docstring has no description for the argument 'b'"),
    ("two_named_add", [":add", "other:add"], ": two tools are named 'add'; the model calls a tool by its name"),
]  # fmt: skip


@pytest.mark.parametrize("tools, said", [case[1:] for case in TOOLS], ids=[case[0] for case in TOOLS])
def test_bad_tools_are_refused_in_one_line(agent_assets, tmp_path, capsys, tools, said):
    specs = [agent_assets["other"] + t.removeprefix("other") if t.startswith("other:") else
             agent_assets["functions"] + t if t.startswith(":") else t for t in tools]
    line = refused_before_the_run(capsys, agent_assets, tmp_path, "--tools", *specs)
    assert line.startswith("--tools") and said in line, line


# -- environment_factory -------------------------------------------------------------------------------------------


# (case, --environment-factory's value (FUNCTIONS's class names after ":"), what the line says after the flag)
ENVIRONMENTS = [
    ("no_reset", ":NoReset", ": {f}:NoReset makes NoReset instances, which have no reset method; an environment needs "
                             "reset(**row)"),
    ("constructor_raises", ":BrokenInit", ": {f}:BrokenInit() raised RuntimeError: no database"),
    ("method_without_hint", ":UnhintedMethod", ": UnhintedMethod.move: Argument where is missing a type hint"),
    ("missing_class", ":Nowhere", "has no callable 'Nowhere'"),
    ("dict_of_non_strings", '{"maze": 1}', ": {'maze': 1} must map an environment name (str) to 'module:Class'"),
    ("empty_dict", "{}", ": the dict names no environment"),
]  # fmt: skip


@pytest.mark.parametrize("factory, said", [case[1:] for case in ENVIRONMENTS], ids=[case[0] for case in ENVIRONMENTS])
def test_bad_environment_factories_are_refused_in_one_line(agent_assets, tmp_path, capsys, factory, said):
    value = agent_assets["functions"] + factory if factory.startswith(":") else factory
    line = refused_before_the_run(capsys, agent_assets, tmp_path, "--environment-factory", value)
    assert line.startswith("--environment-factory") and said.replace("{f}", agent_assets["functions"]) in line, line


def test_environment_names_that_are_not_strings_are_refused_in_one_line(agent_assets, tmp_path, capsys):
    """Only YAML can give a name that is not a string (JSON's keys are strings)."""
    config = tmp_path / "in" / "run.yaml"
    config.parent.mkdir()
    config.write_text(f"environment_factory:\n  1: {spec(agent_assets, 'NoReset')}\n")
    line = refused_before_the_run(capsys, agent_assets, tmp_path, "--config", str(config))
    assert line == (f"--environment-factory: {{1: '{spec(agent_assets, 'NoReset')}'}} must map an environment name "
                    "(str) to 'module:Class'")


# -- rollout_func --------------------------------------------------------------------------------------------------


def test_a_missing_rollout_func_is_refused_in_one_line(agent_assets, tmp_path, capsys):
    line = refused_before_the_run(capsys, agent_assets, tmp_path, "--rollout-func", spec(agent_assets, "sample"))
    assert line == f"--rollout-func: '{spec(agent_assets, 'sample')}': '{agent_assets['functions']}' has no callable "\
                   "'sample'"
    line = refused_before_the_run(capsys, agent_assets, tmp_path, "--rollout-func", "/nowhere/rollout.py:sample")
    assert line.startswith("--rollout-func: '/nowhere/rollout.py:sample': cannot import"), line


# (case, FUNCTIONS's rollout_func, what the line says). The held-out evaluation before step 1 samples 2 prompts
# once each through it, so its output is checked before any update.
ROLLOUTS = [
    ("raises", "rollout_raises", "--rollout-func '{f}:rollout_raises' raised RuntimeError: the sampler is down"),
    ("not_a_dict", "rollout_list", "--rollout-func must return a dict with ['prompt_ids', 'completion_ids', "
                                   "'logprobs'], got list"),
    ("missing_key", "rollout_no_logprobs_key", "--rollout-func must return keys ['logprobs'] in its output dict"),
    ("samples_miscounted", "rollout_one_too_many", "--rollout-func: prompt_ids has 3 entries but the step has 2 "
                                                   "samples (prompts x --num-generations); return one per sample"),
    ("empty_completion", "rollout_empty_completion", "--rollout-func: completion_ids[0] is empty"),
    ("float_token_id", "rollout_float_token", "--rollout-func: completion_ids[0][1] is 4.0, not a token id (an int)"),
    ("token_past_vocabulary", "rollout_past_vocabulary", "--rollout-func: completion_ids[0][1] is 100000, outside the "
                                                         "vocabulary [0, 265)"),
    ("logprobs_too_short", "rollout_short_logprobs", "--rollout-func: logprobs[0] has 1 values but completion_ids[0] "
                                                     "has 2 tokens"),
    ("env_mask_two", "rollout_env_mask_two", "--rollout-func: env_mask[0][1] is 2, not 0 or 1"),
    ("logprobs_none_with_correction", "rollout_logprobs_none", "--rollout-func returned logprobs None, but "
                                                                "--importance-sampling-correction needs"),
]  # fmt: skip


def _ids(case):
    return case.values[0] if hasattr(case, "values") else case[0]


@pytest.mark.parametrize("case, function, said", ROLLOUTS, ids=list(map(_ids, ROLLOUTS)))
def test_bad_rollout_func_output_is_one_line_and_no_checkpoint(agent_assets, tmp_path, capsys, case, function, said):
    run = tmp_path / "run"
    extra = ["--importance-sampling-correction"] if case == "logprobs_none_with_correction" else []
    with untouched(Path(agent_assets["model"]).parent):
        line = refused(capsys, [*train_args(agent_assets, run), "--rollout-func", spec(agent_assets, function),
                                *extra], code=1)
    assert line.startswith(said.replace("{f}", agent_assets["functions"])), line
    # The run had begun (its config and memory plan are written as it starts), but no step was done: what it wrote
    # is gone with the folder it made, so the same command runs again once the function is fixed.
    assert not run.exists()


# -- the agent options and the chat template -----------------------------------------------------------------------


NO_TOOL_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

# (case, the options (FUNCTIONS's names after ":"), the line)
OPTIONS = [
    ("negative_iterations", ["--max-tool-calling-iterations", "-1"],
     "--max-tool-calling-iterations must be None or >= 0, got -1"),
    ("zero_timeout", ["--tool-timeout", "0"], "--tool-timeout must be None or > 0 seconds, got 0.0"),
    ("nan_timeout", ["--tool-timeout", "nan"], "--tool-timeout must be finite, got nan"),
    ("rollout_func_and_tools", ["--rollout-func", ":rollout_good", "--tools", ":add"],
     "--tools does not apply with --rollout-func, which returns whole rollouts (fastgrpo's own tool loop does not "
     "run); run the tools inside --rollout-func, or drop one of the two"),
    ("rollout_func_and_environment", ["--rollout-func", ":rollout_good", "--environment-factory", ":NoReset"],
     "--environment-factory does not apply with --rollout-func"),
    ("builtin_model_with_tools", ["--model-name-or-path", "builtin", "--tools", ":add"],
     "--tools: the chat template cannot render a tool-calling conversation (user, then an assistant turn with "
     "tool_calls, then a tool message); use a model whose chat template supports tools, or give one with "
     "--chat-template-path"),
    ("template_without_tools", ["--chat-template-path", "no_tools.jinja", "--tools", ":add"],
     "--tools: the chat template of --chat-template-path {in}/no_tools.jinja cannot render a tool-calling "
     "conversation (user, then an assistant turn with tool_calls, then a tool message); give one that does"),
    ("missing_template_file", ["--chat-template-path", "nowhere.jinja", "--tools", ":add"],
     "--chat-template-path: {in}/nowhere.jinja is not a file (a Jinja chat template)"),
    ("prompt_cut_through_the_tools", ["--max-prompt-length", "20", "--tools", ":add"],
     "{data}/train.jsonl, row 1 (line 1), prompt column 'prompt': the prompt, with its tools, has"),
]  # fmt: skip


@pytest.mark.parametrize("options, said", [case[1:] for case in OPTIONS], ids=[case[0] for case in OPTIONS])
def test_bad_agent_options_are_refused_in_one_line(agent_assets, tmp_path, capsys, options, said):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "no_tools.jinja").write_text(NO_TOOL_TEMPLATE)
    options = [agent_assets["functions"] + o if o.startswith(":") else
               str(inputs / o) if o.endswith(".jinja") else o for o in options]
    line = refused_before_the_run(capsys, agent_assets, tmp_path, *options)
    assert line.startswith(said.replace("{in}", str(inputs)).replace("{data}", agent_assets["data"])), line


@pytest.mark.slow
def test_python_m_fastgrpo_reports_a_bad_tool_and_a_bad_rollout_in_one_line(agent_assets, tmp_path):
    """As a user runs it: the process's exit status and its whole stderr."""
    for option, value, code, said in (
        ("--tools", spec(agent_assets, "no_docstring"), 2, "--tools: "),
        ("--rollout-func", spec(agent_assets, "rollout_short_logprobs"), 1, "--rollout-func: logprobs[0] has 1 values"),
    ):
        run = tmp_path / option.strip("-")
        done = subprocess.run([sys.executable, "-m", "fastgrpo", *train_args(agent_assets, run), option, value],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == code, done.stderr[-3000:]
        assert done.stderr.startswith(f"fastgrpo train: error: {said}"), done.stderr[-3000:]
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]


# -- a tool that hangs ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_hung_tool_is_cut_at_its_timeout_and_the_run_goes_on(agent_assets, tmp_path):
    """Every rollout calls hang (sync, never returns), add and ahang (async, never returns) in its first turn, then
    answers. With tool_timeout 0.5 s each hung call becomes an error message to the model and a failure in
    tools/failure_frequency; add still answers, and both steps (and the evaluations around them) finish."""
    functions = agent_assets["functions"]
    module = load_function(spec(agent_assets, "record")).__globals__  # the module the run loads (one per file)
    module["SEEN"].clear()
    tokenizer = byte_tokenizer(QWEN_STYLE_TEMPLATE)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    calls = "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
                      for name, arguments in (("hang", {}), ("add", {"a": 3, "b": 4}), ("ahang", {})))
    script = lambda prompt, turn, so_far: encode((calls if turn == 0 else "done") + "<|im_end|>")
    config = TrainConfig(
        model_name_or_path=agent_assets["model"], dataset_name=agent_assets["data"], output_dir=str(tmp_path / "run"),
        num_generations=2, per_device_train_batch_size=2, max_completion_length=400, max_steps=2, save_steps=0,
        eval_num_samples=1, report_to=["none"], disable_tqdm=True, tool_timeout=0.5, max_prompt_length=None,
        tools=[f"{functions}:{name}" for name in ("hang", "add", "ahang")], reward_funcs=[f"{functions}:record"],
    )  # fmt: skip
    trainer = Trainer(config)
    trainer.engine = ScriptedEngine(script, [tokenizer.eos_token_id])
    try:
        summary = trainer.train()
    finally:
        module["RELEASE"].set()  # the hung thread of each call returns now
    assert summary["steps"] == 2 and (tmp_path / "run" / "checkpoint-2").is_dir()

    timed_out = lambda name: str({"error": f"Tool {name} timed out after 0.5 s."})
    assert len(module["SEEN"]) == 2  # the reward function, once a step
    for completions in module["SEEN"]:
        for messages in completions:
            assert [m["role"] for m in messages] == ["assistant", "tool", "tool", "tool", "assistant"], messages
            assert [(m["name"], m["content"]) for m in messages[1:4]] == [
                ("hang", timed_out("hang")), ("add", "7"), ("ahang", timed_out("ahang"))]
            assert messages[4]["content"] == "done"
    steps = [row for row in trainer.log.history if "tools/call_frequency" in row]
    assert len(steps) == 2
    for row in steps:
        assert row["tools/call_frequency"] == 3.0  # calls per sample
        assert row["tools/failure_frequency"] == pytest.approx(4 / 6)  # hang and ahang of each of 2 samples
        # 2 samples, one after another (ScriptedEngine), each waiting 2 x 0.5 s: ~2 s, not forever
        assert row["time/sampling"] < 2 * 2 * 0.5 + 10, row["time/sampling"]
