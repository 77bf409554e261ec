"""Reward functions: the built-ins, user functions by import path, reward models, and their weighted sum.

Every reward function is called as TRL 1.16's GRPOTrainer calls it, by keyword:
`f(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=..., log_metric=..., **columns)`
-> one number (or None) per completion. For a standard dataset `prompts` and `completions` are strings; for a
conversational one (the prompt is a list of {"role", "content"} messages) `prompts` are the message lists the model
was prompted with and each completion is `[{"role": "assistant", "content": text}]`. `columns` holds the dataset's
other columns for the same samples (one list each), `completion_ids` the completions' token ids, `trainer_state` a
transformers `TrainerState` (global_step, max_steps, epoch), `log_metric(name, value)` adds a scalar to the step's
metrics and `log_extra(column, values)` a column to completions.jsonl (with log_completions).

A function may return None for a sample it does not apply to (TRL's convention): it counts as NaN, the weighted
rewards are summed over the functions that did apply (nansum), and a sample where none did is unscorable: its reward
is NaN, it is left out of its group's mean and std, and its advantage is 0 (with a warning). Any other value that is
not a number finite in float32 is refused, naming the function and the sample.

A name in reward_funcs that is neither a built-in nor `module:function` is a reward model (a hub id or path of a
sequence-classification model, as TRL): it scores the prompt + completion text (through its tokenizer's chat template
for conversational data) with the logit of class 0, on the training device, without gradient.

Built-ins:

    accuracy   1 if the completion's final answer equals the answer column (answer_column; TRL's `solution` when
               the data has no `answer`): plain numbers are compared exactly (fast path), anything else through
               math-verify
    format     1 if the completion gives its answer in <answer>...</answer> or \\boxed{...}
    length     DAPO's soft overlong penalty: 0 up to max_completion_length - L/4, then linearly down to -1 at L
"""

import asyncio
import collections.abc
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import warnings
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from fastgrpo.train.config import REWARD_FUNCS, is_local_path

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*|\d*)(?:\.\d+)?")


FLOAT32_MAX = torch.finfo(torch.float32).max


class RewardError(RuntimeError):
    """A reward function raised, or returned something other than one number per completion that is finite in float32
    (the dtype advantages are computed in: 1e39 is finite in float64 and inf in float32)."""


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces matched."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: <answer> tag, else last \\boxed{}, else after the last '####', else the
    last number in the text."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def plain_number(text: str | None) -> Fraction | None:
    """'1,234' / '-3.50' / '$72' / '72.' as an exact number; None if the text is anything else."""
    if text is None:
        return None
    s = text.strip().strip("$").strip().rstrip(".").replace(" ", "")
    if not s or not _PLAIN_NUMBER.fullmatch(s) or not any(c.isdigit() for c in s):
        return None
    return Fraction(s.replace(",", ""))


def _math_verify(answer: str, completion: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ImportError("the accuracy reward needs math-verify for answers that are not plain numbers: "
                          "pip install math-verify") from e
    as_math = lambda text: text if "$" in text else f"${text}$"  # math-verify reads LaTeX inside $...$
    gold = parse(as_math(answer))
    predicted = extract_answer(completion)
    return bool(gold) and bool(verify(gold, parse(completion if predicted is None else as_math(predicted))))


def completion_text(completion) -> str:
    """A completion's text: the string itself, or the content of a conversational completion's last assistant
    message (with tools, the turn after the last tool result; a tool's own result is never read as the answer)."""
    if isinstance(completion, str):
        return completion
    said = [m for m in completion if m.get("role") == "assistant"]
    content = said[-1]["content"] if said else ""
    return content if isinstance(content, str) else ""


def accuracy(prompts, completions, answer, **columns) -> list[float]:
    rewards = []
    for completion, gold in zip(map(completion_text, completions), answer, strict=True):
        gold = str(gold)
        gold_number, predicted = plain_number(gold), extract_answer(completion)
        predicted_number = plain_number(predicted)
        if gold_number is not None and predicted_number is not None:
            rewards.append(float(gold_number == predicted_number))
        elif gold_number is not None and predicted is None:
            rewards.append(0.0)  # no number anywhere in the completion
        else:
            rewards.append(float(_math_verify(gold, completion)))
    return rewards


def format(prompts, completions, **columns) -> list[float]:  # noqa: A001 - the reward's public name
    return [float(bool(_ANSWER_TAG.search(c)) or _last_boxed(c) is not None) for c in map(completion_text, completions)]


def _column_accuracy(answer_column: str | None) -> Callable:
    """The built-in accuracy reward reading its reference answers from `answer_column`."""

    def accuracy_reward(prompts, completions, **columns) -> list[float]:
        return accuracy(prompts, completions, columns[answer_column])

    accuracy_reward.__name__ = "accuracy"
    return accuracy_reward


def length_penalty(max_completion_length: int) -> Callable:
    buffer = max(max_completion_length // 4, 1)
    free = max_completion_length - buffer

    def length(prompts, completions, completion_ids, **columns) -> list[float]:
        return [max(min((free - len(ids)) / buffer, 0.0), -1.0) for ids in completion_ids]

    return length


# -- loading and combining ------------------------------------------------------------------------------------------


_FILE_MODULES = {}  # reward files loaded by path: (resolved path, mtime) -> module


def load_function(spec: str) -> Callable:
    """'package.module:function' or 'path/to/file.py:function'."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {spec!r} must be written 'module:function' or 'file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist")
            key = (path.resolve(), path.stat().st_mtime_ns)  # one module per file (as an import), until it changes
            module = _FILE_MODULES.get(key)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(path.stem, path)
                module = importlib.util.module_from_spec(module_spec)
                sys.modules.setdefault(path.stem, module)
                module_spec.loader.exec_module(module)
                _FILE_MODULES[key] = module
        else:
            module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"reward function {spec!r}: cannot import {module_name!r}: {e}") from e
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"reward function {spec!r}: {module_name!r} has no callable {attr!r}")
    return function


UNSET = object()  # a reward function's value that is not a number (refused)


def _as_float(value) -> float:
    """A reward as a Python float: ints, floats, numpy scalars and 0-dim tensors; None (TRL's "does not apply") as
    NaN; UNSET for anything else (bools included), which is refused."""
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor):
        numeric = value.ndim == 0 and value.dtype != torch.bool and not value.is_complex()
        return float(value.item()) if numeric else UNSET
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return UNSET
    try:
        return float(value)
    except OverflowError:
        return math.inf


def is_conversational(prompt) -> bool:
    """TRL's test: a prompt that is a list of messages (dicts with a "role")."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


class RewardModel:
    """A sequence-classification model as a reward function (TRL's semantics): the prompt + completion text, through
    the tokenizer's chat template for conversational data, right-padded, no special tokens added; the reward is the
    logit of class 0. Frozen, in inference mode, on `device`."""

    def __init__(self, name: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False,
                 chat_template_kwargs: dict | None = None):
        from transformers import AutoModelForSequenceClassification

        from fastgrpo.train.loading import not_loadable, tokenizer_from

        if is_local_path(name) and not Path(name).expanduser().exists():
            raise ValueError(f"reward_funcs: {name} does not exist (a local path, so the hub was not asked); a "
                             f"reward function is a built-in {REWARD_FUNCS}, 'module:function', 'file.py:function' or "
                             "a reward model's hub id or path")
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                name, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code)
            self.tokenizer = tokenizer_from(name, trust_remote_code)
        except Exception as e:  # no such model, no network, not a sequence classifier, ...
            import huggingface_hub.constants as hub

            error = not_loadable("reward_funcs", name, e, hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE)
            raise FileNotFoundError(f"{error} (a name that is not a built-in {REWARD_FUNCS} nor 'module:function' is "
                                    "a reward model)") from e
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The score is read at the last token that is not padding, which the model finds through pad_token_id.
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.model.requires_grad_(False).eval().to(device)
        self.device, self.chat_template_kwargs = device, chat_template_kwargs or {}
        self.__name__ = name.rstrip("/").split("/")[-1]

    def __call__(self, prompts, completions, **columns) -> list[float]:
        if is_conversational(prompts[0]):
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False, **self.chat_template_kwargs)
                     for p, c in zip(prompts, completions, strict=True)]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(self.device)
        with torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().tolist()


class Rewards:
    """The configured reward functions and weights: `rewards(prompts, completions, completion_ids, columns, state)` ->
    (per_function [N, F] fp32, NaN where a function returned None; total [N] = nansum(per_function * weights), NaN
    where every function returned None). What the functions logged through log_metric / log_extra during the call is
    in `self.logged_metrics` ({name: [values]}) and `self.logged_columns` ({column: [one value per sample]})."""

    def __init__(self, names: list[str], weights: list[float] | None, max_completion_length: int,
                 answer_column: str | None = "answer", device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                 chat_template_kwargs: dict | None = None, extra_functions: list[Callable] = ()):
        """`extra_functions`: more reward functions, weight 1 each, named by their __name__ (an environment's
        get_reward, as TRL adds it)."""
        builtins = {"accuracy": _column_accuracy(answer_column), "format": format,
                    "length": length_penalty(max_completion_length)}
        if "accuracy" in names and answer_column is None:
            raise ValueError("reward_funcs: the built-in accuracy reward needs answer_column (the column holding the "
                             "reference answers; TRL datasets call it 'solution')")
        self.names = list(names)
        self.functions = [builtins[n] if n in builtins else load_function(n) if ":" in n
                          else RewardModel(n, torch.device(device), dtype, trust_remote_code, chat_template_kwargs)
                          for n in names]
        self.user_functions = any(n not in builtins for n in names) or bool(extra_functions)
        weights = list(weights) if weights is not None else [1.0] * len(names)
        self.names += [f.__name__ for f in extra_functions]
        self.functions += list(extra_functions)
        self.weights = torch.tensor(weights + [1.0] * len(extra_functions), dtype=torch.float32)
        # TRL's metric names: a function's __name__, a reward model's last path part
        self.metric_names = [getattr(f, "__name__", n) for f, n in zip(self.functions, self.names, strict=True)]
        self.logged_metrics, self.logged_columns = {}, {}
        self._batch_size = 0  # completions in the function call under way (log_extra's length)

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
                 state=None) -> tuple[torch.Tensor, torch.Tensor]:
        self.logged_metrics, self.logged_columns = {}, {}
        context = dict(trainer_state=state, log_extra=self._log_extra, log_metric=self._log_metric)
        per_function = torch.stack(
            [self._score(name, f, prompts, completions, completion_ids, columns, context)
             for name, f in zip(self.names, self.functions, strict=True)], dim=1)  # [N, F]
        total = (per_function * self.weights).nansum(dim=1)  # [N]
        unscorable = per_function.isnan().all(dim=1)  # [N]
        bad = (~total.isfinite() & ~unscorable).nonzero()
        if len(bad):
            i = bad[0].item()
            rewards = dict(zip(self.names, per_function[i].tolist(), strict=True))
            raise RewardError(f"the weighted sum of the rewards is not finite in float32 for sample {i} (prompt "
                              f"{prompts[i]!r}, completion {completions[i]!r}): rewards {rewards} with reward_weights "
                              f"{self.weights.tolist()}")
        if unscorable.any():
            i = unscorable.nonzero()[0].item()
            warnings.warn(f"every reward function returned None for {int(unscorable.sum())} of {len(completions)} "
                          f"samples (the first: sample {i}, prompt {prompts[i]!r:.200}, completion "
                          f"{completions[i]!r:.200}); they get advantage 0. Make at least one function score every "
                          "sample", stacklevel=2)
        return per_function, total.masked_fill(unscorable, math.nan)

    def _log_metric(self, name: str, value: float) -> None:
        self.logged_metrics.setdefault(name, []).append(float(value))

    def _log_extra(self, column: str, values: list) -> None:
        values = list(values)
        if len(values) != self._batch_size:
            raise RewardError(f"log_extra({column!r}, ...) was given {len(values)} values; it takes one per completion "
                              f"of the call ({self._batch_size})")
        self.logged_columns[column] = values

    def _score(self, name, function, prompts, completions, completion_ids, columns, context) -> torch.Tensor:
        def call(index):
            self._batch_size = len(index)
            values = function(prompts=[prompts[i] for i in index], completions=[completions[i] for i in index],
                              completion_ids=[completion_ids[i] for i in index],
                              **{k: [v[i] for i in index] for k, v in columns.items()}, **context)
            return asyncio.run(values) if inspect.isawaitable(values) else values  # an async function (TRL's too)

        everything = range(len(completions))
        try:
            values = call(everything)
        except RewardError as e:  # a misuse of log_extra
            raise RewardError(f"reward function {name!r}: {e}") from None
        except Exception as e:
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}; "
                              f"{self._culprit(call, prompts, completions)}") from e
        if isinstance(values, (torch.Tensor, np.ndarray)) and values.ndim == 1:
            values = list(values)  # one 0-dim tensor or numpy scalar per completion
        if not isinstance(values, collections.abc.Sequence) or isinstance(values, (str, bytes)) or (
                len(values) != len(completions)):
            got = f"{len(values)} values" if isinstance(values, collections.abc.Sized) else type(values).__name__
            raise RewardError(f"reward function {name!r} must return a sequence of {len(completions)} numbers (one "
                              f"per completion), got {got}: {values!r:.200}")
        floats = [_as_float(v) for v in values]
        for i, (value, x) in enumerate(zip(values, floats, strict=True)):
            if value is not None and (x is UNSET or not math.isfinite(x) or abs(x) > FLOAT32_MAX):
                raise RewardError(f"reward function {name!r} returned {value!r} for sample {i} (prompt {prompts[i]!r}, "
                                  f"completion {completions[i]!r}); rewards must be numbers finite in float32 "
                                  f"(|x| <= {FLOAT32_MAX:.3g}), or None where the function does not apply")
        return torch.tensor(floats, dtype=torch.float32)  # [N]

    @staticmethod
    def _culprit(call, prompts, completions) -> str:
        """Which sample makes the function raise, found by calling it on each sample alone."""
        for i in range(len(completions)):
            try:
                call([i])
            except Exception:
                return f"first failing sample {i}: prompt {prompts[i]!r}, completion {completions[i]!r}"
        return "it raised on the batch but on no sample alone"
