"""fastgrpo.train.tools against TRL 1.16's own functions on the same inputs: parsed tool calls (trl's parse_response
and add_response_schema), tool messages and their tokens (GRPOTrainer._tool_call_loop and _get_tool_suffix_ids
called on a stand-in trainer holding only what they read), environments end to end (a real GRPOTrainer with
environment_factory, only its sampling step replaced), and the refusals, each one line naming the option.

The tokenizer is byte-level (every byte a token, so decoding gives back the text exactly, as a real BPE does) with
Qwen's special tokens; chat templates: one written here in Qwen2.5's <tool_call> JSON style, and TRL's copies of
the Qwen2.5 / Qwen3 / Qwen3.6 templates (the ones its add_response_schema recognizes)."""

import asyncio
import copy
import functools
import inspect
import tempfile
import threading
import time
import types

import pytest
import torch
from tools_helpers import (
    QWEN_STYLE_TEMPLATE,
    TRL_TEMPLATES,
    Counter,
    Quiet,
    add,
    afail,
    amul,
    blocks,
    boom,
    byte_tokenizer,
    echo,
    record,
    trl_template,
)
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import get_json_schema
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import add_response_schema, get_training_chat_template, qwen3_template
from trl.chat_template_utils import parse_response as trl_parse_response
from trl.trainer.utils import shutdown_event_loop_in_daemon, start_event_loop_in_daemon

from fastgrpo.train.tools import (
    QWEN_JSON_TOOL_CALLS,
    QWEN_XML_TOOL_CALLS,
    Environments,
    ToolChat,
    ToolCounts,
    ToolRunner,
    check_rollout,
    load_tools,
    response_template,
    supports_tool_calls,
    tool_calls,
    tool_schema,
    toolbox,
)


def setup(template: str):
    """(our ToolChat, TRL's tokenizer with its response template, the chat template both render with) for a
    template name: "qwen_style" (ours, TRL given its Qwen grammar) or one of TRL's, with TRL's training template
    where it swaps one in (not prefix-preserving)."""
    if template == "qwen_style":
        tokenizer = byte_tokenizer(QWEN_STYLE_TEMPLATE)
        reference = copy.deepcopy(tokenizer)
        reference.response_template = qwen3_template
        return ToolChat.for_tokenizer(tokenizer), reference, None
    tokenizer = byte_tokenizer(trl_template(template))
    reference = add_response_schema(copy.deepcopy(tokenizer))
    chat_template = get_training_chat_template(tokenizer) if template == "qwen3" else None
    return ToolChat.for_tokenizer(tokenizer, chat_template), reference, chat_template


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def prompt_ids(tokenizer, prompt, tools, chat_template=None) -> list[int]:
    """TRL's _tokenize_prompts for one conversational prompt."""
    return tokenizer.apply_chat_template(prompt, tools=tools or None, chat_template=chat_template,
                                         add_generation_prompt=True, tokenize=True, return_dict=False)


# -- tools -------------------------------------------------------------------------------------------------------


TOOLS = [add, echo, boom, blocks, record, amul, afail]


def call(name, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# -- parsing ------------------------------------------------------------------------------------------------------

JSON_TURNS = [
    "hello<|im_end|>",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
    'Let me.\n<tool_call>\n{"name": "add", "arguments": {"a": "1", "b": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "echo", "arguments": {"text": "7"}}\n</tool_call><|im_end|>',
    '<think>\nreason</think>\n\n<tool_call>\n{"name": "echo"}\n</tool_call><|im_end|>',  # no arguments: {}
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call><|im_end|>',  # malformed JSON: plain text
    '<tool_call>\n{"name": "add", "arguments": {"a": 1',  # cut short
    "reason</think>\n\nanswer<|im_end|>",
    "no end",
    '<tool_call>\n{"arguments": {}}\n</tool_call><|im_end|>',  # a call without a name: plain text
    "<tool_call>\n[1, 2]\n</tool_call><|im_end|>",
]
XML_TURNS = [
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>",
    "ok\n\n<tool_call>\n<function=echo>\n<parameter=text>\n7\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=add>\n</function>\n</tool_call><|im_end|>",
    "reason\n</think>\n\n<tool_call>\n<function=echo>\n<parameter=text>\nhi there\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>",
    "<tool_call>\n<function=add>\n<parameter=a>\n1",
    "thinking without end",
]


@pytest.mark.parametrize("template", ["qwen_style", "qwen2_5", "qwen3", "qwen3_6"])
def test_parse_matches_trl(template):
    chat, reference, chat_template = setup(template)
    prompt = prompt_ids(chat.tokenizer, [{"role": "user", "content": "hi"}], TOOLS, chat_template)
    schemas = [get_json_schema(t) for t in TOOLS]
    for text in JSON_TURNS + XML_TURNS:
        completion = ids(chat.tokenizer, text)
        want = trl_parse_response(reference, completion, prefix=prompt, tools=TOOLS)
        assert chat.parse(completion, prompt, schemas) == want, text
        assert chat.parse(completion, prompt, TOOLS) == want, text
    assert tool_calls(chat.parse(ids(chat.tokenizer, JSON_TURNS[0]), prompt, schemas)) is None


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "qwen3_instruct_2507", "qwen3_vl", "qwen3_5_nothink",
                                  "qwen3_5_think", "qwen3_6", "qwen3_8"])
def test_recognizes_the_qwen_templates_as_trl(name):
    """For each Qwen chat template TRL knows, the grammar found from what the template renders parses every turn as
    the one TRL's add_response_schema picks by the template's text (with thinking on, off and by default)."""
    tokenizer = byte_tokenizer(trl_template(name))
    reference = add_response_schema(copy.deepcopy(tokenizer))
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        grammar = response_template(tokenizer, None, kwargs)
        assert grammar in (QWEN_JSON_TOOL_CALLS, QWEN_XML_TOOL_CALLS)
        chat = ToolChat(tokenizer, grammar, None, kwargs)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS, tokenize=True,
                                               add_generation_prompt=True, return_dict=False, **kwargs)
        for text in JSON_TURNS + XML_TURNS:
            completion = ids(tokenizer, text)
            want = trl_parse_response(reference, completion, prefix=prompt, tools=TOOLS)
            assert chat.parse(completion, prompt, TOOLS) == want, (kwargs, text)


def test_response_template_of_the_tokenizer_first():
    tokenizer = byte_tokenizer(trl_template("glm4moe"))
    with pytest.raises(ValueError, match=r"^tools: the tokenizer has no response_template") as error:
        ToolChat.for_tokenizer(tokenizer)
    assert "\n" not in str(error.value)
    tokenizer.response_template = {"start_anchor": "<|assistant|>", "fields": {"content": {"content": "text"}}}
    assert ToolChat.for_tokenizer(tokenizer).response_template is tokenizer.response_template


@pytest.mark.parametrize("name", ["llama3_1", "glm4moe", "nemotron_3_nano", "gptoss"])
def test_refuses_tool_formats_it_does_not_know(name):
    """Templates TRL parses with grammars of their own (Nemotron 3 writes Qwen3.5's calls but its turns differ)."""
    tokenizer = byte_tokenizer(trl_template(name))
    with pytest.raises(ValueError, match=r"^tools: .*no response_template"):
        response_template(tokenizer)


def test_supports_tool_calls_as_trl():
    """Over every chat template TRL ships: the same verdict as trl's supports_tool_calling."""
    from trl.chat_template_utils import supports_tool_calling

    for path in sorted(TRL_TEMPLATES.glob("*.jinja")):
        tokenizer = byte_tokenizer(path.read_text(encoding="utf-8"))
        assert supports_tool_calls(tokenizer) == supports_tool_calling(tokenizer), path.name


def test_chat_template_refusals():
    no_tools = byte_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match=r"^tools: the chat template cannot render a tool-calling conversation"):
        ToolChat.for_tokenizer(no_tools)
    qwen3 = byte_tokenizer(trl_template("qwen3"))
    with pytest.raises(ValueError, match=r"^tools: .*not prefix-preserving") as error:
        ToolChat.for_tokenizer(qwen3)
    assert "\n" not in str(error.value)
    assert ToolChat.for_tokenizer(qwen3, get_training_chat_template(qwen3)).response_template is QWEN_JSON_TOOL_CALLS


# -- tool turn tokens -----------------------------------------------------------------------------------------------


def trl_suffix_ids(tokenizer, tool_messages, chat_template=None, chat_template_kwargs=None):
    trainer = types.SimpleNamespace(processing_class=tokenizer, _tokenizer=tokenizer, chat_template=chat_template,
                                    chat_template_kwargs=chat_template_kwargs or {}, _is_vlm=False)
    return GRPOTrainer._get_tool_suffix_ids(trainer, tool_messages)


@pytest.mark.parametrize("template", ["qwen_style", "qwen2_5", "qwen3", "qwen3_6"])
def test_suffix_ids_match_trl(template):
    chat, _, chat_template = setup(template)
    for messages in ([{"role": "tool", "name": "add", "content": "3"}],
                     [{"role": "tool", "name": "add", "content": "3"},
                      {"role": "tool", "name": "echo", "content": "two\nlines"}],
                     [{"role": "tool", "name": "boom", "content": str({"error": "kaboom"})}]):
        got = chat.suffix_ids(messages)
        assert got == trl_suffix_ids(chat.tokenizer, messages, chat_template), messages
        assert chat.tokenizer.decode(got).startswith("\n<|im_start|>user\n<tool_response>\n")  # after <|im_end|>


# -- running calls --------------------------------------------------------------------------------------------------


def trl_tool_loop(tokenizer, calls, tools, post_text="done<|im_end|>"):
    """TRL's _tool_call_loop, one round, on a stand-in trainer: rollout i's assistant turn makes `calls[i]`
    (`tokenizer`: with a response template, for the turn after the tools).
    -> (tool messages per rollout, tool_call_count, tool_failure_count, completion ids after the round)."""
    n = len(calls)
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(n)]
    prompt = [prompt_ids(tokenizer, p, tools) for p in prompts]
    completion = [ids(tokenizer, f"turn {i}<|im_end|>") for i in range(n)]
    completions = [[{"role": "assistant", "content": "", **({"tool_calls": c} if c else {})}] for c in calls]
    loop_thread, loop, ready = start_event_loop_in_daemon(name="test-trl-tools")
    ready.wait()
    post = ids(tokenizer, post_text)
    trainer = types.SimpleNamespace(
        processing_class=tokenizer, _tokenizer=tokenizer, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
        _sync_tool_dicts=[{t.__name__: t for t in tools if not inspect.iscoroutinefunction(t)}] * n,
        _async_tool_dicts=[{t.__name__: t for t in tools if inspect.iscoroutinefunction(t)}] * n,
        async_loop=loop, max_tool_calling_iterations=1, use_vllm=False, max_completion_length=10**6,
        model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=10**6)), tools=tools,
        environment_factories=None)
    trainer._get_tool_suffix_ids = functools.partial(GRPOTrainer._get_tool_suffix_ids, trainer)
    trainer._generate_single_turn = lambda prompt_ids, *a, **kw: ([list(post) for _ in prompt_ids], None)
    try:
        _, completions, completion_ids, _, count, failures, _ = GRPOTrainer._tool_call_loop(
            trainer, copy.deepcopy(prompts), prompt, copy.deepcopy(completion), completions, None, None, {})
    finally:
        shutdown_event_loop_in_daemon(loop_thread, loop)
    messages = [[m for m in c if m["role"] == "tool"] for c in completions]
    return messages, count, failures, (prompt, completion, completion_ids, post)


CALLS = [
    [call("add", a=1, b=2)],  # a result
    [call("boom")],  # an exception
    [call("nope", x=1)],  # an unknown tool
    [call("add", a=1, c=2)],  # arguments that do not fit
    [{"type": "function", "function": {"name": "add", "arguments": "a=1"}}],  # arguments that are not a dict
    [call("amul", a=2, b=3)],  # async
    [call("afail")],  # async, an exception
    [call("amul", a=2)],  # async, arguments that do not fit
    [call("add", a=1, b=2), call("echo", text="x"), call("boom")],  # sync calls, in order
    [call("amul", a=2, b=3), call("amul", a=4, b=5), call("afail")],  # async calls, together
    [{"type": "retrieval", "name": "search"}],  # a call type TRL does not run
    [call("blocks"), call("record")],  # a list result kept as content blocks, anything else str()
    None,  # no calls
]


def test_tool_messages_match_trl():
    chat, reference, _ = setup("qwen_style")
    want, count, failures, (prompt, completion, completion_ids, post) = trl_tool_loop(reference, CALLS, TOOLS)
    with ToolRunner(timeout=30) as runner:
        got, counts = runner.run(CALLS, [toolbox(TOOLS)] * len(CALLS))
    assert got == want
    assert (counts.calls, counts.failures) == (count, failures) == (17, 9)
    for i, messages in enumerate(got):  # TRL's completion after the round: sampled + tool turn + next turn
        if messages:
            assert completion_ids[i] == completion[i] + chat.suffix_ids(messages) + post, i


def test_results_in_call_order():
    """TRL gives a rollout's sync results first, then its async ones; here they follow the calls."""
    calls = [[call("amul", a=2, b=3), call("add", a=1, b=2), call("afail"), call("boom")]]
    want, *_ = trl_tool_loop(setup("qwen_style")[1], calls, TOOLS)
    with ToolRunner() as runner:
        (got,), counts = runner.run(calls, [toolbox(TOOLS)])
    assert [m["content"] for m in got] == ["6", "3", str({"error": "async kaboom"}), str({"error": "kaboom"})]
    assert sorted(got, key=str) == sorted(want[0], key=str)


def test_timeout_cuts_a_hung_call_only():
    release = threading.Event()

    def hang() -> str:
        """Never returns (until the test ends)."""
        release.wait(60)
        return "late"

    async def ahang() -> str:
        """Never returns."""
        await asyncio.sleep(60)

    def own_timeout() -> str:
        """Raises a TimeoutError of its own."""
        raise TimeoutError("upstream timed out")

    tools = [hang, ahang, own_timeout, add]
    calls = [[call("hang"), call("add", a=1, b=2)], [call("ahang"), call("add", a=2, b=2)], [call("own_timeout")],
             [call("add", a=3, b=4)]]
    start = time.perf_counter()
    try:
        with ToolRunner(timeout=0.3) as runner:
            got, counts = runner.run(calls, [toolbox(tools)] * len(calls))
    finally:
        release.set()
    elapsed = time.perf_counter() - start
    assert elapsed < 5, f"{elapsed:.1f} s: a hung call held up the step"  # 2 timeouts of 0.3 s, in parallel
    timed_out = lambda name: str({"error": f"Tool {name} timed out after 0.3 s."})
    assert [[m["content"] for m in r] for r in got] == [
        [timed_out("hang"), "3"], [timed_out("ahang"), "4"], [str({"error": "upstream timed out"})], ["7"]]
    assert (counts.calls, counts.failures) == (6, 3)

    # What TRL writes for a call that fails with the same message: the same tool message.
    def hang() -> str:  # noqa: F811 - TRL's side: the tool fails where ours is cut
        """Fails as a timed-out call reads."""
        raise Exception("Tool hang timed out after 0.3 s.")

    want, _, failures, _ = trl_tool_loop(setup("qwen_style")[1], [[call("hang")]], [hang])
    assert want[0] == [got[0][0]] and failures == 1


def test_rollouts_run_together_and_a_rollouts_sync_calls_in_order():
    order = []

    def wait(seconds: float) -> str:
        """Sleeps.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "ok"

    async def await_(seconds: float) -> str:
        """Sleeps, asynchronously.

        Args:
            seconds: how long
        """
        await asyncio.sleep(seconds)
        return "ok"

    def note(k: int) -> int:
        """Notes k.

        Args:
            k: what to note
        """
        time.sleep(0.01 * (3 - k))  # the first call is the slowest: run together, they would finish last first
        order.append(k)
        return k

    tools = [wait, await_, note]
    calls = [[call("wait", seconds=0.4)]] * 6 + [[call("await_", seconds=0.4)]] * 6
    calls.append([call("note", k=k) for k in range(3)])
    start = time.perf_counter()
    with ToolRunner() as runner:
        got, counts = runner.run(calls, [toolbox(tools)] * len(calls))
    elapsed = time.perf_counter() - start
    assert elapsed < 2.4, f"{elapsed:.2f} s for 12 rollouts of 0.4 s: not run together"  # one after another: 4.8 s
    assert order == [0, 1, 2] and counts.failures == 0 and got[-1][-1]["content"] == "2"


def test_tool_counts_metrics_as_trl():
    assert ToolCounts(6, 3).metrics(4) == {"tools/call_frequency": 1.5, "tools/failure_frequency": 0.5}
    assert ToolCounts(0, 0).metrics(4) == {"tools/call_frequency": 0.0, "tools/failure_frequency": 0.0}
    assert ToolCounts(1, 0) + ToolCounts(2, 1) == ToolCounts(3, 1)


# -- loading tools --------------------------------------------------------------------------------------------------

TOOL_MODULE = '''
def good(city: str, days: int = 3) -> str:
    """The forecast.

    Args:
        city: where
        days: how many days
    """
    return f"sunny in {city} for {days} days"


async def agood(query: str) -> str:
    """Searches.

    Args:
        query: what for
    """
    return query


def no_docstring(x: int) -> int:
    return x


def no_hint(x) -> int:
    """Doubles.

    Args:
        x: a number
    """
    return 2 * x


def undocumented_argument(x: int, y: int) -> int:
    """Adds.

    Args:
        x: a number
    """
    return x + y


class Callable:
    def __call__(self, x: int) -> int:
        return x


an_instance = Callable()
NOT_A_FUNCTION = 3
'''


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOL_MODULE)
    return path


def test_load_tools(tool_file):
    good, agood = load_tools([f"{tool_file}:good", f"{tool_file}:agood"])
    assert good("Paris") == "sunny in Paris for 3 days" and inspect.iscoroutinefunction(agood)
    assert tool_schema(good, "tools", "good") == get_json_schema(good)
    # The schemas render as the functions do (what TRL passes to the chat template).
    tokenizer = byte_tokenizer(QWEN_STYLE_TEMPLATE)
    prompt = [{"role": "user", "content": "hi"}]
    assert prompt_ids(tokenizer, prompt, [get_json_schema(good), get_json_schema(agood)]) == prompt_ids(
        tokenizer, prompt, [good, agood])


@pytest.mark.parametrize(("name", "error"), [
    ("no_docstring", r"no_docstring: Cannot generate JSON schema for no_docstring because it has no docstring"),
    ("no_hint", r"no_hint: Argument x is missing a type hint in function no_hint"),
    ("undocumented_argument", r"undocumented_argument: .* no description for the argument 'y'"),
    ("an_instance", r"an_instance is a Callable; a tool must be a function or method"),
    ("NOT_A_FUNCTION", r"has no callable 'NOT_A_FUNCTION'"),
    ("missing", r"has no callable 'missing'"),
])
def test_bad_tools_are_one_line(tool_file, name, error):
    with pytest.raises(ValueError, match=rf"^tools: .*{error}") as raised:
        load_tools([f"{tool_file}:{name}"])
    assert "\n" not in str(raised.value)


def test_bad_tool_specs(tool_file):
    with pytest.raises(ValueError, match=r"^tools: 'no_colon' must be written 'module:function'"):
        load_tools(["no_colon"])
    with pytest.raises(ValueError, match=r"^tools: 'no_such_module_x:f': cannot import"):
        load_tools(["no_such_module_x:f"])
    with pytest.raises(ValueError, match=r"^tools: two tools are named 'good'"):
        load_tools([f"{tool_file}:good", f"{tool_file}:good"])


# -- environments ---------------------------------------------------------------------------------------------------


def tiny_trainer(tokenizer, rows, environment_factory, tools, reward_funcs, num_generations, out):
    """A real GRPOTrainer (2-layer Qwen2, CPU, beta 0, one optimizer step per generation: no model forward)."""
    import datasets

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    n = len(rows) * num_generations
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=n, num_generations=num_generations,
                      gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, beta=0.0,
                      max_completion_length=4096, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                      logging_strategy="no", seed=0)
    return GRPOTrainer(model=Qwen2ForCausalLM(config), reward_funcs=reward_funcs, args=args,
                       train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer, tools=tools,
                       environment_factory=environment_factory)


def length_reward(completions, **columns) -> list[float]:
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("several", [False, True], ids=["one_environment", "two_environments"])
def test_environments_match_trl(several, monkeypatch):
    """One generation round through TRL's _generate_and_score_completions (only the sampling step replaced) and
    through the pieces here: the same prompts after reset, prompt tokens, tool messages, completion tokens, rewards
    (get_reward's included) and tool metrics."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = byte_tokenizer(QWEN_STYLE_TEMPLATE)
    reference = copy.deepcopy(tokenizer)
    reference.response_template = qwen3_template
    rows = [{"prompt": [{"role": "user", "content": "Count."}], "target": 3},
            {"prompt": [{"role": "user", "content": "Count more."}], "target": 5}]
    factory = Counter
    if several:
        rows = [{**rows[0], "environment": "counter"}, {**rows[1], "environment": "quiet"}]
        factory = {"counter": Counter, "quiet": Quiet}
    G = 2
    turns = [  # sample i's first turn
        '<tool_call>\n{"name": "increment", "arguments": {"by": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read", "arguments": {}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "shout", "arguments": {"text": "hi"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "increment", "arguments": {"by": "x"}}\n</tool_call><|im_end|>',
        "no tools<|im_end|>",
    ]
    first = [ids(tokenizer, t) for t in turns]
    after = ids(tokenizer, "done<|im_end|>")

    # -- TRL --
    seen = {}
    with tempfile.TemporaryDirectory() as out:
        trainer = tiny_trainer(reference, rows, factory, [echo], [length_reward], G, out)

    def sample(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if "prompt_ids" not in seen:
            seen["prompt_ids"] = copy.deepcopy(prompt_ids)
            return copy.deepcopy(first), None
        return [list(after) for _ in prompt_ids], None

    def recording(name, method, arguments=False):
        def wrapper(*a):
            seen[name] = copy.deepcopy(a[0]) if arguments else None
            result = method(*a)
            seen[name] = seen[name] if arguments else result
            return result
        return wrapper

    trainer._generate_single_turn = sample
    trainer._generate = recording("prompts", trainer._generate, arguments=True)
    trainer._tool_call_loop = recording("loop", trainer._tool_call_loop)
    trainer._calculate_rewards = recording("rewards", trainer._calculate_rewards)
    trainer.model.train()
    inputs = [row for row in rows for _ in range(G)]
    trainer._generate_and_score_completions(copy.deepcopy(inputs))
    _, trl_completions, trl_completion_ids, _, trl_calls, trl_failures, _ = seen["loop"]
    trl_metrics = {k: trainer._metrics["train"][k][-1] for k in ("tools/call_frequency", "tools/failure_frequency")}

    # -- here --
    standalone = load_tools([echo])
    environments = Environments(factory, standalone)
    chat = ToolChat.for_tokenizer(tokenizer)
    names = environments.names(inputs)
    assert [[t.__name__ for t in environments.tools[n]] for n in environments.tools] == [
        [t.__name__ for t in trainer._env_tools[n]] for n in trainer._env_tools]
    instances = environments.draw(inputs)
    prompts = environments.reset(instances, inputs, [row["prompt"] for row in inputs])
    assert prompts == seen["prompts"]
    assert inputs == [row for row in rows for _ in range(G)]  # reset left the rows and prompts as they were
    assert environments.schemas == {n: [get_json_schema(t) for t in tools] for n, tools in trainer._env_tools.items()}
    schemas = [environments.schemas[n] for n in names]
    prompt = [prompt_ids(tokenizer, p, s) for p, s in zip(prompts, schemas, strict=True)]
    assert prompt == seen["prompt_ids"]
    messages = [chat.parse(c, p, s) for c, p, s in zip(first, prompt, schemas, strict=True)]
    with ToolRunner(timeout=30) as runner:
        results, counts = runner.run([tool_calls(m) for m in messages],
                                     [toolbox(standalone, e) for e in instances])
    assert [len(r) for r in results] == [2, 1, 2, 0]
    for i, result in enumerate(results):
        assert trl_completions[i][1:-1] == result, i
        want = first[i] + chat.suffix_ids(result) + after if result else first[i]
        assert trl_completion_ids[i] == want, i
    assert (counts.calls, counts.failures) == (trl_calls, trl_failures)
    assert counts.metrics(len(inputs)) == pytest.approx(trl_metrics, rel=1e-7)  # TRL divides in float32 tensors

    rewards = {f.__name__: f for f in environments.reward_functions}
    assert list(rewards) == trainer.reward_func_names[1:] == ["Counter"]
    columns = {"environments": instances, "target": [row["target"] for row in inputs]}
    got = rewards["Counter"](prompts=prompts, completions=messages, **columns)
    want = seen["rewards"][:, 1].tolist()
    assert [math_nan_to_none(x) for x in want] == got


def math_nan_to_none(x):
    return None if x != x else x


def test_environment_pool_is_reused():
    environments = Environments(Counter)
    rows = [{"target": 1}] * 3
    first = environments.draw(rows)
    assert len({id(e) for e in first}) == 3 and environments.draw(rows) == first
    assert environments.draw(rows * 2)[:3] == first and len(environments.pools[None]) == 6


def test_async_get_reward():
    class Judge:
        def reset(self, **row) -> None:
            self.score = row["score"]

        async def get_reward(self) -> float:
            await asyncio.sleep(0)
            return self.score

    environments = Environments(Judge)
    rows = [{"score": 0.5}, {"score": 1.0}]
    instances = environments.draw(rows)
    environments.reset(instances, rows, [[{"role": "user", "content": "q"}]] * 2)
    (reward,) = environments.reward_functions
    assert reward.__name__ == "Judge" and asyncio.run(reward(environments=instances)) == [0.5, 1.0]


class NoReset:
    def step(self, x: int) -> int:
        """Steps.

        Args:
            x: how far
        """
        return x


class UndocumentedMethod:
    def reset(self, **row) -> None:
        return None

    def step(self, x: int) -> int:
        return x


class SameNameAsTool:
    def reset(self, **row) -> None:
        return None

    def echo(self, text: str) -> str:
        """Echoes.

        Args:
            text: what
        """
        return text


def broken_factory():
    raise OSError("no game server")


@pytest.mark.parametrize(("factory", "error"), [
    (NoReset, r"^environment_factory: NoReset makes NoReset instances, which have no reset method"),
    (UndocumentedMethod, r"^environment_factory: UndocumentedMethod\.step: Cannot generate JSON schema"),
    (SameNameAsTool, r"^environment_factory: SameNameAsTool and tools: two tools are named 'echo'"),
    (broken_factory, r"^environment_factory: broken_factory\(\) raised OSError: no game server"),
    ({}, r"^environment_factory: the dict names no environment"),
    ("no_such_module_x:Env", r"^environment_factory: 'no_such_module_x:Env': cannot import"),
])
def test_bad_environments_are_one_line(factory, error):
    with pytest.raises(ValueError, match=error) as raised:
        Environments(factory, [echo])
    assert "\n" not in str(raised.value)


def test_unknown_environment_name_is_one_line():
    environments = Environments({"counter": Counter})
    with pytest.raises(ValueError, match=r"^environment_factory: the row's environment column is 'chess', which is "
                                         r"not one of \['counter'\]"):  # (data.prepare names the file and row)
        environments.draw([{"environment": "counter"}, {"environment": "chess"}])


def test_environment_factory_by_path(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(inspect.getsource(Quiet))
    environments = Environments({"quiet": f"{path}:Quiet"})
    assert [t.__name__ for t in environments.tools["quiet"]] == ["shout"]
    assert environments.reset(environments.draw([{"environment": "quiet"}]), [{"environment": "quiet"}],
                              ["text prompt"]) == ["text prompt"]


# -- rollout_func ---------------------------------------------------------------------------------------------------


def rollout(**changes) -> dict:
    output = {"prompt_ids": [[5, 6], [5, 6]], "completion_ids": [[7, 8, 9], [7]],
              "logprobs": [[-0.1, None, -2.0], [-0.5]], "env_mask": [[1, 0, 1], [1]], "judge": ["a", "b"],
              "episode": 3}
    output.update(changes)
    return output


def test_rollout_output_checked_and_normalized():
    checked = check_rollout(rollout(prompt_ids=[torch.tensor([5, 6]), (5, 6)]), num_samples=2, vocab_size=10)
    assert checked["prompt_ids"] == [[5, 6], [5, 6]] and checked["completion_ids"] == [[7, 8, 9], [7]]
    assert checked["logprobs"][0][0] == -0.1 and checked["logprobs"][0][1] != checked["logprobs"][0][1]  # None: NaN
    assert checked["env_mask"] == [[1, 0, 1], [1]] and checked["judge"] == ["a", "b"] and checked["episode"] == 3
    assert check_rollout(rollout(logprobs=None), 2)["logprobs"] is None  # no sampler logprobs


@pytest.mark.parametrize(("output", "error"), [
    ([1, 2], r"must return a dict with \['prompt_ids', 'completion_ids', 'logprobs'\], got list"),
    ({"prompt_ids": [[1]], "completion_ids": [[1]]}, r"must return keys \['logprobs'\] in its output dict"),
    (rollout(prompt_ids=[[5, 6]]), r"prompt_ids has 1 entries but the step has 2 samples"),
    (rollout(completion_ids=[[7, 8, 9], []]), r"completion_ids\[1\] is empty"),
    (rollout(completion_ids=[[7, 8, 9], [7.5]]), r"completion_ids\[1\]\[0\] is 7.5, not a token id"),
    (rollout(completion_ids=[[7, 8, 99], [7]]), r"completion_ids\[0\]\[2\] is 99, outside the vocabulary \[0, 10\)"),
    (rollout(completion_ids="abc"), r"completion_ids must be a list with one entry per sample, got str"),
    (rollout(logprobs=[[-0.1, -2.0], [-0.5]]), r"logprobs\[0\] has 2 values but completion_ids\[0\] has 3 tokens"),
    (rollout(logprobs=[[-0.1, "x", -2.0], [-0.5]]), r"logprobs\[0\]\[1\] is 'x', not a finite logprob"),
    (rollout(env_mask=[[1, 2, 1], [1]]), r"env_mask\[0\]\[1\] is 2, not 0 or 1"),
    (rollout(env_mask=[[1], [1]]), r"env_mask\[0\] has 1 values but completion_ids\[0\] has 3 tokens"),
    (rollout(judge=["a"]), r"the extra field 'judge' is a list of 1 values but the step has 2 samples"),
])
def test_bad_rollout_output_is_one_line(output, error):
    with pytest.raises(ValueError, match=rf"^rollout_func\b.*{error}") as raised:
        check_rollout(output, num_samples=2, vocab_size=10)
    assert "\n" not in str(raised.value)
