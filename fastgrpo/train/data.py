"""Prompts for training and evaluation: rows from files, `datasets` hub names or the built-in task, tokenized once.

dataset_name may be
    builtin                  the synthetic arithmetic task (fastgrpo.train.arithmetic)
    path/to/train.jsonl      one file (.jsonl, .json or .parquet); dataset_test_split is then a file path or None
    path/to/dir              split files <dir>/<split>.jsonl|.json|.parquet (e.g. train.jsonl, test.jsonl)
    org/name                 a hub dataset (needs network access), with dataset_config and the split names

A prompt is a non-empty string (formatted through the tokenizer's chat template as one user message when the
tokenizer has one) or, as in TRL's conversational datasets, a list of {"role", "content"} messages (through the chat
template, which such prompts need; a system message in the data wins over system_prompt). When the data has an answer
column (answer_column; TRL's `solution` stands in for the default `answer`), every row needs an answer: a null or
missing one is refused (naming the file, row and line), never scored against the string "None" or skipped. A
prompt that with max_completion_length does not fit the model's context window is refused too. A name that can only
be a path (starting with '.', '/' or '~') and does not exist is refused without asking the hub.
"""

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jinja2
import torch

from fastgrpo.train.config import BUILTIN, TrainConfig, is_local_path, read_utf8
from fastgrpo.train.loading import max_positions, not_loadable
from fastgrpo.train.rewards import is_conversational

FILE_FORMATS = (".jsonl", ".json", ".parquet")
# A row's prompt where an environment writes it (no dataset, or a row without a prompt): reset() appends its text.
ENVIRONMENT_PROMPT = ({"role": "user", "content": ""},)
EVAL_SUBSET_SEED = 0  # the held-out subset is the same for every run, whatever the training seed


@dataclass(slots=True)
class Prompts:
    rows: list[dict]  # the dataset's columns per prompt; the answer column already cut at answer_delimiter
    token_ids: list[list[int]]  # the formatted, tokenized prompt
    prompts: list[str | list[dict]]  # as reward functions see them: the text, or the messages the model was given
    answer_column: str | None  # the column the accuracy reward reads (None: the data has none)

    @property
    def conversational(self) -> bool:
        return is_conversational(self.prompts[0])


class Rows(list):
    """A split's rows (dicts) that remember where they came from, so that errors can name the file and line."""

    def __init__(self, rows: list[dict], source: str, lines: list[int] | None = None, start: int = 0):
        super().__init__(rows)
        self.source = source  # a file path, a hub dataset and split, or the built-in task
        self.lines = lines  # per row, its line in a JSON Lines file
        self.start = start  # rows of the split before these (a streamed split's later rows)

    def where(self, i: int) -> str:
        return f"{self.source}, row {self.start + i + 1}" + (f" (line {self.lines[i]})" if self.lines else "")


def _read_json(path: Path) -> Rows:
    """A .json array of objects, or JSON Lines (one object per line; .jsonl, or a .json that is not an array)."""
    text = read_utf8(path, "dataset file")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows, lines = json.loads(text), None
        except json.JSONDecodeError as e:
            raise ValueError(f"dataset file {path}, line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})"
                             ) from None
    else:
        rows, lines = [], []
        for number, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset file {path}, line {number}, column {e.colno}: not valid JSON ({e.msg}); "
                                 "JSON Lines hold one object per line") from None
            lines.append(number)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            where = f"line {lines[i]}" if lines else f"row {i + 1}"
            raise ValueError(f"dataset file {path}, {where}: a row must be a JSON object, got {type(row).__name__}")
    return Rows(rows, str(path), lines)


def _read_file(path: Path) -> Rows:
    if path.suffix not in FILE_FORMATS:
        raise ValueError(f"dataset file {path} must end in one of {list(FILE_FORMATS)}")
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        try:
            rows = Rows(pyarrow.parquet.read_table(path).to_pylist(), str(path))
        except pyarrow.ArrowException as e:
            raise ValueError(f"dataset file {path}: not a readable parquet file ({e})") from None
    else:
        rows = _read_json(path)
    if not rows:
        raise ValueError(f"dataset file {path} holds no rows")
    return rows


def _split_file(directory: Path, split: str) -> Path:
    for suffix in FILE_FORMATS:
        if (directory / f"{split}{suffix}").is_file():
            return directory / f"{split}{suffix}"
    raise FileNotFoundError(f"dataset_name {directory} has no {split}.jsonl, {split}.json or {split}.parquet")


def _read_hub(config: TrainConfig, split_name: str) -> Rows:
    import datasets

    name = config.dataset_name
    try:
        rows = datasets.load_dataset(name, config.dataset_config, split=split_name).to_list()
    except Exception as e:  # datasets raises a dozen types: no network, no such dataset, config or split
        raise not_loadable("dataset_name", name, e, datasets.config.HF_DATASETS_CACHE,
                           datasets.config.HF_HUB_OFFLINE) from e
    return Rows(rows, f"hub dataset {name} (config {config.dataset_config}, split {split_name})")


def load_rows(config: TrainConfig, split: str) -> Rows | None:
    """The rows of the train split (split="train") or of the held-out one (split="test"; None if there is none).
    Without dataset_name (an environment writes the prompts, TRL's rule) a round's worth of rows with an empty user
    message, cycled, and no held-out split."""
    name = config.dataset_name
    if name is None:
        if split != "train":
            return None
        rows = [{config.prompt_column: list(ENVIRONMENT_PROMPT)} for _ in range(config.prompts_per_step)]
        return Rows(rows, "the environment's prompts (no dataset_name)")
    split_name = config.dataset_train_split if split == "train" else config.dataset_test_split
    if split_name is None:
        return None
    if name == BUILTIN:
        from fastgrpo.train import arithmetic

        return Rows(arithmetic.all_problems(split), f"the built-in arithmetic task's {split} split")
    path = Path(name).expanduser()
    if path.is_dir():
        return _read_file(_split_file(path, split_name))
    if path.is_file():
        if split == "train":
            return _read_file(path)
        if not Path(split_name).is_file():
            raise FileNotFoundError(f"dataset_test_split: {split_name!r} is not a file; with a single-file dataset "
                                    "give the held-out file's path, or null to skip evaluation")
        return _read_file(Path(split_name))
    if path.suffix in FILE_FORMATS or is_local_path(name):
        raise FileNotFoundError(f"dataset_name: {name} does not exist (a local path, so the hub was not asked)")
    return _read_hub(config, split_name)


def stream_rows(config: TrainConfig, split: str):
    """dataset_streaming: the rows of a split as a `datasets` IterableDataset (hub datasets stream; local files and
    folders are read as they are reached), or None for a held-out split the config does not have."""
    import datasets

    name = config.dataset_name
    split_name = config.dataset_train_split if split == "train" else config.dataset_test_split
    if split_name is None:
        return None
    path = Path(name).expanduser()
    if path.is_file():  # one file: the train split; the held-out one is the file dataset_test_split names
        path = path if split == "train" else Path(split_name)
        source = dict(path="parquet" if path.suffix == ".parquet" else "json", data_files=str(path), split="train")
    elif path.is_dir():
        source = dict(path="parquet" if path.suffix == ".parquet" else "json",
                      data_files={split_name: str(_split_file(path, split_name))}, split=split_name)
    else:
        source = dict(path=name, name=config.dataset_config, split=split_name)
    try:
        return datasets.load_dataset(**source, streaming=True)
    except Exception as e:  # no network, no such dataset, config or split
        raise not_loadable("dataset_name", name, e, datasets.config.HF_DATASETS_CACHE,
                           datasets.config.HF_HUB_OFFLINE) from e


class StreamedPrompts(Prompts):
    """A streamed train split (dataset_streaming): rows read, checked and tokenized as the run reaches them, in the
    stream's order (a stream is not shuffled, as TRL leaves an IterableDataset), read again from its start at its
    end. `fill(n)` makes the first n available; indices count rows from the start of the run."""

    CHUNK = 256  # rows read and prepared at once

    def __init__(self, config: TrainConfig, tokenizer, tools: Callable[[dict], list] | None = None):
        super().__init__([], [], [], None)
        self.config, self.tokenizer, self.tools = config, tokenizer, tools
        self.stream = stream_rows(config, "train")
        self.source = f"the streamed train split of {config.dataset_name}"
        self._rows, self.epoch = iter(self.stream), 0
        self.fill(1)
        self.answer_column = answer_column(config, Rows(self.rows[:1], self.source))

    def fill(self, n: int) -> None:
        while len(self.rows) < n:
            chunk = []
            while len(chunk) < max(n - len(self.rows), self.CHUNK):
                row = next(self._rows, None)
                if row is None:  # the end of the stream: from its start again
                    if not self.rows and not chunk:
                        raise ValueError(f"dataset_name: {self.source} holds no rows")
                    self._rows, self.epoch = iter(self.stream), self.epoch + 1
                    break
                chunk.append(row)
            if chunk:
                answers = answer_column(self.config, Rows(chunk, self.source)) if not self.rows else self.answer_column
                more = prepare(Rows(chunk, self.source, start=len(self.rows)), self.tokenizer, self.config, "train",
                               answers, self.tools)
                self.rows += more.rows
                self.token_ids += more.token_ids
                self.prompts += more.prompts


class StreamOrder:
    """PromptOrder for a StreamedPrompts: the next prompts in the stream's order; resumable from the index."""

    def __init__(self, prompts: StreamedPrompts):
        self.prompts, self.index = prompts, 0

    @property
    def epoch(self) -> int:
        return self.prompts.epoch

    def next(self, k: int) -> list[int]:
        picked = self.peek(k)
        self.index += k
        return picked

    def peek(self, k: int) -> list[int]:
        self.prompts.fill(self.index + k)
        return list(range(self.index, self.index + k))

    def cursor(self) -> "StreamOrder":
        """A copy at the same position, which moves on its own (over the same prompts, read as it reaches them)."""
        copy = StreamOrder(self.prompts)
        copy.index = self.index
        return copy

    def epochs_done(self) -> float:
        return float(self.epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


def answer_column(config: TrainConfig, rows: Rows) -> str | None:
    """The column holding the reference answers: answer_column when the data has it; TRL's `solution` in place of the
    default `answer`; None (no accuracy reward, no evaluation) when the data has neither and nothing needs it."""
    columns = set(rows[0]) if rows else set()
    default = TrainConfig.__dataclass_fields__["answer_column"].default
    if config.answer_column is None or config.answer_column in columns:
        return config.answer_column
    if config.answer_column == default and "solution" in columns:
        return "solution"
    if config.answer_column == default and "accuracy" not in config.reward_funcs:
        return None
    raise ValueError(f"answer_column: column {config.answer_column!r} is not in the train data of {rows.source}; "
                     f"its columns are {sorted(columns)}"
                     + ("; the built-in accuracy reward reads the reference answers from it" if "accuracy" in
                        config.reward_funcs else ""))


def prompt_messages(prompt: str | list[dict], config: TrainConfig) -> list[dict]:
    """The messages a prompt is given to the chat template as: its own (with system_prompt first unless they start
    with a system message), or the text as one user message."""
    messages = [dict(m) for m in prompt] if is_conversational(prompt) else [{"role": "user", "content": prompt}]
    if config.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    return messages


def prompt_token_ids(tokenizer, prompt: str | list[dict], config: TrainConfig, tools: list | None = None
                     ) -> list[int]:
    """The chat template's generation prompt when the tokenizer has one (with the `tools` the model may call: the
    functions, or their JSON schemas), else the text itself (system prompt first); the last max_prompt_length tokens
    of it."""
    if tokenizer.chat_template:
        formatted = tokenizer.apply_chat_template(prompt_messages(prompt, config), add_generation_prompt=True,
                                                  tokenize=False, tools=tools or None,  # (Llama renders tools=[])
                                                  **(config.chat_template_kwargs or {}))
        ids = tokenizer(formatted, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(f"{config.system_prompt}\n\n{prompt}" if config.system_prompt else prompt).input_ids
    return ids[-config.max_prompt_length :] if config.max_prompt_length else ids


def _check_prompt(prompt, tokenizer, config: TrainConfig, where: str, first_kind: str) -> None:
    """A prompt is a non-empty string or a list of {'role': str, 'content': str} messages, of the kind of the split's
    first row (`first_kind`: "messages" or "text"): reward functions get one kind for the whole batch, as in TRL."""
    column = config.prompt_column
    if isinstance(prompt, list) and prompt:
        for k, message in enumerate(prompt):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"{where}: prompt column {column!r} holds a list, so each item must be a message "
                                 f"{{'role': str, 'content': str}} (TRL's conversational format); item {k} is "
                                 f"{message!r:.100}")
        if not tokenizer.chat_template:
            raise ValueError(f"{where}: prompt column {column!r} holds messages, which need a tokenizer with a chat "
                             f"template, and {config.model_name_or_path}'s tokenizer has none; give string prompts or "
                             "a model whose tokenizer has a chat template")
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: prompt column {column!r} must be a non-empty string or a list of "
                         f"{{'role', 'content'}} messages, got {prompt!r:.100}")
    kind = "messages" if isinstance(prompt, list) else "text"
    if kind != first_kind:
        raise ValueError(f"{where}: prompt column {column!r} holds {kind} here but {first_kind} in the split's first "
                         "row; give every row the same kind of prompt (all strings, or all lists of messages)")


def prepare(rows: Rows, tokenizer, config: TrainConfig, what: str, answers: str | None = "auto",
            tools: Callable[[dict], list] | None = None) -> Prompts:
    """Check and tokenize a split's rows, with `answers` the answer column ("auto": answer_column(config, rows)) and
    `tools(row)` the tools a row's prompt shows the model; every error names the row (file and line) and the option
    to change. With an environment_factory a row may lack the prompt (its environment writes it)."""
    if not rows:
        raise ValueError(f"the {what} split ({rows.source}) is empty")
    if answers == "auto":
        answers = answer_column(config, rows)
    columns = set(rows[0])
    environment = config.environment_factory is not None
    for column, option in ((config.prompt_column, "prompt_column"), (answers, "answer_column")):
        if column is not None and column not in columns and not (environment and option == "prompt_column"):
            raise ValueError(f"{option}: column {column!r} is not in the {what} data of {rows.source}; "
                             f"its columns are {sorted(columns)}")
    window = max_positions(config)
    if window is not None and config.max_completion_length >= window:
        raise ValueError(f"max_completion_length={config.max_completion_length} leaves no room for a prompt in the "
                         f"context window of {config.model_name_or_path} ({window} positions); lower it below {window}")
    prompts, token_ids, out = [], [], []
    first = rows[0].get(config.prompt_column, list(ENVIRONMENT_PROMPT) if environment else None)
    first_kind = "messages" if isinstance(first, list) else "text"
    for i, row in enumerate(rows):
        prompt = row.get(config.prompt_column)
        if environment and config.prompt_column not in row:  # (the row, reset's keywords, stays as it is)
            prompt = list(ENVIRONMENT_PROMPT)
        _check_prompt(prompt, tokenizer, config, rows.where(i), first_kind)
        row = dict(row)
        if answers is not None:
            row[answers] = _answer(row.get(answers), answers, config, rows.where(i))
        try:
            shown = None if tools is None else tools(row)
        except ValueError as e:  # an environment column naming no environment
            raise ValueError(f"{rows.where(i)}: {e}") from None
        try:
            ids = prompt_token_ids(tokenizer, prompt, config, shown)
            if tools is not None and config.max_prompt_length and len(ids) == config.max_prompt_length:
                whole = prompt_token_ids(tokenizer, prompt, dataclasses.replace(config, max_prompt_length=None),
                                         shown)
                if len(whole) > len(ids):  # cutting its start would cut the tools' descriptions out of the prompt
                    raise ValueError(f"{where_prompt(rows, i, config)}: the prompt, with its tools, has {len(whole)} "
                                     f"tokens, more than max_prompt_length={config.max_prompt_length}; with tools "
                                     "prompts are not cut (the tool schemas come first): raise max_prompt_length or "
                                     "set it to None (TRL does not cut prompts)")
        except (jinja2.TemplateError, TypeError, KeyError) as e:  # the template refused the messages (a role it lacks)
            message = " ".join(str(e).split())[:300]
            raise ValueError(f"{where_prompt(rows, i, config)}: the chat template of {config.model_name_or_path} "
                             f"cannot render this prompt ({type(e).__name__}: {message})") from None
        if window is not None and len(ids) + config.max_completion_length > window:
            raise ValueError(_too_long(len(ids), window, config, rows.where(i)))
        prompts.append(prompt_messages(prompt, config) if is_conversational(prompt) else prompt)
        token_ids.append(ids)
        out.append(row)
    keys = dict.fromkeys(k for row in out for k in row)  # every row every column, None where it has none (datasets')
    out = [row if len(row) == len(keys) else {k: row.get(k) for k in keys} for row in out]
    return Prompts(out, token_ids, prompts, answers)


def where_prompt(rows: Rows, i: int, config: TrainConfig) -> str:
    return f"{rows.where(i)}, prompt column {config.prompt_column!r}"


def _answer(answer, column: str, config: TrainConfig, where: str):
    """The answer column's value, cut at answer_delimiter; a null answer is refused rather than scored as 'None'."""
    if answer is None:
        raise ValueError(f"{where}: answer column {column!r} is null or missing; give the row an answer, "
                         "drop the row, or set answer_column to null if no reward function reads it")
    if config.answer_delimiter is None:
        return answer
    answer = str(answer)
    if config.answer_delimiter not in answer:
        raise ValueError(f"{where}: answer column {column!r} has no answer_delimiter "
                         f"{config.answer_delimiter!r}: {answer!r:.100}")
    return answer.rsplit(config.answer_delimiter, 1)[1].strip()


def _too_long(prompt_length: int, window: int, config: TrainConfig, where: str) -> str:
    room = window - config.max_completion_length
    return (f"{where}: the prompt has {prompt_length} tokens (max_prompt_length={config.max_prompt_length}), which "
            f"with max_completion_length={config.max_completion_length} exceed the model's context window of {window} "
            f"positions; lower max_prompt_length to {room} or less (prompts keep their last tokens) or "
            "max_completion_length")


def eval_subset(prompts: Prompts, num: int) -> Prompts:
    """A fixed random subset of `num` held-out prompts (all of them if there are fewer)."""
    order = torch.randperm(len(prompts.rows), generator=torch.Generator().manual_seed(EVAL_SUBSET_SEED))[:num]
    pick = lambda values: [values[i] for i in order.tolist()]
    return Prompts(pick(prompts.rows), pick(prompts.token_ids), pick(prompts.prompts), prompts.answer_column)


class PromptOrder:
    """Which prompts each step trains on: a fresh seeded permutation per epoch; resumable from (epoch, index)."""

    def __init__(self, num_prompts: int, seed: int):
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_prompts, generator=generator).tolist()

    def next(self, k: int) -> list[int]:
        picked = []
        while len(picked) < k:
            if self.index == self.num_prompts:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation()
            take = min(k - len(picked), self.num_prompts - self.index)
            picked += self._order[self.index : self.index + take]
            self.index += take
        return picked

    def epochs_done(self) -> float:
        """Epochs of the data trained on, a fraction for the one under way (TrainerState's epoch)."""
        return self.epoch + self.index / self.num_prompts

    def cursor(self) -> "PromptOrder":
        """A copy at the same position, which moves on its own."""
        copy = PromptOrder.__new__(PromptOrder)
        copy.num_prompts, copy.seed, copy.epoch, copy.index = self.num_prompts, self.seed, self.epoch, self.index
        copy._order = self._order  # (next() replaces it at an epoch's end, never changes it)
        return copy

    def peek(self, k: int) -> list[int]:
        """The next k prompts, not taken: next(m) then takes the first m of them."""
        state, order = self.state_dict(), self._order
        picked = self.next(k)
        self.epoch, self.index, self._order = state["epoch"], state["index"], order
        return picked

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation()
