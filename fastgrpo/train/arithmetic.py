"""The built-in task: adding two integers in [0, 99], written as characters.

    {"prompt": "47+85=", "answer": "132"}      the model completes "132" and then <eos>

Addition only: 300 GRPO steps take the default model from 28% to 69-70% greedy accuracy on 200 test problems
(3 seeds; 65-66% on all 2,005); with subtraction mixed in (negative answers) the same recipe went from 34% to 59-64%,
too close to the 60% the default run has to show.

Every unordered operand pair belongs to one split, fixed by a CRC32 of its text: "47+85=" and "85+47=" are on the
same side, so no test problem is a train problem with its operands swapped. The split depends neither on the seed
nor on how many problems are drawn.
"""

import re
import zlib
from functools import lru_cache
from random import Random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PROMPT_COLUMN = "prompt"
ANSWER_COLUMN = "answer"

OPERAND_MAX = 99  # operands in [0, OPERAND_MAX]: 10,000 problems, answers of 1 to 3 digits
TEST_PERCENT = 20  # share of operand pairs held out for evaluation

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARACTERS = "0123456789+-="  # "-" only so that negative numbers in completions encode

_NUMBER = re.compile(r"-?\d+")


def _in_test_split(a: int, b: int) -> bool:
    return zlib.crc32(f"{min(a, b)}+{max(a, b)}".encode()) % 100 < TEST_PERCENT


@lru_cache(maxsize=2)
def _all_problems(split: str) -> tuple[tuple[str, str], ...]:
    """Every (prompt, answer) of a split, in a fixed order."""
    numbers = range(OPERAND_MAX + 1)
    test = split == "test"
    return tuple((f"{a}+{b}=", str(a + b)) for a in numbers for b in numbers if _in_test_split(a, b) == test)


def all_problems(split: str) -> list[dict]:
    """Every problem of `split` ("train" or "test") in a fixed order."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return [{PROMPT_COLUMN: prompt, ANSWER_COLUMN: answer} for prompt, answer in _all_problems(split)]


def problems(split: str, num: int, seed: int = 0) -> list[dict]:
    """`num` problems of `split` ("train" or "test"), the same list for the same arguments.

    Drawn without repeats in seeded random order; past the split's size (7,995 train problems) the order
    reshuffles and starts again, so a long run sees every train problem once per pass.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise ValueError(f"num must be an int >= 0, got {num!r}")
    pool = list(_all_problems(split))
    rng = Random(f"{split}:{seed}")
    rows = []
    while len(rows) < num:
        rng.shuffle(pool)
        rows += pool[: num - len(rows)]
    return [{PROMPT_COLUMN: prompt, ANSWER_COLUMN: answer} for prompt, answer in rows]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of CHARACTERS, plus <pad> (id 0), <eos> (id 1), <unk> (id 2); nothing is added
    around the text, so a prompt's ids are exactly its characters' ids."""
    vocab = {token: i for i, token in enumerate([PAD, EOS, UNK, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join characters back without the spaces WordLevel would put between them
    backend.add_special_tokens([PAD, EOS, UNK])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",  # generation appends on the right
        clean_up_tokenization_spaces=False,
        model_max_length=32,  # the model's max_position_embeddings
    )


def correct(completion: str, answer: str) -> bool:
    """Whether the completion's first integer (optional minus sign, digits) is the answer."""
    match = _NUMBER.search(completion)
    return match is not None and match.group() == answer


def accuracy_reward(prompts: list, completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 per completion whose first integer is its answer, else 0.0 (TRL's reward-function signature)."""
    return [float(correct(completion, target)) for completion, target in zip(completions, answer, strict=True)]
