"""Tools and environments for multi-turn rollouts, with TRL 1.16's GRPOTrainer semantics: the pieces the agent loop
calls (loading and checking tools, parsing the model's tool calls, running them, the tool turn's tokens, checking a
user rollout_func's output).

One step of the loop, per rollout that has tool calls (TRL's `_tool_call_loop`):

    message = chat.parse(completion_ids, prompt_ids, schemas)        # {"role": "assistant", "content", "tool_calls"?}
    results, counts = runner.run([message["tool_calls"], ...], [toolbox, ...])   # [{"role": "tool", ...}, ...]
    ids = prompt_ids + completion_ids + chat.suffix_ids(results)    # generate the next turn from here, tokens as is

Tools are plain Python functions (`def` or `async def`) with type hints and a Google-style docstring: transformers'
`get_json_schema` turns them into the schemas the chat template shows the model (`tools=` of apply_chat_template).
An environment (`environment_factory`, a class or a {name: class} dict selected by the data's `environment` column)
gets one instance per rollout, drawn from a pool and reset with the sample's row (`reset(**row) -> str | None`,
a string is appended to the last user message); its public methods are the rollout's tools, and an optional
`get_reward()` scores the rollout as one more reward function, weight 1, named after the class.

A tool's result becomes `{"role": "tool", "name": name, "content": str(result)}` (a list of content blocks is kept);
an exception, an unknown tool, arguments that do not fit, a result that cannot be shown as text or a call past
`timeout` seconds becomes `str({"error": message})`, as TRL writes it, and counts as a failure. TRL's metrics:
tools/call_frequency = calls per sample, tools/failure_frequency = failures per call.

Where this differs from TRL: a tool is checked up front (TRL fails later, inside apply_chat_template); two tools may
not share a name (TRL calls whichever its dict kept); a rollout's results come in the order of its calls (TRL puts
the sync tools' results first, then the async ones', which a template that does not name the tool in its result, as
Qwen's, leaves the model to match by position); rollouts' calls run concurrently, each on a thread of its own, and a
call can time out (TRL runs a rollout after another and waits); a list result that is not content blocks is shown
as its str() (TRL passes it to the chat template as it is); a chat template that is not prefix-preserving is refused
(TRL swaps in a training template it ships, which can be given here as `chat_template`).
"""

import asyncio
import collections.abc
import inspect
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass

from fastgrpo.train.rewards import load_function

# -- response templates ---------------------------------------------------------------------------------------------
# transformers' response parsing (tokenizer.parse_response) reads a declarative `response_template`. Hub tokenizers
# that ship one are used as they are; for the Qwen formats, which most do not ship yet, these are the grammars of
# the assistant turn (what TRL's add_response_schema sets for the Qwen chat templates).

_QWEN_START = "<|im_start|>assistant\n"
_QWEN_REASONING = {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"}
_QWEN_CONTENT = {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}
_QWEN_PREFILLS = ("", "<think>\n", "<think>\n\n</think>\n\n")  # after the header: thinking on, off

# Qwen2.5, Qwen3, Qwen3-2507, Qwen3-VL: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
QWEN_JSON_TOOL_CALLS = {
    "defaults": {"role": "assistant"},
    "start_anchor": _QWEN_START,
    "fields": {
        "reasoning_content": _QWEN_REASONING,
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": _QWEN_CONTENT,
    },
}

# Qwen3.5, Qwen3.6: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>.
# A value is raw text, so "7" and 7 read the same: parse_response types it from the tool's schema (tools=).
QWEN_XML_TOOL_CALLS = {
    "defaults": {"role": "assistant"},
    "start_anchor": _QWEN_START,
    "fields": {
        "reasoning_content": _QWEN_REASONING,
        "tool_calls": {
            "open_pattern": r"<tool_call>\s*<function=(?P<name>[^\n>]+)>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                             "value_parser": {"name": "text"}},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": _QWEN_CONTENT,
    },
}

# How each format renders a call {"name": "probe_fn", "arguments": {"probe_key": "probe_value"}} in an assistant turn.
_RENDERED_CALLS = {
    '<tool_call>\n{"name": "probe_fn", "arguments": {"probe_key": "probe_value"}}\n</tool_call>': QWEN_JSON_TOOL_CALLS,
    "<tool_call>\n<function=probe_fn>\n<parameter=probe_key>\nprobe_value\n</parameter>\n</function>\n</tool_call>":
        QWEN_XML_TOOL_CALLS,
}

# TRL's reference conversation for a tool turn's tokens (`_get_tool_suffix_ids`): the tool turn is rendered after
# this user message and an assistant turn calling the tool with no arguments.
_DUMMY_USER = {"role": "user", "content": "dummy"}


# -- loading and checking -------------------------------------------------------------------------------------------


def tool_schema(tool: Callable, option: str, where: str) -> dict:
    """The JSON schema the chat template shows the model for `tool` (transformers' get_json_schema), or one line
    naming `option` and `where` saying why there can be none."""
    from transformers.utils import get_json_schema

    if not callable(tool):
        raise ValueError(f"{option}: {where} is a {type(tool).__name__}, not a function")
    if not (inspect.isfunction(tool) or inspect.ismethod(tool)):
        raise ValueError(f"{option}: {where} is a {type(tool).__name__}; a tool must be a function or method (def or "
                         "async def) so that transformers can read its signature and docstring")
    for parameter in inspect.signature(tool).parameters.values():  # a call passes its arguments by name
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.POSITIONAL_ONLY):
            shown = f"*{parameter.name}" if parameter.kind == parameter.VAR_POSITIONAL else f"{parameter.name}, /"
            raise ValueError(f"{option}: {where}: its argument {shown} can only be given by position, and the "
                             "model's calls give every argument by name; make it a named argument")
    try:
        return get_json_schema(tool)
    except Exception as e:  # TypeHintParsingException, DocstringParsingException
        reason = " ".join(str(e).split())
        raise ValueError(f"{option}: {where}: {reason} (a tool needs a type hint on every argument and a Google-style "
                         "docstring with an Args: line for each)") from None


def load_tools(specs: list[str | Callable]) -> list[Callable]:
    """--tools: each 'module:function' or 'file.py:function' (or a function) loaded and checked."""
    tools = []
    for spec in specs:
        where = spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
        try:
            tool = load_function(spec) if isinstance(spec, str) else spec
        except ValueError as e:
            raise ValueError(f"tools: {str(e).removeprefix('reward function ')}") from None
        tool_schema(tool, "tools", where)
        tools.append(tool)
    _check_unique(tools, "tools")
    return tools


def _check_unique(tools: list[Callable], where: str) -> None:
    seen = set()
    for tool in tools:
        if tool.__name__ in seen:
            raise ValueError(f"{where}: two tools are named {tool.__name__!r}; the model calls a tool by its name, so "
                             "names must be unique")
        seen.add(tool.__name__)


def environment_methods(environment) -> list[Callable]:
    """An environment's tools, as TRL finds them: the functions defined on its class, sorted by name, other than
    reset, get_reward and private (_) ones, bound to the instance (listed on the class: properties stay unread)."""
    names = [name for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)]
    return [getattr(environment, name) for name in names
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def toolbox(tools: list[Callable], environment=None) -> dict[str, Callable]:
    """What a rollout's calls are looked up in: {name: function}, the standalone tools and its environment's."""
    methods = environment_methods(environment) if environment is not None else []
    return {tool.__name__: tool for tool in [*tools, *methods]}


def _is_async(function: Callable) -> bool:
    return inspect.iscoroutinefunction(function)


class Environments:
    """--environment-factory: 'module:Class' (one environment for every sample) or {name: 'module:Class'} (the
    data's `environment` column picks one per sample); a callable may stand for a spec.

    Each factory is called once up front to check its instances (a reset method, public methods that are valid
    tools) and seeds a pool; draw() hands out one instance per rollout, creating more only when a batch needs more
    than the pool holds (TRL's "construct once, reset often")."""

    def __init__(self, factory: str | Callable | dict[str, str | Callable], tools: list[Callable] = ()):
        self.multi = isinstance(factory, dict)
        specs = factory if self.multi else {None: factory}
        if not specs:
            raise ValueError("environment_factory: the dict names no environment")
        self.standalone = list(tools)
        self.factories, self.pools, self.reward_functions = {}, {}, []
        self.tools, self.schemas = {}, {}  # per environment: its tools (standalone first), their JSON schemas
        rewarded = []  # classes that already have a reward function (one per class, as TRL)
        for name, spec in specs.items():
            where = spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
            try:
                make = load_function(spec) if isinstance(spec, str) else spec
            except ValueError as e:
                raise ValueError(f"environment_factory: {str(e).removeprefix('reward function ')}") from None
            if not callable(make):
                raise ValueError(f"environment_factory: {where} is a {type(make).__name__}, not a class or function")
            try:
                instance = make()
            except Exception as e:
                raise ValueError(f"environment_factory: {where}() raised {type(e).__name__}: {e}") from e
            if not callable(getattr(instance, "reset", None)):  # a method, classmethod or staticmethod
                raise ValueError(f"environment_factory: {where} makes {type(instance).__name__} instances, which have "
                                 "no reset method; an environment needs reset(**row) -> str | None, called before "
                                 "each rollout")
            methods = environment_methods(instance)
            self.schemas[name] = [tool_schema(t, "tools", t.__name__) for t in self.standalone] + [
                tool_schema(m, "environment_factory", f"{type(instance).__name__}.{m.__name__}") for m in methods]
            _check_unique(self.standalone + methods, f"environment_factory: {type(instance).__name__} and tools")
            self.factories[name], self.pools[name] = make, [instance]
            self.tools[name] = self.standalone + methods
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in rewarded:
                rewarded.append(type(instance))
                self.reward_functions.append(_environment_reward(type(instance)))

    def draw(self, rows: list[dict]) -> list:
        """One environment instance per row (per rollout), each row's own environment with several."""
        names = self.names(rows)
        handed_out, instances = {}, []
        for name in names:
            pool, k = self.pools[name], handed_out.get(name, 0)
            if k == len(pool):
                pool.append(self.factories[name]())
            handed_out[name] = k + 1
            instances.append(pool[k])
        return instances

    def names(self, rows: list[dict]) -> list:
        """Each row's environment name (None with a single environment)."""
        if not self.multi:
            return [None] * len(rows)
        names = [row.get("environment") for row in rows]
        for name in names:
            if name not in self.factories:  # (data.prepare names the row: every row's tools are looked up there)
                raise ValueError(f"environment_factory: the row's environment column is {name!r}, which is not one "
                                 f"of {list(self.factories)}; with several environments each row's 'environment' "
                                 "column names one")
        return names

    def reset(self, instances: list, rows: list[dict], prompts: list) -> list:
        """reset(**row) on each instance (the row less its 'environment' with several environments); a returned
        string (or, for a conversational prompt, a list of content blocks) is appended to the prompt's last message.
        Returns the new prompts; the given ones are left as they were. A reset that raises or returns anything else
        is a RolloutError naming the class and the row."""
        reset_prompts = []
        for instance, row, prompt in zip(instances, rows, prompts, strict=True):
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else row
            where = f"{type(instance).__name__}.reset(**row) for the row {_short(row)}"
            try:
                observation = instance.reset(**kwargs)
            except Exception as e:
                raise RolloutError(f"environment_factory: {where} raised {type(e).__name__}: {_short(e)}") from e
            blocks = isinstance(prompt, list) and _is_content_blocks(observation)
            if not (observation is None or isinstance(observation, str) or blocks):
                kind = "string or a list of content blocks" if isinstance(prompt, list) else "string"
                raise RolloutError(f"environment_factory: {where} returned {_short(observation)} "
                                   f"({type(observation).__name__}); it must return a {kind} to append to the prompt, "
                                   "or None")
            reset_prompts.append(prompt if observation is None else _append(prompt, observation))
        return reset_prompts


def _short(value, limit: int = 200) -> str:
    """repr(value) on one line, at most `limit` characters."""
    text = " ".join(repr(value).split()) if not isinstance(value, BaseException) else " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_content_blocks(value) -> bool:
    """A list of content blocks, [{"type": ...}, ...] (TRL's multimodal messages)."""
    return isinstance(value, list) and all(isinstance(block, dict) and "type" in block for block in value)


def _append(prompt, observation):
    """The prompt with `observation` appended to its last message (to its text for a string prompt)."""
    if isinstance(prompt, str):
        return prompt + observation
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return [*prompt[:-1], {**prompt[-1], "content": content + observation}]


def _environment_reward(environment_type: type) -> Callable:
    """A reward function for the rollouts whose environment is exactly `environment_type`: its get_reward(), None
    for the others. Called as every reward function, with the rollouts' instances as the `environments` column."""
    if _is_async(environment_type.get_reward):
        async def reward(environments, **columns):
            return [await e.get_reward() if type(e) is environment_type else None for e in environments]
    else:
        def reward(environments, **columns):
            return [e.get_reward() if type(e) is environment_type else None for e in environments]
    reward.__name__ = environment_type.__name__
    return reward


# -- the chat template: parsing calls, rendering results ------------------------------------------------------------


def _render(tokenizer, messages, chat_template, kwargs, **options):
    return tokenizer.apply_chat_template(messages, chat_template=chat_template, **options, **(kwargs or {}))


def supports_tool_calls(tokenizer, chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> bool:
    """Whether the chat template renders a whole tool exchange (user, assistant calling a tool, tool result) with the
    call's name, argument and the result all in the text (TRL's supports_tool_calling). A template that does not
    compile raises jinja2's TemplateSyntaxError."""
    from jinja2 import TemplateError, TemplateSyntaxError

    if (chat_template or tokenizer.chat_template) is None:
        return False
    sentinels = ("probe_name_5c1e", "probe_key_7a2b", "probe_value_9d4f", "probe_result_3e8c")
    name, key, value, result = sentinels
    for arguments in ({key: value}, f'{{"{key}": "{value}"}}'):  # a dict, or JSON text for templates that need it
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]},
                    {"role": "tool", "name": name, "content": result}]
        try:
            text = _render(tokenizer, messages, chat_template, chat_template_kwargs or {}, tokenize=False)
        except TemplateSyntaxError:
            raise
        except TemplateError:
            return False
        except TypeError:
            continue
        return all(s in text for s in sentinels)
    return False


def response_template(tokenizer, chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> dict:
    """The grammar tool calls are parsed with: the tokenizer's own `response_template`, else the Qwen format its
    chat template renders calls in; one line naming `tools` when there is neither."""
    from jinja2 import TemplateError

    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    call = {"type": "function", "function": {"name": "probe_fn", "arguments": {"probe_key": "probe_value"}}}
    user = {"role": "user", "content": "hi"}
    kwargs = chat_template_kwargs or {}
    try:
        turn = _render(tokenizer, [user, {"role": "assistant", "content": "", "tool_calls": [call]}], chat_template,
                       kwargs, tokenize=False)
        header = _render(tokenizer, [user], chat_template, kwargs, tokenize=False, add_generation_prompt=True)
    except (TemplateError, TypeError):
        turn = header = ""
    # A Qwen turn: "<|im_start|>assistant\n", an empty <think> block or none, the call, "<|im_end|>"; the grammars
    # read a <think> block the generation prompt opens (Nemotron 3's "<think></think>\n" turns parse otherwise).
    _, start, prefill = header.rpartition(_QWEN_START)
    body = turn.rpartition(_QWEN_START)[2].removeprefix(_QWEN_PREFILLS[2])
    if start and prefill in _QWEN_PREFILLS:
        for rendered, template in _RENDERED_CALLS.items():
            if body.startswith(rendered + "<|im_end|>"):
                return template
    raise ValueError("tools: the tokenizer has no response_template and its chat template writes tool calls in no "
                     "format fastgrpo knows (Qwen's <tool_call> JSON or XML), so the model's tool calls cannot be "
                     "read; set tokenizer.response_template (transformers' response parsing)")


def _is_prefix_preserving(tokenizer, chat_template, kwargs) -> bool:
    call = [{"type": "function", "function": {"name": "dummy", "arguments": {}}}]
    turn = [_DUMMY_USER, {"role": "assistant", "content": "", "tool_calls": call}]
    before = _render(tokenizer, turn, chat_template, kwargs, tokenize=True, return_dict=False)
    after = _render(tokenizer, turn + [{"role": "tool", "name": "dummy", "content": "dummy"}], chat_template, kwargs,
                    tokenize=True, return_dict=False, add_generation_prompt=True)
    return after[: len(before)] == before


@dataclass(frozen=True)
class ToolChat:
    """The chat template's side of tool calling for one tokenizer: parse() reads an assistant turn's tool calls,
    suffix_ids() gives the tokens of a tool turn. `chat_template` (default: the tokenizer's) is the one prompts are
    rendered with."""

    tokenizer: object
    response_template: dict
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer, chat_template: str | None = None,
                      chat_template_kwargs: dict | None = None, template_path: str | None = None) -> "ToolChat":
        """Checks, each refused in one line naming `tools`: transformers >= 5.15 (response parsing that types the
        arguments from the tools' schemas), a chat template that compiles, renders a whole tool exchange and is
        prefix-preserving (earlier turns render the same once a tool result follows: the sampled tokens are kept
        and the tool turn's tokens appended), a response template. `template_path`: the chat_template_path the
        template was read from, if any (the errors name it)."""
        import transformers
        from jinja2 import TemplateSyntaxError
        from packaging.version import Version

        if Version(transformers.__version__) < Version("5.15.0"):
            raise ValueError(f"tools need transformers >= 5.15 (response parsing with the tools' schemas); "
                             f"{transformers.__version__} is installed: pip install -U transformers")
        kwargs = chat_template_kwargs or {}
        source = "the chat template" + ("" if template_path is None else f" of chat_template_path {template_path}")
        try:
            renders = supports_tool_calls(tokenizer, chat_template, kwargs)
        except TemplateSyntaxError as e:
            raise ValueError(f"tools: {source} is not a valid Jinja template: line {e.lineno}: {e.message}") from None
        if not renders:
            advice = ("use a model whose chat template supports tools, or give one with chat_template_path"
                      if template_path is None else "give one that does")
            raise ValueError(f"tools: {source} cannot render a tool-calling conversation (user, then an assistant "
                             f"turn with tool_calls, then a tool message); {advice}")
        if not _is_prefix_preserving(tokenizer, chat_template, kwargs):
            raise ValueError("tools: the chat template renders an assistant turn differently once a tool result "
                             "follows (it is not prefix-preserving, e.g. Qwen3's drops the turn's <think> block), so "
                             "the tool turn's tokens cannot be appended to the sampled ones; give a prefix-preserving "
                             "one with chat_template_path (TRL ships them: trl/chat_templates/*_training.jinja)")
        return cls(tokenizer, response_template(tokenizer, chat_template, kwargs), chat_template, kwargs)

    def parse(self, completion_ids: list[int], prompt_ids: list[int], tools: list[dict | Callable] | None) -> dict:
        """An assistant turn as a message {"role": "assistant", "content": str, "tool_calls"?: [...],
        "reasoning_content"?: str}, as TRL's parse_response gives it: transformers' tokenizer.parse_response
        (the prompt read as context, the calls' arguments typed from `tools`, the schemas or functions the prompt
        was rendered with), a trailing EOS dropped from the content, calls without arguments given {}; a turn
        that does not parse (malformed calls) is plain text, special tokens dropped."""
        try:
            message = self.tokenizer.parse_response(completion_ids, self.response_template, prefix=prompt_ids,
                                                    tools=tools)
            if message is None:  # a completion cut so short that not even its content survives
                raise ValueError("nothing parsed")
            if isinstance(message.get("content"), str):
                message["content"] = message["content"].removesuffix(self.tokenizer.eos_token)
            message["content"] = message.get("content") or ""
            if "tool_calls" in message:
                _check_calls(message["tool_calls"])
        except (ValueError, TypeError):
            message = {"role": "assistant",
                       "content": self.tokenizer.decode(completion_ids, skip_special_tokens=True)}
        return message

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens that follow a tool-calling assistant turn (its sampled tokens end at its EOS) up to the next
        assistant turn's generation prompt: the end of the turn, the tool messages, the generation prompt. As TRL,
        the difference of two renderings of a reference conversation, with and without `tool_messages`, the first
        cut after its last EOS (templates such as Qwen's write "<|im_end|>\\n": the "\\n" belongs here)."""
        call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
        turn = [_DUMMY_USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
        render = lambda messages, prompt: _render(self.tokenizer, messages, self.chat_template,
                                                  self.chat_template_kwargs, tokenize=True, return_dict=False,
                                                  add_generation_prompt=prompt)
        before, after = render(turn, False), render(turn + list(tool_messages), True)
        eos = self.tokenizer.eos_token_id
        ends = [i for i, token in enumerate(before) if token == eos]
        if ends:
            before = before[: ends[-1] + 1]
        if after[: len(before)] != before:
            raise ValueError("tools: the chat template renders the assistant turn differently once tool messages "
                             "follow, so the tool turn's tokens cannot be cut from it")
        return after[len(before):]


def _check_calls(calls) -> None:
    """Malformed calls raise ValueError (the turn is then read as text); a call without arguments gets {}."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls is not a list")
    for call in calls:
        if not isinstance(call, dict):
            raise ValueError("a tool call is not a dict")
        function = call.get("function", call)  # {"type", "function": {"name", "arguments"}} or {"name", "arguments"}
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call has no name")
        if function.get("arguments") is None:
            function["arguments"] = {}


def tool_calls(message: dict) -> list[dict] | None:
    """The calls of a parsed assistant turn (None when it makes none)."""
    return message.get("tool_calls") or None


# -- running calls --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ToolCounts:
    """Tool calls made and failed, summed over a step's rounds (and ranks) for TRL's metrics."""

    calls: int = 0
    failures: int = 0

    def __add__(self, other: "ToolCounts") -> "ToolCounts":
        return ToolCounts(self.calls + other.calls, self.failures + other.failures)

    def metrics(self, num_samples: int) -> dict[str, float]:
        """TRL's tools/call_frequency (calls per sample) and tools/failure_frequency (failures per call, 0 without
        calls); `num_samples` counts the step's samples, all ranks'."""
        return {"tools/call_frequency": self.calls / num_samples,
                "tools/failure_frequency": self.failures / self.calls if self.calls else 0.0}


def tool_content(result) -> str | list:
    """A result as the tool message's content: a list of content blocks as it is (TRL's multimodal results), anything
    else as str(), other lists included (TRL passes every list on, which a text template cannot render: a
    `-> list[int]` tool's result ended the run in Jinja)."""
    return result if result and _is_content_blocks(result) else str(result)


def tool_message(name: str, result) -> dict:
    """A result as the tool message TRL writes, its content as tool_content makes it."""
    return {"role": "tool", "name": name, "content": tool_content(result)}


class ToolRunner:
    """Runs a step's tool calls, all rollouts at once.

    Every call runs on a thread of its own (at most `max_threads` at once): a sync tool as it is, an async one in an
    event loop of its own on that thread, so that a tool that blocks (time.sleep, a sync HTTP client, inside a def or
    an async def) holds up no other call; the runner's own event loop (a daemon thread) only waits for them. Within a
    rollout, as TRL: the sync tools run one after another in the order called, then the async ones together;
    rollouts run concurrently, so a tool must be safe to call from several threads (an environment's methods are:
    one instance per rollout). Each call gets `timeout` seconds (None: no limit): a call past it is reported as a
    failed call and the step goes on. Python cannot stop a thread, so a hung call's thread runs on in the
    background (an async tool's task is cancelled, which takes effect at its next await)."""

    def __init__(self, timeout: float | None = None, max_threads: int = 64):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"tool_timeout must be a positive number of seconds or None, got {timeout}")
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._threads = asyncio.Semaphore(max_threads)
        self._thread = threading.Thread(target=self._loop.run_forever, name="fastgrpo-tools", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, calls: list[list[dict] | None], toolboxes: list[dict[str, Callable]]
            ) -> tuple[list[list[dict]], ToolCounts]:
        """calls[i]: rollout i's parsed tool calls (None or [] for none); toolboxes[i]: its {name: function}.
        -> (tool messages per rollout, one per call in call order; the calls and failures counted)."""
        if len(calls) != len(toolboxes):
            raise ValueError(f"{len(calls)} rollouts' calls but {len(toolboxes)} toolboxes")
        work = self._run_all([c or [] for c in calls], toolboxes)
        outcomes = asyncio.run_coroutine_threadsafe(work, self._loop).result()
        messages = [[tool_message(name, content) for name, content, _ in rollout] for rollout in outcomes]
        failures = sum(failed for rollout in outcomes for _, _, failed in rollout)
        return messages, ToolCounts(sum(map(len, outcomes)), failures)

    async def _run_all(self, calls, toolboxes):
        return await asyncio.gather(*(self._run_rollout(c, box) for c, box in zip(calls, toolboxes, strict=True)))

    async def _run_rollout(self, calls: list[dict], box: dict[str, Callable]) -> list[tuple[str, object, bool]]:
        outcomes = [None] * len(calls)  # (name, content, failed) per call
        started = []  # (index, name, tool, arguments) of the async calls, run after the sync ones
        for k, call in enumerate(calls):
            function = call.get("function")
            if call.get("type") != "function" or not isinstance(function, dict):
                error = {"error": f"Unsupported tool call type: {call.get('type')}"}
                outcomes[k] = (call.get("name", "unknown"), str(error), True)
                continue
            name, arguments = function["name"], function.get("arguments")
            tool = box.get(name)
            if tool is None:
                outcomes[k] = (name, str({"error": f"Tool {name} not found."}), True)
            elif _is_async(tool):
                started.append((k, name, tool, arguments))
            else:
                outcomes[k] = await self._settle(name, tool, arguments)
        settled = await asyncio.gather(*(self._settle(name, tool, arguments) for _, name, tool, arguments in started))
        for (k, *_), outcome in zip(started, settled, strict=True):
            outcomes[k] = outcome
        return outcomes

    async def _settle(self, name: str, tool: Callable, arguments) -> tuple[str, str | list, bool]:
        """(name, content, failed) of one call: its result as content (tool_content), or str({"error": ...}) for an
        exception (arguments that do not fit included), a timeout (told apart from a TimeoutError the tool raises
        itself) or a result that cannot be shown as text."""
        async with self._threads:  # a slot while it runs: the timeout counts no wait for one
            task = asyncio.ensure_future(self._in_thread(tool, arguments))
            done, _ = await asyncio.wait({task}, timeout=self.timeout)
        if not done:
            task.cancel()
            return name, str({"error": f"Tool {name} timed out after {self.timeout:g} s."}), True
        try:
            result = task.result()
        except Exception as e:
            return name, str({"error": str(e)}), True
        try:
            return name, tool_content(result), False
        except Exception as e:  # a result whose __str__ raises
            error = f"the result of {name} cannot be shown as text ({type(e).__name__}: {e})"
            return name, str({"error": error}), True

    async def _in_thread(self, tool: Callable, arguments):
        """tool(**arguments) on a new daemon thread (an async tool in an event loop of its own there): a call that
        blocks or never returns holds no thread the others need. Cancelled (timed out), an async tool's task is
        cancelled in its loop."""
        loop, done = self._loop, self._loop.create_future()
        own = {}  # an async tool's loop and task

        def settle(result, error):
            if done.done():  # cancelled: the call timed out
                return
            if error is None:
                done.set_result(result)
            else:
                done.set_exception(error if isinstance(error, Exception) else RuntimeError(repr(error)))

        def call():
            try:
                result, error = (_run_async(tool, arguments, own) if _is_async(tool) else tool(**arguments)), None
            except BaseException as e:  # noqa: B036 - reported as the call's failure (SystemExit included)
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the runner was closed while the call hung: nobody waits for it
                pass

        threading.Thread(target=call, name=f"fastgrpo-tool-{tool.__name__}", daemon=True).start()
        try:
            return await done
        except asyncio.CancelledError:
            if "task" in own:
                try:
                    own["loop"].call_soon_threadsafe(own["task"].cancel)
                except RuntimeError:  # its loop has just closed: the call is over
                    pass
            raise


def _run_async(tool: Callable, arguments, own: dict):
    """An async tool's call to its end in a new event loop on this thread; own["loop"], own["task"] while it runs."""
    loop = asyncio.new_event_loop()
    try:
        own["loop"] = loop
        own["task"] = loop.create_task(tool(**arguments))  # arguments that do not fit raise here
        return loop.run_until_complete(own["task"])
    finally:
        loop.close()


# -- rollout_func ---------------------------------------------------------------------------------------------------

ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")


class RolloutError(ValueError):
    """A rollout that cannot be trained on: a rollout_func's output that is not one, an environment's reset() that
    raises or returns nonsense, a tool result the chat template cannot render. Found during a step, so the command
    line reports it as it does a reward function's bad output (one line, exit 1)."""


def _token_ids(value, key: str, i: int, vocab_size: int | None) -> list[int]:
    if hasattr(value, "tolist") and not isinstance(value, list):  # a 1-D tensor or numpy array
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, collections.abc.Sequence):
        raise RolloutError(f"rollout_func: {key}[{i}] must be a list of token ids, got {type(value).__name__}")
    if not value:
        raise RolloutError(f"rollout_func: {key}[{i}] is empty; every sample needs at least one token")
    for t, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise RolloutError(f"rollout_func: {key}[{i}][{t}] is {token!r}, not a token id (an int)")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bounds = f"outside the vocabulary [0, {vocab_size})" if vocab_size is not None else "negative"
            raise RolloutError(f"rollout_func: {key}[{i}][{t}] is {token}, {bounds}")
    return [int(token) for token in value]


def _as_list(value, where: str, what: str) -> list:
    """A list (or a tensor / array: its .tolist()); a string or a non-sequence is refused naming `where`."""
    if hasattr(value, "tolist") and not isinstance(value, list):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, collections.abc.Sequence):
        raise RolloutError(f"rollout_func: {where} must be {what}, got {type(value).__name__}")
    return list(value)


def _per_sample(output: dict, key: str, num_samples: int) -> list:
    value = _as_list(output[key], key, "a list with one entry per sample")
    if len(value) != num_samples:
        raise RolloutError(f"rollout_func: {key} has {len(value)} entries but the step has {num_samples} samples "
                           "(prompts x num_generations); return one per sample")
    return value


def _per_token(value, key: str, i: int, length: int, check: Callable, what: str) -> list:
    value = _as_list(value, f"{key}[{i}]", "a list")
    if len(value) != length:
        raise RolloutError(f"rollout_func: {key}[{i}] has {len(value)} values but completion_ids[{i}] has {length} "
                           "tokens; give one per completion token")
    for t, x in enumerate(value):
        if not check(x):
            raise RolloutError(f"rollout_func: {key}[{i}][{t}] is {x!r}, not {what}")
    return value


# A sampler's logprob is a log-probability, <= 0; a bf16 sampler's log-softmax can land one bf16 spacing above 0 for
# its top token (0.0625 for logits of 8-16), so up to 0.1 passes.
LOGPROB_SLACK = 0.1


def _is_logprob(x) -> bool:
    """None or NaN (unknown), or a number in [-inf, LOGPROB_SLACK] that is finite."""
    if x is None:
        return True
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    return math.isnan(x) or (math.isfinite(x) and x <= LOGPROB_SLACK)


def check_rollout(output, num_samples: int, vocab_size: int | None = None, max_completion_length: int | None = None,
                  context_window: int | None = None) -> dict:
    """A user rollout_func's output checked: a dict with prompt_ids and completion_ids (one non-empty list of token
    ids per sample, in [0, vocab_size); a completion of at most max_completion_length tokens, with its prompt within
    the model's context_window) and logprobs (None, or one list per sample with one finite logprob <= 0 per completion
    token: the sampler's logprob of it; None for one it does not know, read as NaN, as TRL). Optional env_mask (one
    0/1 per completion token: 0 on tokens the model did not write, left out of the loss, as TRL) and
    logprob_token_ids (one entry per completion token). Any other field is passed to the reward functions: a list
    (one value per sample) or a single value for all. Anything else is one line naming rollout_func.
    -> the same dict, token ids as int lists, logprobs as float lists (NaN for None)."""
    if not isinstance(output, collections.abc.Mapping):
        raise RolloutError(f"rollout_func must return a dict with {list(ROLLOUT_KEYS)}, got {type(output).__name__}")
    missing = [k for k in ROLLOUT_KEYS if k not in output]
    if missing:
        raise RolloutError(f"rollout_func must return keys {missing} in its output dict (it returned "
                           f"{sorted(map(str, output))})")
    checked = dict(output)
    for key in ("prompt_ids", "completion_ids"):
        checked[key] = [_token_ids(ids, key, i, vocab_size)
                        for i, ids in enumerate(_per_sample(output, key, num_samples))]
    lengths = [len(ids) for ids in checked["completion_ids"]]
    for i, (prompt, length) in enumerate(zip(checked["prompt_ids"], lengths, strict=True)):
        if max_completion_length is not None and length > max_completion_length:
            raise RolloutError(f"rollout_func: completion_ids[{i}] has {length} tokens, more than "
                               f"max_completion_length={max_completion_length}; cut completions there (a completion "
                               "cut by length ends without a stop token)")
        if context_window is not None and len(prompt) + length > context_window:
            raise RolloutError(f"rollout_func: prompt_ids[{i}] and completion_ids[{i}] have {len(prompt)} + {length} "
                               f"tokens, more than the model's context window of {context_window} positions")
    if output["logprobs"] is not None:
        checked["logprobs"] = [
            [math.nan if x is None else float(x)
             for x in _per_token(lp, "logprobs", i, lengths[i], _is_logprob,
                                 "a finite logprob <= 0 (a log-probability), or None")]
            for i, lp in enumerate(_per_sample(output, "logprobs", num_samples))]
    if "env_mask" in output:
        checked["env_mask"] = [
            [int(x) for x in _per_token(m, "env_mask", i, lengths[i], lambda x: x in (0, 1), "0 or 1")]
            for i, m in enumerate(_per_sample(output, "env_mask", num_samples))]
    if output.get("logprob_token_ids") is not None:
        checked["logprob_token_ids"] = [
            _per_token(ids, "logprob_token_ids", i, lengths[i], lambda x: True, "")
            for i, ids in enumerate(_per_sample(output, "logprob_token_ids", num_samples))]
    for key, value in output.items():
        if key not in (*ROLLOUT_KEYS, "env_mask", "logprob_token_ids") and isinstance(value, list):
            if len(value) != num_samples:
                raise RolloutError(f"rollout_func: the extra field {key!r} is a list of {len(value)} values but the "
                                   f"step has {num_samples} samples; give one per sample (or a single non-list value "
                                   "for all)")
    return checked
