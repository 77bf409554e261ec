"""Agent inputs that went wrong in issue 41, through `fastgrpo train`: tools that block or return what the chat
template cannot take, environments whose reset() raises, returns nonsense or lengthens the prompt past what the run
can hold, rollout_funcs that return completions too long or impossible logprobs, chat templates that are empty or do
not compile, an environment column naming no environment. Each is one line and a non-zero exit with nothing lost (a
run stopped before its first step leaves no folder), or works.

The model is a tiny random Qwen2 with a byte-level tokenizer and a Qwen2.5-style tool template (agent_helpers); the
functions live in one file, FUNCTIONS. Where the model must call tools, its engine is a ScriptedEngine."""

import json
from pathlib import Path

import pytest
from agent_helpers import ScriptedEngine, build_agent_assets
from cli_helpers import untouched
from tools_helpers import QWEN_STYLE_TEMPLATE, byte_tokenizer

from fastgrpo.cli import main
from fastgrpo.train import trainer as trainer_module
from fastgrpo.train.logs import read_metrics
from fastgrpo.train.rewards import load_function

FUNCTIONS = '''
import asyncio
import os
import time

BLOCK = 5.0  # seconds a blocking tool blocks


async def blocking_async() -> str:
    """Blocks its thread, as a sync HTTP client inside an async def does."""
    time.sleep(BLOCK)
    return "late"


def blocking_sync() -> str:
    """Blocks."""
    time.sleep(BLOCK)
    return "late"


def numbers() -> list[int]:
    """Returns numbers."""
    return [1, 2, 3]


def blocks() -> list:
    """Returns content blocks."""
    return [{"type": "text", "text": "a block"}]


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


def unprintable() -> str:
    """Returns what cannot be shown as text."""
    return Unprintable()


def star(*values: int) -> int:
    """Sums.

    Args:
        values: the numbers
    """
    return sum(values)


SEEN = []  # (prompts, completions) of every call of `record`


def record(prompts, completions, **columns) -> list[float]:
    SEEN.append((prompts, completions))
    return [float(i % 2) for i in range(len(completions))]


class Room:
    def look(self) -> str:
        """Looks around."""
        return "a room"


class Greeter(Room):
    def reset(self, **row) -> str:
        return " Greetings from reset."


class Padded(Room):
    def reset(self, **row) -> str:
        return " pad" * int(os.environ["PAD"])


class Raising(Room):
    def reset(self, **row) -> None:
        raise KeyError("level")


class ReturnsInt(Room):
    def reset(self, **row) -> int:
        return 3


class ReturnsDict(Room):
    def reset(self, **row) -> dict:
        return {"text": "hi"}


class ClassReset(Room):
    @classmethod
    def reset(cls, **row) -> None:
        return None


def _rollout(n, **changes):
    return {"prompt_ids": [[1, 2]] * n, "completion_ids": [[3, 4]] * n, "logprobs": [[-0.5, -0.5]] * n, **changes}


def rollout_too_long(prompts, trainer):
    return _rollout(len(prompts), completion_ids=[[3] * 20] * len(prompts), logprobs=None)


def rollout_past_the_window(prompts, trainer):
    return _rollout(len(prompts), prompt_ids=[[1] * 5000] * len(prompts))


def rollout_plus_five(prompts, trainer):
    return _rollout(len(prompts), logprobs=[[5.0, -0.5]] * len(prompts))


def rollout_infinite(prompts, trainer):
    return _rollout(len(prompts), logprobs=[[-0.5, float("-inf")]] * len(prompts))
'''


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> dict:
    """build_agent_assets, the FUNCTIONS file, string-prompt data, and data whose third row names no environment."""
    root = tmp_path_factory.mktemp("agent_faults")
    assets = build_agent_assets(root)
    (root / "agent_faults_functions.py").write_text(FUNCTIONS)
    load_function(f"{root / 'agent_faults_functions.py'}:record")  # loaded (and byte-compiled) once, here
    rows = [json.loads(line) for line in (Path(assets["data"]) / "train.jsonl").read_text().splitlines()]
    for name, changed in (("text", [{**r, "prompt": r["prompt"][0]["content"]} for r in rows]),
                          ("named", [{**r, "environment": "chess" if i == 2 else "greeter"}
                                     for i, r in enumerate(rows)])):
        (root / name).mkdir()
        for split in ("train", "test"):
            (root / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed))
    return {**assets, "functions": str(root / "agent_faults_functions.py"), "text": str(root / "text"),
            "named": str(root / "named")}


def fn(agent: dict, name: str) -> str:
    return f"{agent['functions']}:{name}"


def train_args(agent: dict, run: Path, *extra: str) -> list[str]:
    """2 completions of 8 tokens per step, one step, 1 held-out prompt."""
    return ["train", "--model-name-or-path", agent["model"], "--dataset-name", agent["data"], "--output-dir",
            str(run), "--num-generations", "2", "--per-device-train-batch-size", "2", "--max-completion-length", "8",
            "--max-steps", "1", "--eval-num-samples", "1", "--save-steps", "0", "--report-to", "none",
            "--disable-tqdm", "--reward-funcs", *extra]


def refused(capsys, args: list[str], code: int) -> str:
    """The one line a `fastgrpo train` that must fail writes to stderr (exit `code`, no traceback), less its prefix."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("fastgrpo train: error: "), err
    return err.removeprefix("fastgrpo train: error: ").rstrip("\n")


def refused_run(capsys, agent: dict, tmp_path: Path, code: int, *extra: str) -> str:
    """The line of a run refused at load (code 2) or in its first sampling (code 1): the inputs unchanged and no
    output folder left behind."""
    run = tmp_path / "run"
    with untouched(Path(agent["model"]).parent):
        said = refused(capsys, train_args(agent, run, *extra), code)
    assert not run.exists()
    return said


def scripted(monkeypatch, calls: list[str]) -> None:
    """The policy writes a turn calling `calls` (no arguments), then 'done' once the results are in."""
    tokenizer = byte_tokenizer(QWEN_STYLE_TEMPLATE)
    text = "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>' for name in calls)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    script = lambda prompt, turn, so_far: encode((text if turn == 0 else "done") + "<|im_end|>")
    monkeypatch.setattr(trainer_module, "Engine", lambda model, **options: ScriptedEngine(
        script, [tokenizer.eos_token_id]))


def seen(agent: dict) -> list:
    return load_function(fn(agent, "record")).__globals__["SEEN"]


# -- tools --------------------------------------------------------------------------------------------------------


def test_a_blocking_tool_of_either_kind_is_cut_at_its_timeout(agent, tmp_path, monkeypatch):
    """Each rollout calls a sync tool and two async ones that block their thread 5 s, with --tool-timeout 0.5: every
    call is reported timed out after 0.5 s (the async ones together), and no call waits for another (before: the
    async ones ran one after another on the runner's loop, 20 s a step, none reported)."""
    scripted(monkeypatch, ["blocking_sync", "blocking_async", "blocking_async"])
    seen(agent).clear()
    run = tmp_path / "run"
    main(train_args(agent, run, fn(agent, "record"), "--tools", fn(agent, "blocking_sync"),
                    fn(agent, "blocking_async"), "--tool-timeout", "0.5", "--max-completion-length", "400",
                    "--max-prompt-length", "none"))
    (step,) = [row for row in read_metrics(run) if row["step"] == 1]
    assert step["tools/call_frequency"] == 3.0 and step["tools/failure_frequency"] == 1.0
    assert step["time/sampling"] < 2 * (0.5 + 0.5) + 3.0, step["time/sampling"]  # 2 rollouts, one after another
    (_, completions), = seen(agent)
    for messages in completions:
        assert [m["content"] for m in messages[1:4]] == [str({"error": f"Tool {name} timed out after 0.5 s."})
                                                         for name in ("blocking_sync", "blocking_async",
                                                                      "blocking_async")]


# A Qwen-style template that concatenates a tool's result into its text, as many do.
CONCATENATING = QWEN_STYLE_TEMPLATE.replace("{{- message.content -}}{{- '\\n</tool_response>' -}}",
                                            "{{- message.content + '\\n</tool_response>' -}}")


@pytest.fixture
def concatenating(tmp_path) -> str:
    assert CONCATENATING != QWEN_STYLE_TEMPLATE
    (tmp_path / "concatenating.jinja").write_text(CONCATENATING)
    return str(tmp_path / "concatenating.jinja")


def test_a_tool_returning_a_list_is_shown_as_text(agent, tmp_path, monkeypatch, concatenating):
    """A `-> list[int]` tool: its result is the text '[1, 2, 3]' (before: the run ended in Jinja, 'can only
    concatenate str (not "list")')."""
    scripted(monkeypatch, ["numbers"])
    seen(agent).clear()
    main(train_args(agent, tmp_path / "run", fn(agent, "record"), "--tools", fn(agent, "numbers"),
                    "--chat-template-path", concatenating, "--max-completion-length", "400"))
    (_, completions), = seen(agent)
    assert [messages[1]["content"] for messages in completions] == ["[1, 2, 3]"] * 2


def test_a_result_whose_str_raises_is_a_failed_call(agent, tmp_path, monkeypatch):
    """Before: the run ended with the result's exception."""
    scripted(monkeypatch, ["unprintable"])
    seen(agent).clear()
    run = tmp_path / "run"
    main(train_args(agent, run, fn(agent, "record"), "--tools", fn(agent, "unprintable"), "--max-completion-length",
                    "400"))
    (_, completions), = seen(agent)
    error = str({"error": "the result of unprintable cannot be shown as text (RuntimeError: no text)"})
    assert [messages[1]["content"] for messages in completions] == [error] * 2
    (step,) = [row for row in read_metrics(run) if row["step"] == 1]
    assert step["tools/failure_frequency"] == 1.0


def test_content_blocks_the_template_cannot_render_are_one_line(agent, tmp_path, capsys, monkeypatch, concatenating):
    scripted(monkeypatch, ["blocks"])
    line = refused_run(capsys, agent, tmp_path, 1, fn(agent, "record"), "--tools", fn(agent, "blocks"),
                       "--chat-template-path", concatenating, "--max-completion-length", "400")
    assert line.startswith("--tools: the chat template cannot render the results of ['blocks'] ([[{'type': 'text', "
                           "'text': 'a block'}]]): TypeError: "), line


def test_a_tool_whose_arguments_no_call_can_reach_is_refused(agent, tmp_path, capsys):
    line = refused_run(capsys, agent, tmp_path, 2, fn(agent, "record"), "--tools", fn(agent, "star"))
    assert line == (f"--tools: {fn(agent, 'star')}: its argument *values can only be given by position, and the "
                    "model's calls give every argument by name; make it a named argument")


# -- chat templates -----------------------------------------------------------------------------------------------


def test_an_empty_chat_template_file_is_refused(agent, tmp_path, capsys):
    (tmp_path / "empty.jinja").write_text("\n")
    line = refused_run(capsys, agent, tmp_path, 2, fn(agent, "record"), "--chat-template-path",
                       str(tmp_path / "empty.jinja"))
    assert line == (f"--chat-template-path: {tmp_path / 'empty.jinja'} is empty; give a Jinja chat template, or drop "
                    "the option to keep the tokenizer's")


def test_a_chat_template_that_does_not_compile_is_named_with_its_error(agent, tmp_path, capsys):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
    line = refused_run(capsys, agent, tmp_path, 2, fn(agent, "record"), "--tools", fn(agent, "numbers"),
                       "--chat-template-path", str(tmp_path / "broken.jinja"))
    assert line.startswith(f"--tools: the chat template of --chat-template-path {tmp_path / 'broken.jinja'} is not "
                           "a valid Jinja template: line 1: "), line


# -- environments -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad, options, said", [
    (300, ("--max-prompt-length", "600"), "tokens long with its tools, more than --max-prompt-length=600; prompts with "
                                          "tools are not cut (the tool schemas come first): raise --max-prompt-length "
                                          "or set it to None"),
    (1100, ("--max-prompt-length", "none"), "tokens long, which with --max-completion-length=8 exceeds the model's "
                                            "context window of 4096 positions"),
    (150, ("--kv-cache-blocks", "40", "--max-prompt-length", "none"),
     "tokens long: sampling it needs 57 pages of 16 tokens with --max-completion-length=8, more than --kv-cache-blocks "
     "40; raise --kv-cache-blocks or leave it unset"),
], ids=["past_max_prompt_length", "past_the_context_window", "past_the_kv_pool"])  # fmt: skip
def test_a_prompt_lengthened_by_reset_is_checked_not_cut(agent, tmp_path, capsys, monkeypatch, pad, options, said):
    """Before: cut silently to its last max_prompt_length tokens (the tools and the question gone), or an engine
    traceback naming num_blocks."""
    monkeypatch.setenv("PAD", str(pad))
    line = refused_run(capsys, agent, tmp_path, 1, fn(agent, "record"), "--environment-factory",
                       fn(agent, "Padded"), *options)
    assert line.startswith("--environment-factory: Padded.reset(**row) made the prompt of the row {'prompt': "), line
    assert said in line, line


@pytest.mark.parametrize("environment, data, said", [
    ("Raising", "data", "raised KeyError: 'level'"),
    ("ReturnsInt", "data", "returned 3 (int); it must return a string or a list of content blocks to append to the "
                           "prompt, or None"),
    ("ReturnsInt", "text", "returned 3 (int); it must return a string to append to the prompt, or None"),
    ("ReturnsDict", "text", "returned {'text': 'hi'} (dict); it must return a string to append to the prompt, or None"),
])  # fmt: skip
def test_a_reset_that_raises_or_returns_nonsense_is_one_line(agent, tmp_path, capsys, environment, data, said):
    line = refused_run(capsys, agent, tmp_path, 1, fn(agent, "record"), "--environment-factory",
                       fn(agent, environment), "--dataset-name", agent[data])
    assert line.startswith(f"--environment-factory: {environment}.reset(**row) for the row {{'prompt': "), line
    assert line.endswith(said), line


def test_an_environment_column_naming_no_environment_names_the_file_and_row(agent, tmp_path, capsys):
    factory = json.dumps({"greeter": fn(agent, "Greeter")})
    line = refused_run(capsys, agent, tmp_path, 2, fn(agent, "record"), "--environment-factory", factory,
                       "--dataset-name", agent["named"])
    assert line == (f"{agent['named']}/train.jsonl, row 3 (line 3): --environment-factory: the row's environment "
                    "column is 'chess', which is not one of ['greeter']; with several environments each row's "
                    "'environment' column names one")


def test_a_classmethod_reset_is_a_reset(agent, tmp_path):
    main(train_args(agent, tmp_path / "run", fn(agent, "record"), "--environment-factory", fn(agent, "ClassReset")))
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]


def test_completions_jsonl_logs_the_prompt_after_reset(agent, tmp_path):
    main(train_args(agent, tmp_path / "run", fn(agent, "record"), "--environment-factory", fn(agent, "Greeter"),
                    "--log-completions"))
    rows = read_metrics(tmp_path / "run", file="completions.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["prompt"][-1]["content"].endswith("= Greetings from reset."), row["prompt"]


# -- rollout_func -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("function, said", [
    ("rollout_too_long", "--rollout-func: completion_ids[0] has 20 tokens, more than --max-completion-length=8; cut "
                         "completions there (a completion cut by length ends without a stop token)"),
    ("rollout_past_the_window", "--rollout-func: prompt_ids[0] and completion_ids[0] have 5000 + 2 tokens, more than "
                                "the model's context window of 4096 positions"),
    ("rollout_plus_five", "--rollout-func: logprobs[0][0] is 5.0, not a finite logprob <= 0 (a log-probability), or "
                          "None"),
    ("rollout_infinite", "--rollout-func: logprobs[0][1] is -inf, not a finite logprob <= 0 (a log-probability), or "
                         "None"),
])  # fmt: skip
def test_rollouts_the_run_cannot_hold_are_one_line(agent, tmp_path, capsys, function, said):
    """Before: trained on (completions past max_completion_length and the window) or NaN ratios (impossible
    logprobs)."""
    line = refused_run(capsys, agent, tmp_path, 1, fn(agent, "record"), "--rollout-func", fn(agent, function))
    assert line == said
