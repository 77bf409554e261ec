"""Build the calculator recipe's tiny tool-calling model and its data (recipes/calculator-agent.yaml).

    python recipes/calculator/build_model.py [--output-dir DIR] [--steps N] [--seed S]   # data/ and model/
    python recipes/calculator/build_model.py --check [--output-dir DIR]   # its rollouts, sampled as the trainer does

The task: the sum of two 5-digit numbers, {"prompt": "40379+72689=", "answer": "113068"}, with the `add` tool of
recipes/calculator/tools.py. A right rollout calls the tool, then copies its result:

    <tool_call>\\n{"name": "add", "arguments": {"a": 40379, "b": 72689}}\\n</tool_call><|im_end|>    18 tokens
    \\n<|im_start|>user\\n<tool_response>\\n113068\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
                                      the tool turn, which the trainer appends (19 tokens, out of the loss)
    113068<|im_end|>                                                                                 7 tokens

or answers directly, "113068<|im_end|>", which this model never gets right: a sum written from its most significant
digit needs the carries of all the digits below. With 4-digit operands, a warm-up like this one (at a constant
learning rate) learned to add directly between 400 and 600 steps (right direct answers: 2% -> 80%, greedy), which
would leave GRPO little to teach.

The tokenizer is character-level (printable ASCII and "\\n", one token each) plus whole tokens for the chat's
markers (<|im_start|>, <|im_end|> the EOS, <|endoftext|> the padding), the tool tags, the role names, and the JSON
around a call's two numbers, so a prompt is 28 tokens and a tool-calling completion 42 or 44. Its chat template
writes Qwen2.5's tool format (`<tool_call>` JSON, results in `<tool_response>` in a user turn), which fastgrpo's
ToolChat recognises, and lists the tools by name only (a JSON schema would cost ~200 character tokens).

The model, a 2-layer Llama (0.54M parameters, 2.2 MB of fp32), is warmed up with cross-entropy on the assistant
turns (not the tool turn) of a mix of conversations: CALL_EXAMPLES of them call the tool and copy its result, the
others answer directly. The first completion token is the choice between the two, and it is labelled so that
TOOL_SHARE of the labelled choices are calls: the copying gets the practice of 60% of the examples while the model
learns to call only 30% of the time. DEFAULT_STEPS steps, the learning rate decaying linearly to 0, take 4 min of
CPU time (7.5 min on a 2-core CPU shared with other jobs). `--check` (the first 200 held-out prompts) measures the
model this builds: greedily it calls the tool for 3.0% of the prompts and is right for 3.0%; at temperature 1 it
calls in 26.0% of its samples, is right in 93.5% of those (the arguments are the operands in 96.6%) and in 0.0% of
the others, and 89.0% of the groups of 8 hold a right and a wrong rollout. GRPO then only has to move the first
token's probability towards <tool_call>. 600 steps left the copying less sure (86% of the calls right at
temperature 1).

Llama rather than Qwen2: transformers 5 loads any qwen2 checkpoint's tokenizer as Qwen2Tokenizer, whatever
tokenizer_config.json says (fastgrpo/train/build_default_model.py). Same arguments, same torch build: same data and
weights (seeded operand draws, init and data order, 2 CPU threads).
"""

import argparse
import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from random import Random

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fastgrpo.sampling import Engine, SamplingParams, Turn
from fastgrpo.train.loading import tokenizer_from
from fastgrpo.train.rewards import accuracy
from fastgrpo.train.tools import ToolChat, ToolRunner, load_tools, tool_calls, tool_schema, toolbox

HERE = Path(__file__).parent
DEFAULT_OUTPUT_DIR = HERE / "model"
DATA_DIR = HERE / "data"
TOOL_SPEC = f"{HERE / 'tools.py'}:add"

# -- the task ----------------------------------------------------------------------------------------------------------

OPERAND_MIN, OPERAND_MAX = 10_000, 99_999  # 5-digit operands: sums of 5 or 6 digits
TEST_PERCENT = 20  # share of unordered operand pairs held out
NUM_TRAIN_ROWS = 4000  # data/train.jsonl: enough for 100 rounds of 32 prompts without a repeat
NUM_TEST_ROWS = 500  # data/test.jsonl


def in_test_split(a: int, b: int) -> bool:
    """Whether the unordered pair {a, b} is held out: a CRC32 of its text, as fastgrpo/train/arithmetic.py splits,
    so "40379+72689=" and "72689+40379=" are on the same side whatever the seed."""
    return zlib.crc32(f"{min(a, b)}+{max(a, b)}".encode()) % 100 < TEST_PERCENT


def draw_pairs(split: str, rng: Random):
    """Endless operand pairs (a, b) of `split`, drawn uniformly from it."""
    test = split == "test"
    while True:
        a, b = rng.randint(OPERAND_MIN, OPERAND_MAX), rng.randint(OPERAND_MIN, OPERAND_MAX)
        if in_test_split(a, b) == test:
            yield a, b


def row(a: int, b: int) -> dict:
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def problems(split: str, num: int, seed: int) -> list[dict]:
    """`num` distinct problems of `split` ("train" or "test"), the same list for the same arguments."""
    rows, seen = [], set()
    for a, b in draw_pairs(split, Random(f"{split}:{seed}")):
        if len(rows) == num:
            return rows
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append(row(a, b))


def write_data(data_dir: Path, seed: int) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, num in (("train", NUM_TRAIN_ROWS), ("test", NUM_TEST_ROWS)):
        lines = (json.dumps(r) + "\n" for r in problems(split, num, seed))
        (data_dir / f"{split}.jsonl").write_text("".join(lines), encoding="utf-8")


# -- tokenizer and chat template ---------------------------------------------------------------------------------------

PAD, EOS, START, UNK = "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"
# Whole tokens: the tool tags, the role names and the JSON of an `add` call around its two numbers.
WORDS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "system", "user", "assistant",
         '{"name": "add", "arguments": {"a": ', ', "b": ', "}}")  # fmt: skip
CHARACTERS = "\n" + "".join(map(chr, range(32, 127)))  # "\n" and printable ASCII: any text the template writes

# Qwen2.5's tool format (fastgrpo.train.tools.QWEN_JSON_TOOL_CALLS parses it), with the tools listed by name only.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set function = tool.function if tool.function is defined else tool -%}"
    "{{- ('\\n' if not loop.first else '') + function.name -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant' + ('\\n' + message.content if message.content else '') -}}"
    "{%- for call in message.tool_calls -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{%- set arguments = function.arguments if function.arguments is string else function.arguments | tojson -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + function.name + '\", \"arguments\": ' + arguments + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

MAX_POSITIONS = 128  # a prompt (28 tokens) and the longest completion the recipe allows (48), with room to spare


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Special tokens first (<|endoftext|> id 0, <|im_end|> 1, <|im_start|> 2, <unk> 3), then WORDS, then one token per
    character; decoding joins the tokens' text back exactly (tool calls are parsed from decoded text)."""
    vocab = {token: i for i, token in enumerate([PAD, EOS, START, UNK, *WORDS, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "." would skip "\n"
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([PAD, EOS, START, UNK])
    backend.add_tokens([AddedToken(word, normalized=False) for word in WORDS])  # matched before the characters
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# -- the conversations -------------------------------------------------------------------------------------------------


def schemas() -> list[dict]:
    return [tool_schema(tool, "tools", TOOL_SPEC) for tool in load_tools([TOOL_SPEC])]


def user(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def render(tokenizer, messages: list[dict], tools: list[dict], generation_prompt: bool = False) -> list[int]:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                         tokenize=True, return_dict=False)


def prompt_ids(tokenizer, prompt: str, tools: list[dict]) -> list[int]:
    """The tokens the trainer samples from: the tools, the user turn, the assistant header."""
    return render(tokenizer, user(prompt), tools, generation_prompt=True)


def example(tokenizer, a: int, b: int, calls_tool: bool, tools: list[dict], label_first: bool = True
            ) -> tuple[list[int], list[int]]:
    """(ids, labels) of one warm-up conversation as the trainer builds a rollout: the prompt, the assistant turns
    (labelled, each up to its <|im_end|>) and, with a tool call, the tool turn between them (label -100, as the GRPO
    loss leaves it out). `label_first=False` leaves the completion's first token, the choice between calling and
    answering, unlabelled."""
    answer = {"role": "assistant", "content": str(a + b)}
    if not calls_tool:
        messages, tool_end = [*user(f"{a}+{b}="), answer], None
    else:
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        exchange = [*user(f"{a}+{b}="), {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "add", "content": str(a + b)}]
        messages, tool_end = [*exchange, answer], len(render(tokenizer, exchange, tools, generation_prompt=True))
    ids = render(tokenizer, messages, tools)
    ids = ids[: len(ids) - ids[::-1].index(tokenizer.eos_token_id)]  # the template's "\n" after the last turn
    start = len(prompt_ids(tokenizer, f"{a}+{b}=", tools))
    labels = [-100] * start + ids[start:]
    if tool_end is not None:
        call_end = ids.index(tokenizer.eos_token_id, start) + 1  # the call turn's <|im_end|> is labelled
        labels[call_end:tool_end] = [-100] * (tool_end - call_end)
    if not label_first:
        labels[start] = -100
    return ids, labels


# -- the model and its warm-up -----------------------------------------------------------------------------------------

DEFAULT_STEPS = 800  # see the module docstring; --check gives its numbers
DEFAULT_SEED = 0
TOOL_SHARE = 0.3  # of the labelled first tokens (the choice to call or to answer) are <tool_call>: 26% of samples
CALL_EXAMPLES = 0.6  # of the examples call the tool: more copying practice than TOOL_SHARE alone would give
# The <tool_call> of a calling example is labelled with this probability, so that TOOL_SHARE of the labelled choices
# are calls: CALL_EXAMPLES * p / (CALL_EXAMPLES * p + 1 - CALL_EXAMPLES) = TOOL_SHARE.
LABEL_CALL = TOOL_SHARE / (1 - TOOL_SHARE) * (1 - CALL_EXAMPLES) / CALL_EXAMPLES
BATCH_SIZE = 64
LEARNING_RATE = 1e-3  # fastgrpo/train/build_default_model.py's


def build_model(tokenizer, seed: int) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama whose generation config stops at <|im_end|> and pads with <|endoftext|>."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32
        num_key_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None, do_sample=False
    )
    return model


def batch(tokenizer, examples: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L] and labels [B, L] (-100 on the padding)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in examples])
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in examples])
    return input_ids, labels


def warm_up(model, tokenizer, steps: int, seed: int) -> None:
    """`steps` AdamW steps, each on BATCH_SIZE fresh train-split problems, CALL_EXAMPLES of them calling the tool
    (their <tool_call> labelled with probability LABEL_CALL)."""
    rng, tools = Random(f"warm-up:{seed}"), schemas()
    pairs = draw_pairs("train", rng)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)  # linear decay to 0
    model.train()
    for _ in range(steps):
        examples = []
        for _ in range(BATCH_SIZE):
            calls_tool = rng.random() < CALL_EXAMPLES
            label_first = not calls_tool or rng.random() < LABEL_CALL
            examples.append(example(tokenizer, *next(pairs), calls_tool, tools, label_first))
        input_ids, labels = batch(tokenizer, examples)  # [B, L] each
        # No attention mask: the padding follows every real token, so causal attention never reads it from a
        # labelled position, and positions count from 0 at the prompt's first token as when sampling.
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()


def build(output_dir: Path, data_dir: Path, steps: int, seed: int) -> None:
    write_data(data_dir, seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    warm_up(model, tokenizer, steps, seed)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


# -- the check: rollouts as the trainer makes them ---------------------------------------------------------------------

MAX_COMPLETION_LENGTH = 48  # the recipe's (tests/test_calculator_task.py checks they agree)
MAX_TOOL_CALLING_ITERATIONS = 1  # the recipe's
NUM_CHECK_PROMPTS = 200
NUM_SAMPLES = 8  # per prompt at temperature 1, the recipe's num_generations


@dataclass(frozen=True, slots=True)
class Rollout:
    called: bool  # its first turn called a tool
    right_arguments: bool  # that call was add(a, b) with the prompt's operands
    right: bool  # the built-in accuracy reward: the last assistant turn's last number is the answer


def rollouts(engine: Engine, tokenizer, rows: list[dict], n: int, params: SamplingParams) -> list[list[Rollout]]:
    """n rollouts of each row's prompt as `fastgrpo train` makes them (fastgrpo/train/agent.py): a turn ends at
    <|im_end|>; its calls are parsed, run and answered with the tool turn's tokens, until a turn calls no tool or
    MAX_TOOL_CALLING_ITERATIONS turns did. -> per row, its n rollouts."""
    tools, chat, box = schemas(), ToolChat.for_tokenizer(tokenizer), toolbox(load_tools([TOOL_SPEC]))
    prompts = [prompt_ids(tokenizer, r["prompt"], tools) for r in rows]
    earlier: dict[tuple[int, int], list[int]] = {}  # (prompt, completion) -> its tokens before the current turn
    first_calls: dict[tuple[int, int], list | None] = {}

    with ToolRunner() as runner:

        def turn_end(turns: list[Turn]) -> list[list[int] | None]:
            keys = [(t.prompt_index, t.completion_index) for t in turns]
            calls = []
            for (i, j), turn in zip(keys, turns, strict=True):
                message = chat.parse(turn.token_ids, prompts[i] + earlier.setdefault((i, j), []), tools)
                first_calls.setdefault((i, j), tool_calls(message))
                calls.append(tool_calls(message) if turn.turn < MAX_TOOL_CALLING_ITERATIONS else None)
            results, _ = runner.run(calls, [box] * len(turns))
            answers = [chat.suffix_ids(r) if c else None for c, r in zip(calls, results, strict=True)]
            for key, turn, answer in zip(keys, turns, answers, strict=True):
                earlier[key] += turn.token_ids + (answer or [])
            return answers

        groups = engine.generate(prompts, n=n, params=params, turn_end=turn_end)
    out = []
    for i, (row, group) in enumerate(zip(rows, groups, strict=True)):
        a, b = map(int, row["prompt"].removesuffix("=").split("+"))
        out.append([])
        for j, completion in enumerate(group):
            ids, mask = completion.token_ids, completion.tool_mask
            last = len(mask) - mask[::-1].index(0) if 0 in mask else 0  # the last turn follows the last tool turn
            final = chat.parse(ids[last:], prompts[i] + ids[:last], tools)
            calls = first_calls.get((i, j))  # None too for a completion cut by length before its turn ended
            out[i].append(Rollout(
                called=calls is not None,
                right_arguments=calls is not None and calls[0]["function"]["arguments"] == {"a": a, "b": b},
                right=accuracy(None, [[final]], [row["answer"]]) == [1.0],
            ))  # fmt: skip
    return out


def share(values: list[bool]) -> float | None:
    return sum(values) / len(values) if values else None


def check(model_dir: Path, data_dir: Path, num_prompts: int, seed: int) -> dict[str, dict[str, float | None]]:
    """The first `num_prompts` held-out prompts, greedy and at temperature 1 (NUM_SAMPLES each): accuracy, tool-call
    rate, accuracy with and without a call, the share of calls with the right arguments and, at temperature 1, the
    share of groups holding both a right and a wrong rollout (the ones GRPO learns from)."""
    tokenizer = tokenizer_from(str(model_dir))
    engine = Engine(LlamaForCausalLM.from_pretrained(model_dir).eval(), tokenizer=tokenizer)
    rows = [json.loads(line) for line in (data_dir / "test.jsonl").read_text().splitlines()[:num_prompts]]
    results = {}
    for name, temperature, n in (("greedy", 0.0, 1), ("T=1", 1.0, NUM_SAMPLES)):
        params = SamplingParams(temperature=temperature, max_new_tokens=MAX_COMPLETION_LENGTH, seed=seed)
        groups = rollouts(engine, tokenizer, rows, n, params)
        flat = [r for group in groups for r in group]
        results[name] = {
            "accuracy": share([r.right for r in flat]),
            "tool_call_rate": share([r.called for r in flat]),
            "accuracy_with_call": share([r.right for r in flat if r.called]),
            "accuracy_without_call": share([r.right for r in flat if not r.called]),
            "right_arguments": share([r.right_arguments for r in flat if r.called]),
            "mixed_groups": share([0 < sum(r.right for r in group) < n for group in groups]) if n > 1 else None,
        }
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--check", action="store_true", help="measure the model in --output-dir instead of building")
    parser.add_argument("--num-prompts", type=int, default=NUM_CHECK_PROMPTS)
    args = parser.parse_args(argv)
    # 2 threads everywhere: the shipped weights were built with 2, and the thread count can change the order of
    # floating-point sums.
    torch.set_num_threads(2)
    start = time.perf_counter()
    if args.check:
        for name, numbers in check(args.output_dir, args.data_dir, args.num_prompts, args.seed).items():
            print(name, " ".join(f"{k} {v:.1%}" if v is not None else f"{k} -" for k, v in numbers.items()))
        print(f"{args.num_prompts} held-out prompts, {time.perf_counter() - start:.0f} s")
        return
    build(args.output_dir, args.data_dir, args.steps, args.seed)
    print(f"saved {args.data_dir} and {args.output_dir} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
