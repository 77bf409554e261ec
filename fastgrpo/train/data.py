"""Prompts for training and evaluation: rows from files, `datasets` hub names or the built-in task, tokenized once.

dataset_name may be
    builtin                  the synthetic arithmetic task (fastgrpo.train.arithmetic)
    path/to/train.jsonl      one file (.jsonl, .json or .parquet); dataset_test_split is then a file path or None
    path/to/dir              split files <dir>/<split>.jsonl|.json|.parquet (e.g. train.jsonl, test.jsonl)
    org/name                 a hub dataset (needs network access), with dataset_config and the split names
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from fastgrpo.train.config import BUILTIN, TrainConfig

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
EVAL_SUBSET_SEED = 0  # the held-out subset is the same for every run, whatever the training seed


@dataclass(slots=True)
class Prompts:
    rows: list[dict]  # the dataset's columns per prompt; the answer column already cut at answer_delimiter
    token_ids: list[list[int]]  # the formatted, tokenized prompt
    texts: list[str]  # the prompt column, as reward functions see it


def _read_file(path: Path) -> list[dict]:
    import datasets

    if path.suffix not in FILE_FORMATS:
        raise ValueError(f"dataset file {path} must end in one of {sorted(FILE_FORMATS)}")
    return datasets.load_dataset(FILE_FORMATS[path.suffix], data_files=str(path), split="train").to_list()


def _split_file(directory: Path, split: str) -> Path:
    for suffix in FILE_FORMATS:
        if (directory / f"{split}{suffix}").is_file():
            return directory / f"{split}{suffix}"
    raise FileNotFoundError(f"dataset_name {directory} has no {split}.jsonl, {split}.json or {split}.parquet")


def load_rows(config: TrainConfig, split: str) -> list[dict] | None:
    """The rows of the train split (split="train") or of the held-out one (split="test"; None if there is none)."""
    name = config.dataset_name
    split_name = config.dataset_train_split if split == "train" else config.dataset_test_split
    if split_name is None:
        return None
    if name == BUILTIN:
        from fastgrpo.train import arithmetic

        return arithmetic.all_problems(split)
    path = Path(name)
    if path.is_dir():
        return _read_file(_split_file(path, split_name))
    if path.is_file():
        if split == "train":
            return _read_file(path)
        if not Path(split_name).is_file():
            raise FileNotFoundError(f"dataset_test_split: {split_name!r} is not a file; with a single-file dataset "
                                    "give the held-out file's path, or null to skip evaluation")
        return _read_file(Path(split_name))
    if path.suffix in FILE_FORMATS:
        raise FileNotFoundError(f"dataset_name: {name} does not exist")
    import datasets

    return datasets.load_dataset(name, config.dataset_config, split=split_name).to_list()


def prompt_token_ids(tokenizer, text: str, config: TrainConfig) -> list[int]:
    """The chat template's generation prompt when the tokenizer has one, else the text itself (system prompt
    first); the last max_prompt_length tokens of it."""
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        messages.append({"role": "user", "content": text})
        formatted = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(formatted, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(f"{config.system_prompt}\n\n{text}" if config.system_prompt else text).input_ids
    return ids[-config.max_prompt_length :] if config.max_prompt_length else ids


def prepare(rows: list[dict], tokenizer, config: TrainConfig, what: str) -> Prompts:
    if not rows:
        raise ValueError(f"the {what} split of {config.dataset_name} is empty")
    columns = set(rows[0])
    for column, option in ((config.prompt_column, "prompt_column"), (config.answer_column, "answer_column")):
        if column is not None and column not in columns:
            raise ValueError(f"{option}: column {column!r} is not in the {what} data of {config.dataset_name}; "
                             f"its columns are {sorted(columns)}")
    texts, token_ids, out = [], [], []
    for i, row in enumerate(rows):
        text = row[config.prompt_column]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{what} row {i}: prompt column {config.prompt_column!r} must be a non-empty string, "
                             f"got {text!r:.100}")
        row = dict(row)
        if config.answer_column is not None and config.answer_delimiter is not None:
            answer = str(row[config.answer_column])
            if config.answer_delimiter not in answer:
                raise ValueError(f"{what} row {i}: answer column {config.answer_column!r} has no "
                                 f"answer_delimiter {config.answer_delimiter!r}: {answer!r:.100}")
            row[config.answer_column] = answer.rsplit(config.answer_delimiter, 1)[1].strip()
        texts.append(text)
        token_ids.append(prompt_token_ids(tokenizer, text, config))
        out.append(row)
    return Prompts(out, token_ids, texts)


def eval_subset(prompts: Prompts, num: int) -> Prompts:
    """A fixed random subset of `num` held-out prompts (all of them if there are fewer)."""
    order = torch.randperm(len(prompts.rows), generator=torch.Generator().manual_seed(EVAL_SUBSET_SEED))[:num]
    pick = lambda values: [values[i] for i in order.tolist()]
    return Prompts(pick(prompts.rows), pick(prompts.token_ids), pick(prompts.texts))


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

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation()
