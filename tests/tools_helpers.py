"""Helpers for tool-calling tests against TRL: a byte-level tokenizer with Qwen's special and tool tokens, and a short
Qwen2.5-style chat template (the tools listed by name only, to keep byte-level prompts short)."""

import tokenizers
from transformers import PreTrainedTokenizerFast

# Qwen2.5's tool format: each call <tool_call>\n{"name", "arguments"}\n</tool_call>; the results of consecutive tool
# messages in one user turn, each in <tool_response>. The system turn names the tools but leaves out their schemas:
# every byte is a token here, and a schema is ~200 bytes.
SHORT_TOOL_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nTools:' -}}"
    "{%- for tool in tools -%}{{- ' ' + (tool.function.name if tool.function is defined else tool.name) -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
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
