"""The calculator recipe (recipes/calculator-agent.yaml, recipes/calculator/): its tokenizer and chat template pass
fastgrpo's tool-calling checks and spell a call in few tokens, a rendered call parses back with int arguments and
runs, the tool turn's tokens are the ones the warm-up trained around, the data's splits are disjoint by operand
pair, the warm-up is deterministic, and the shipped model starts where the recipe says (it calls the tool in a
minority of its samples, and is right when it does)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.train.config import TrainConfig
from fastgrpo.train.loading import tokenizer_from
from fastgrpo.train.tools import ToolChat, ToolRunner, load_tools, tool_calls, toolbox

RECIPE = Path(__file__).parent.parent / "recipes" / "calculator"
PROBLEM = re.compile(r"(\d{5})\+(\d{5})=")
A, B, SUM = 40379, 72689, 113068
CALL = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {A}, "b": {B}}}}}\n</tool_call><|im_end|>'


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"calculator_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _module("build_model")


@pytest.fixture(scope="module", params=["built", "shipped"])
def tokenizer(request):
    """The tokenizer as build_tokenizer makes it, and as recipes/calculator/model ships it (loaded as the trainer
    loads it)."""
    return build.build_tokenizer() if request.param == "built" else tokenizer_from(str(RECIPE / "model"))


@pytest.fixture(scope="module")
def tools():
    return build.schemas()


def call_message(a, b) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]}


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


# -- the recipe --


def test_the_recipe_loads_and_agrees_with_the_builder(monkeypatch):
    monkeypatch.chdir(RECIPE.parent.parent)  # the recipe's paths are relative to the repository root
    config = TrainConfig.from_yaml("recipes/calculator-agent.yaml")
    assert config.model_name_or_path == "recipes/calculator/model" and Path(config.model_name_or_path).is_dir()
    assert config.dataset_name == "recipes/calculator/data" and Path(config.dataset_name).is_dir()
    assert config.tools == ["recipes/calculator/tools.py:add"] and load_tools(config.tools)[0](2, 3) == 5
    assert config.max_completion_length == build.MAX_COMPLETION_LENGTH
    assert config.max_tool_calling_iterations == build.MAX_TOOL_CALLING_ITERATIONS
    assert config.num_generations == build.NUM_SAMPLES and config.temperature == 1.0
    assert config.reward_funcs == ["accuracy"] and config.answer_column == "answer"


# -- the tool, the tokenizer and the chat template --


def test_the_tool_adds_and_loads_as_the_recipe_names_it():
    (add,) = load_tools([build.TOOL_SPEC])
    assert add(A, B) == SUM == _module("tools").add(A, B)
    assert "tools.py:add" in build.TOOL_SPEC
    assert build.schemas()[0]["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first number"},
        "b": {"type": "integer", "description": "the second number"}}


def test_the_shipped_tokenizer_is_the_built_one():
    built, shipped = build.build_tokenizer(), tokenizer_from(str(RECIPE / "model"))
    assert shipped.get_vocab() == built.get_vocab()
    assert shipped.chat_template == built.chat_template == build.CHAT_TEMPLATE
    assert (shipped.eos_token, shipped.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_the_template_passes_toolchat_and_renders_qwen_calls(tokenizer, tools):
    chat = ToolChat.for_tokenizer(tokenizer)  # renders tool exchanges, prefix-preserving, Qwen's JSON calls
    assert chat.response_template["fields"]["tool_calls"]["open"] == "<tool_call>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{A}+{B}="}, call_message(A, B)],
                                         tools=tools, tokenize=False)
    assert text == f"<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\n{A}+{B}=<|im_end|>\n<|im_start|>assistant\n" \
                   f"{CALL}\n"


def test_a_rollout_is_few_tokens_and_decodes_back_exactly(tokenizer, tools):
    example, labels = build.example(tokenizer, A, B, True, tools)
    prompt = build.prompt_ids(tokenizer, f"{A}+{B}=", tools)
    assert example[: len(prompt)] == prompt and len(prompt) == 28
    completion = example[len(prompt):]
    assert len(completion) == 18 + 19 + 7 <= build.MAX_COMPLETION_LENGTH  # call, tool turn, answer
    assert tokenizer.convert_ids_to_tokens(completion[:18]) == [
        "<tool_call>", "\n", '{"name": "add", "arguments": {"a": ', *str(A), ', "b": ', *str(B), "}}", "\n",
        "</tool_call>", "<|im_end|>"]  # fmt: skip
    assert tokenizer.unk_token_id not in example
    assert ids(tokenizer, tokenizer.decode(example)) == example
    # Labelled: the call turn and the answer turn, each up to its <|im_end|>; not the prompt, not the tool turn.
    labelled = [t for t, label in zip(example, labels, strict=True) if label != -100]
    assert tokenizer.decode(labelled) == f"{CALL}{SUM}<|im_end|>"
    unlabelled_choice = build.example(tokenizer, A, B, True, tools, label_first=False)[1]
    assert unlabelled_choice[len(prompt)] == -100 and unlabelled_choice[len(prompt) + 1 :] == labels[len(prompt) + 1 :]
    direct, direct_labels = build.example(tokenizer, A, B, False, tools)
    assert tokenizer.decode(direct[len(prompt):]) == f"{SUM}<|im_end|>"
    assert direct_labels == [-100] * len(prompt) + direct[len(prompt):]


def test_a_call_parses_back_with_int_arguments_and_runs(tokenizer, tools):
    chat = ToolChat.for_tokenizer(tokenizer)
    prompt = build.prompt_ids(tokenizer, f"{A}+{B}=", tools)
    message = chat.parse(ids(tokenizer, CALL), prompt, tools)
    assert tool_calls(message) == call_message(A, B)["tool_calls"]
    assert chat.parse(ids(tokenizer, f"{SUM}<|im_end|>"), prompt, tools) == {"role": "assistant", "content": str(SUM)}
    # The same call spelled one character per token (the model may sample it so) reads the same.
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in CALL.removeprefix("<tool_call>").removesuffix(
        "</tool_call><|im_end|>")]
    turn = ids(tokenizer, "<tool_call>") + spelled + ids(tokenizer, "</tool_call><|im_end|>")
    assert tool_calls(chat.parse(turn, prompt, tools)) == tool_calls(message)
    with ToolRunner() as runner:
        results, counts = runner.run([tool_calls(message)], [toolbox(load_tools([build.TOOL_SPEC]))])
    assert results == [[{"role": "tool", "name": "add", "content": str(SUM)}]] and counts.failures == 0


def test_suffix_ids_are_the_tool_turn_the_warm_up_trained_around(tokenizer, tools):
    chat = ToolChat.for_tokenizer(tokenizer)
    suffix = chat.suffix_ids([{"role": "tool", "name": "add", "content": str(SUM)}])
    assert tokenizer.decode(suffix) == f"\n<|im_start|>user\n<tool_response>\n{SUM}\n</tool_response><|im_end|>\n" \
                                       "<|im_start|>assistant\n"
    assert len(suffix) == 19
    example, _ = build.example(tokenizer, A, B, True, tools)
    call_end = 28 + 18
    assert example[call_end : call_end + len(suffix)] == suffix


# -- data and warm-up --


def rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (RECIPE / "data" / f"{split}.jsonl").read_text().splitlines()]


def test_the_shipped_data_is_the_built_data():
    for split, num in (("train", build.NUM_TRAIN_ROWS), ("test", build.NUM_TEST_ROWS)):
        assert rows(split) == build.problems(split, num, build.DEFAULT_SEED)


def test_splits_are_disjoint_by_operand_pair_and_answers_are_the_sums():
    pairs = {}
    for split in ("train", "test"):
        pairs[split] = set()
        for r in rows(split):
            a, b = map(int, PROBLEM.fullmatch(r["prompt"]).groups())
            assert r["answer"] == str(a + b) and build.in_test_split(a, b) == (split == "test"), r
            pairs[split].add((min(a, b), max(a, b)))
        assert len(rows(split)) == len({r["prompt"] for r in rows(split)})  # no repeats
    assert not pairs["train"] & pairs["test"]
    assert build.in_test_split(A, B) == build.in_test_split(B, A)


def test_the_warm_up_draws_only_train_pairs():
    pairs = build.draw_pairs("train", build.Random(0))
    assert not any(build.in_test_split(*next(pairs)) for _ in range(2000))


def test_the_warm_up_is_deterministic(monkeypatch):
    monkeypatch.setattr(build, "BATCH_SIZE", 8)  # 64 x 72-token sequences take ~1 s a step on 2 busy cores
    tokenizer = build.build_tokenizer()
    runs = []
    for seed in (0, 0, 1):
        model = build.build_model(tokenizer, seed)
        build.warm_up(model, tokenizer, steps=2, seed=seed)
        runs.append(model.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not all(torch.equal(runs[0][k], runs[2][k]) for k in runs[0])


# -- the shipped model --


def test_the_shipped_model_calls_in_a_minority_of_samples_and_is_right_when_it_calls():
    """32 held-out prompts x 8 samples at temperature 1 (build_model.py --check measures 200 x 8: 26% calls, 94% of
    them right, no direct answer right). The bounds leave room for what 256 samples vary by (a rate of 0.26 has a
    standard deviation of 0.03 over 256; 94% of ~65 calls, 0.03) and for another CPU's rounding, which can flip a
    sample."""
    tokenizer = tokenizer_from(str(RECIPE / "model"))
    model = build.LlamaForCausalLM.from_pretrained(RECIPE / "model").eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=build.MAX_COMPLETION_LENGTH, seed=0)
    flat = [r for group in build.rollouts(Engine(model, tokenizer=tokenizer), tokenizer, rows("test")[:32], 8, params)
            for r in group]
    called = [r for r in flat if r.called]
    assert 0.15 < len(called) / len(flat) < 0.5
    assert sum(r.right for r in called) / len(called) > 0.75
    assert sum(r.right for r in flat if not r.called) / (len(flat) - len(called)) < 0.05
