"""Reward functions: the built-ins, user functions by import path, and their weighted sum.

Every reward function has TRL's signature `f(prompts, completions, **columns) -> list[float]`: `prompts` and
`completions` are lists of strings, `columns` holds the dataset's columns for the same samples (one list each) and
`completion_ids` (the completions' token ids). Built-ins:

    accuracy   1 if the completion's final answer equals the `answer` column: plain numbers are compared exactly
               (fast path), anything else through math-verify
    format     1 if the completion gives its answer in <answer>...</answer> or \\boxed{...}
    length     DAPO's soft overlong penalty: 0 up to max_completion_length - L/4, then linearly down to -1 at L
"""

import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import torch

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*|\d*)(?:\.\d+)?")


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


def accuracy(prompts, completions, answer, **columns) -> list[float]:
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
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
    return [float(bool(_ANSWER_TAG.search(c)) or _last_boxed(c) is not None) for c in completions]


def length_penalty(max_completion_length: int) -> Callable:
    buffer = max(max_completion_length // 4, 1)
    free = max_completion_length - buffer

    def length(prompts, completions, completion_ids, **columns) -> list[float]:
        return [max(min((free - len(ids)) / buffer, 0.0), -1.0) for ids in completion_ids]

    return length


# -- loading and combining ------------------------------------------------------------------------------------------


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
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules.setdefault(path.stem, module)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"reward function {spec!r}: cannot import {module_name!r}: {e}") from e
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"reward function {spec!r}: {module_name!r} has no callable {attr!r}")
    return function


def _as_float(value) -> float:
    """A reward as a Python float: ints, floats, numpy scalars and 0-dim tensors; NaN, which is refused, for anything
    else (bools included)."""
    if isinstance(value, torch.Tensor):
        numeric = value.ndim == 0 and value.dtype != torch.bool and not value.is_complex()
        return float(value.item()) if numeric else math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf


class Rewards:
    """The configured reward functions and weights: `rewards(prompts, completions, completion_ids, columns)` ->
    (per_function [N, F], total [N] = per_function @ weights), fp32."""

    def __init__(self, names: list[str], weights: list[float] | None, max_completion_length: int):
        builtins = {"accuracy": accuracy, "format": format, "length": length_penalty(max_completion_length)}
        self.names = list(names)
        self.functions = [builtins[n] if n in builtins else load_function(n) for n in names]
        self.weights = torch.tensor(weights if weights is not None else [1.0] * len(names), dtype=torch.float32)

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
        per_function = torch.stack(
            [self._score(name, f, prompts, completions, completion_ids, columns)
             for name, f in zip(self.names, self.functions, strict=True)], dim=1)  # [N, F]
        total = per_function @ self.weights  # [N]
        bad = (~total.isfinite()).nonzero()
        if len(bad):
            i = bad[0].item()
            rewards = dict(zip(self.names, per_function[i].tolist(), strict=True))
            raise RewardError(f"the weighted sum of the rewards is not finite in float32 for sample {i} (prompt "
                              f"{prompts[i]!r}, completion {completions[i]!r}): rewards {rewards} with reward_weights "
                              f"{self.weights.tolist()}")
        return per_function, total

    def _score(self, name, function, prompts, completions, completion_ids, columns) -> torch.Tensor:
        def call(index):
            return function([prompts[i] for i in index], [completions[i] for i in index],
                            completion_ids=[completion_ids[i] for i in index],
                            **{k: [v[i] for i in index] for k, v in columns.items()})

        everything = range(len(completions))
        try:
            values = call(everything)
        except Exception as e:
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}; "
                              f"{self._culprit(call, prompts, completions)}") from e
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            raise RewardError(f"reward function {name!r} must return a list of {len(completions)} numbers (one per "
                              f"completion), got {values!r:.200}")
        scores = torch.tensor([_as_float(v) for v in values], dtype=torch.float32)  # [N]
        bad = (~scores.isfinite()).nonzero()
        if len(bad):
            i = bad[0].item()
            raise RewardError(f"reward function {name!r} returned {values[i]!r} for sample {i} (prompt {prompts[i]!r}, "
                              f"completion {completions[i]!r}); rewards must be numbers finite in float32 "
                              f"(|x| <= {torch.finfo(torch.float32).max:.3g})")
        return scores

    @staticmethod
    def _culprit(call, prompts, completions) -> str:
        """Which sample makes the function raise, found by calling it on each sample alone."""
        for i in range(len(completions)):
            try:
                call([i])
            except Exception:
                return f"first failing sample {i}: prompt {prompts[i]!r}, completion {completions[i]!r}"
        return "it raised on the batch but on no sample alone"
