"""Helpers for tool-calling tests against TRL: a byte-level tokenizer with Qwen's special and tool tokens, Qwen2.5-style
chat templates (one with the tools' schemas, one listing the tools by name only, to keep byte-level prompts short),
TRL's own chat templates, and the tools and environments the tests call."""

import asyncio
from pathlib import Path

import tokenizers
import trl
from transformers import PreTrainedTokenizerFast

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"

# Qwen2.5's tool format: each call <tool_call>\n{"name", "arguments"}\n</tool_call>, the results of consecutive tool
# messages in one user turn, each in <tool_response>. The two templates differ in their system turn only.
_QWEN_MESSAGES = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant' + ('\\n' + message.content if message.content else '') -}}"
    "{%- for call in message.tool_calls -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + function.name + '\", \"arguments\": ' + (function.arguments | tojson)"
    " + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}{{- message.content -}}{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The tools' schemas in <tools>.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nYou may call these functions:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": <name>, \"arguments\": <arguments>}\\n</tool_call>"
    "<|im_end|>\\n' -}}"
    "{%- endif -%}"
) + _QWEN_MESSAGES

# The tools by name only: every byte is a token here, and a schema is ~200 bytes.
SHORT_TOOL_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nTools:' -}}"
    "{%- for tool in tools -%}{{- ' ' + (tool.function.name if tool.function is defined else tool.name) -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
) + _QWEN_MESSAGES


def byte_tokenizer(chat_template: str) -> PreTrainedTokenizerFast:
    """Every byte one token (byte-level BPE without merges), Qwen's special and tool tokens added; eos <|im_end|>."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    tokenizer.add_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"])
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = chat_template
    return tokenizer


def trl_template(name: str) -> str:
    return (TRL_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


# -- tools -------------------------------------------------------------------------------------------------------


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def echo(text: str) -> str:
    """Returns the text.

    Args:
        text: what to return
    """
    return text


def boom() -> str:
    """Always fails."""
    raise ValueError("kaboom")


def blocks() -> list:
    """Returns content blocks."""
    return [{"type": "text", "text": "a block"}]


def record() -> dict:
    """Returns a dict."""
    return {"x": 1}


async def amul(a: int, b: int) -> int:
    """Multiplies, asynchronously.

    Args:
        a: the first number
        b: the second number
    """
    await asyncio.sleep(0.01)
    return a * b


async def afail() -> str:
    """Fails, asynchronously."""
    await asyncio.sleep(0)
    raise RuntimeError("async kaboom")


# -- environments ---------------------------------------------------------------------------------------------------


class Counter:
    """A counter per rollout: the task asks for a target; the model moves and reads it."""

    def __init__(self):
        self.value, self.target = 0, None

    def reset(self, target: int, **row) -> str:
        self.value, self.target = 0, target
        return f" Reach {target}."

    def increment(self, by: int) -> str:
        """Adds to the counter.

        Args:
            by: how much to add
        """
        self.value += by
        return f"counter: {self.value}"

    async def read(self) -> int:
        """The counter's value."""
        await asyncio.sleep(0)
        return self.value

    def get_reward(self) -> float:
        return float(self.value == self.target)

    def _helper(self):  # private: not a tool
        return None

    @property
    def done(self) -> bool:  # a property: not read, not a tool
        raise AssertionError("properties must not be evaluated")


class Quiet:
    """An environment with no reward of its own whose reset returns nothing."""

    def reset(self, **row) -> None:
        return None

    def shout(self, text: str) -> str:
        """Upper-cases.

        Args:
            text: what to shout
        """
        return text.upper()
