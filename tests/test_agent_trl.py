"""`fastgrpo train`'s agent rollouts (tools, environments, rollout_func) against TRL 1.16's own tool loop on the same
model outputs.

One script of turns drives both sides: `Policy` maps the token ids so far (prompt + completion) to the next turn's
token ids, the turns chosen per case (CASES) so that tools succeed, raise, are unknown, are async, get malformed JSON,
would overflow the length budget or the context window, are cut by the budget, run for several rounds or into
max_tool_calling_iterations; environments with reset() text and get_reward() (one, and two picked by the data's
`environment` column); TRL's Qwen3 (training) and Qwen3.6 (XML calls) templates; a rollout_func with env_mask and
extra fields; a tokenizer that ships a response_template.

- TRL: a real `trl.GRPOTrainer` (tools=, environment_factory=, rollout_func=, max_tool_calling_iterations=,
  max_completion_length=) whose `_generate_single_turn` (the sampling step, nothing else) is the script, capped at
  max_completion_length as the model's generate would be; `_generate_and_score_completions` runs on the dataset rows
  in the order fastgrpo picked them (each row G times, prompt-major, as TRL's RepeatSampler yields them).
- fastgrpo: a `Trainer` on the same model, data and tools (given as "test_agent_trl:name", the rollout_func as
  "path/to/test_agent_trl.py:scripted_rollout"), its engine a `ScriptedEngine` of the same script, one
  `train_step()` with the update left out (`_update` records the Rollout).

Compared exactly: the environments' reset() arguments, prompt and completion ids, TRL's tool_mask (times
completion_mask) against the loss mask, the prompts / completions (messages) / completion ids / columns the reward
function got, the rewards per function and the advantages (to 1e-6), tools/call_frequency and
tools/failure_frequency (relative 1e-6: TRL divides float32 tensors). Each case also checks that it made the
rollouts it is meant to (the roles of each completion's messages)."""

import copy
import json
import re
from collections import Counter as Tally
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pytest
import torch
from agent_helpers import ScriptedEngine
from tools_helpers import (
    QWEN_STYLE_TEMPLATE,
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
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving, qwen3_template

from fastgrpo.train import TrainConfig, Trainer
from fastgrpo.train.tools import ToolChat

HERE = Path(__file__).stem  # tools, environments and rewards reach fastgrpo's config as "test_agent_trl:name"
G = 2
END = "<|im_end|>"
RESERVED = ("trainer_state", "log_extra", "log_metric", "environments")  # reward keywords that are not data


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def xml_call(name: str, **arguments) -> str:
    """A call in Qwen3.5 / 3.6's format."""
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def repeat(text: str, times: int) -> str:
    """Repeats a text.

    Args:
        text: what to repeat
        times: how many times
    """
    return text * times


# -- reward functions ---------------------------------------------------------------------------------------------

SEEN = []  # per call of `recorded`: the keyword arguments it got (environments by class name)


def recorded(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """Records what it is given; scores each rollout by its tokens, tool messages and a rollout_func's `judge`."""
    SEEN.append({"prompts": copy.deepcopy(prompts), "completions": copy.deepcopy(completions),
                 "completion_ids": copy.deepcopy(completion_ids),
                 "columns": {k: v for k, v in kwargs.items() if k not in RESERVED},
                 "environments": [type(e).__name__ for e in kwargs.get("environments") or []]})
    judge = kwargs.get("judge", [0.0] * len(prompts))
    return [len(ids) / 16 + sum(m["role"] == "tool" for m in c if isinstance(c, list)) + score
            for c, ids, score in zip(completions, completion_ids, judge, strict=True)]


# -- environments -------------------------------------------------------------------------------------------------

RESETS = []  # per reset(): (the environment's class, the keyword arguments it got)


class NotedCounter(Counter):
    def reset(self, **row) -> str:
        RESETS.append((type(self).__name__, row))
        return super().reset(**row)


class NotedQuiet(Quiet):
    def reset(self, **row) -> None:
        RESETS.append((type(self).__name__, row))
        return super().reset(**row)


# -- the policy ---------------------------------------------------------------------------------------------------


class Policy:
    """The model's turns: turns[question][j] lists completion j's turns (text) for the prompt whose last user message
    is `question`. Called with the ids so far (prompt + completion), it returns the next turn's ids. The prompt ends at
    the first assistant header; the turn is the number of assistant headers after it; j of a first turn is its rank
    among the first turns of its prompt (both sides sample prompt-major), carried in the later turns by a tag "(j) "
    that starts the first (after what the generation prompt opens, a <think> block in Qwen3.6's)."""

    def __init__(self, tokenizer, turns: dict[str, list[list[str]]]):
        self.tokenizer, self.turns, self.started = tokenizer, turns, Tally()
        self.header = "<|im_start|>assistant\n"

    def __call__(self, ids: list[int]) -> list[int]:
        text = self.tokenizer.decode(ids)
        prompt, _, so_far = text.partition(self.header)
        question = prompt.rpartition("<|im_start|>user\n")[2].removesuffix(END + "\n")
        turn = so_far.count(self.header)
        if turn == 0:
            j = self.started[question]
            self.started[question] += 1
        else:
            j = int(re.search(r"\((\d+)\) ", so_far).group(1))
        written = self.turns[question][j][turn]
        return self.tokenizer(f"({j}) {written}" if turn == 0 else written, add_special_tokens=False).input_ids


# -- rollout_func ---------------------------------------------------------------------------------------------------

ROLLOUT_TURNS = {  # per question, per j: (text, 1 where the model wrote it / 0 for the environment's feedback)
    "Guess a number.": [[("5", 1), ("\ntoo low\n", 0), ("8<|im_end|>", 1)], [("9<|im_end|>", 1)]],
    "Guess a letter.": [[("q", 1), ("\nwrong\n", 0), ("z", 1)], [("a<|im_end|>", 1)]],
    "Think first.": [[("<think>\nhm\n</think>\n\n5", 1), ("\nno\n", 0), ("6<|im_end|>", 1)], [("7<|im_end|>", 1)]],
}


def scripted_rollout(prompts, trainer) -> dict:
    """A TRL rollout_func: the scripted turns of ROLLOUT_TURNS, env_mask 0 on the feedback, an extra `judge` field
    per sample and a single `episode` value. Prompts come repeated G times, prompt-major."""
    tokenizer = trainer.processing_class if hasattr(trainer, "processing_class") else trainer.tokenizer
    started, out = Tally(), {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "judge": []}
    for prompt in prompts:
        question = prompt[-1]["content"]
        j = started[question]
        started[question] += 1
        ids, mask = [], []
        for text, written in ROLLOUT_TURNS[question][j]:
            tokens = tokenizer(text, add_special_tokens=False).input_ids
            ids += tokens
            mask += [written] * len(tokens)
        out["prompt_ids"].append(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
        out["completion_ids"].append(ids)
        out["logprobs"].append([-0.5] * len(ids))
        out["env_mask"].append(mask)
        out["judge"].append(float(len(ROLLOUT_TURNS[question][j])))
    out["episode"] = 7
    return out


# -- cases ----------------------------------------------------------------------------------------------------------

LONG = "and so on, " * 30  # a turn that never ends by itself


@dataclass(frozen=True, kw_only=True)
class Case:
    rows: list[dict]
    turns: dict | None = None  # Policy's turns (None: rollout_func writes the rollouts)
    shapes: dict  # per question, per j: the roles of its completion's messages ("ata": assistant, tool, assistant)
    tools: list = field(default_factory=list)
    environment_factory: object = None
    rollout_func: object = None
    max_completion_length: int | None = 256  # None: exact_budget
    max_tool_calling_iterations: int | None = None
    context: object = lambda prompt, budget: 8192  # the model's max_position_embeddings
    mask_truncated_completions: bool = False
    template: str | None = None  # one of TRL's chat templates (None: QWEN_STYLE_TEMPLATE)
    ships_response_template: bool = False  # the tokenizer comes with a response_template (Qwen's JSON calls)


def user(question: str, **columns) -> dict:
    return {"prompt": [{"role": "user", "content": question}], **columns}


CHAIN = {  # j 0: three tool rounds, one call each; j 1: a round of two calls, then one of one
    "Chain.": [[call("add", a=1, b=2) + END, call("amul", a=3, b=3) + END, call("add", a=9, b=1) + END, "10" + END],
               [call("add", a=1, b=1) + call("amul", a=2, b=2) + END, call("echo", text="x") + END, "x" + END]],
}
FILL = {  # j 0's call and result (55 characters) fill exact_budget to the token, j 1's are one token over
    "Fill.": [[call("repeat", text="a", times=55) + END, "cut to nothing" + END],
              [call("repeat", text="a", times=56) + END]],
}

CASES = {
    "succeeds": Case(rows=[user("3+4?"), user("1+1?"), user("Show.")], tools=[add, blocks, record], turns={
        "3+4?": [[call("add", a=3, b=4) + END, "7" + END], ["7" + END]],
        "1+1?": [["Let me.\n" + call("add", a=1, b=1) + END, "2" + END], [call("add", a=1, b=1) + END, "two" + END]],
        "Show.": [[call("blocks") + call("record") + END, "shown" + END], ["no" + END]],  # content blocks, a dict
    }, shapes={"3+4?": ["ata", "a"], "1+1?": ["ata", "ata"], "Show.": ["atta", "a"]}),
    "raises": Case(rows=[user("Try.")], tools=[add, boom], turns={
        "Try.": [[call("boom") + END, "sorry" + END], [call("add", a=1) + END, "?" + END]],  # a missing argument
    }, shapes={"Try.": ["ata", "ata"]}),
    "unknown": Case(rows=[user("Call.")], tools=[add], turns={
        "Call.": [[call("nope", x=1) + END, "ok" + END], [call("add", a=1, b=2) + call("nope") + END, "3" + END]],
    }, shapes={"Call.": ["ata", "atta"]}),
    # async tools after the sync one (TRL runs a turn's sync tools first, then its async ones: see the test below)
    "async": Case(rows=[user("Multiply.")], tools=[add, amul, afail], turns={
        "Multiply.": [[call("amul", a=2, b=5) + END, "10" + END],
                      [call("add", a=1, b=1) + call("afail") + call("amul", a=1, b=2) + END, "done" + END]],
    }, shapes={"Multiply.": ["ata", "attta"]}),
    # j 0's call is not JSON (plain text, the rollout ends); j 1's second call has an argument add cannot take
    "malformed": Case(rows=[user("Parse.")], tools=[add], turns={
        "Parse.": [['<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>' + END],
                   [call("add", a=1, b=1) + END, call("add", a="x", b=1) + END, "2" + END]],
    }, shapes={"Parse.": ["a", "atata"]}),
    # j 0's result (120 characters) would take the completion past 160 tokens: rolled back, the rollout ends there
    "overflow": Case(rows=[user("Repeat.")], tools=[repeat], max_completion_length=160, turns={
        "Repeat.": [[call("repeat", text="ab", times=60) + END],
                    [call("repeat", text="ab", times=2) + END, "abab" + END]],
    }, shapes={"Repeat.": ["a", "ata"]}),
    # "Ramble." j 0: the turn after the tool runs out of room; j 1: the first turn makes a complete call and runs out
    # of room (TRL runs the call, finds no room for its result and drops it); "Again." j 0: the same in the turn after
    # a tool
    "cut": Case(rows=[user("Ramble."), user("Again.")], tools=[add], max_completion_length=120, turns={
        "Ramble.": [[call("add", a=1, b=1) + END, "2, " + LONG], [call("add", a=2, b=2) + LONG]],
        "Again.": [[call("add", a=1, b=1) + END, call("add", a=5, b=5) + LONG], ["2" + END]],
    }, shapes={"Ramble.": ["ata", "a"], "Again.": ["ata", "a"]}),
    # a result that exactly fills the budget is kept (the next turn gets no tokens); one token more is rolled back
    # (with mask_truncated_completions: j 0 ends without a stop token, truncated on both sides, out of the loss)
    "exact": Case(rows=[user("Fill.")], tools=[repeat], max_completion_length=None, turns=FILL,
                  mask_truncated_completions=True, shapes={"Fill.": ["at", "a"]}),
    # the context window ends where the budget does (fastgrpo refuses less): now j 0's result reaches it, and TRL
    # rolls back a sequence as long as the model's max_position_embeddings
    "exact_context": Case(rows=[user("Fill.")], tools=[repeat], max_completion_length=None, turns=FILL,
                          context=lambda prompt, budget: prompt + budget, shapes={"Fill.": ["a", "a"]}),
    "iterations": Case(rows=[user("Chain.")], tools=[add, amul, echo], turns=CHAIN,
                       shapes={"Chain.": ["atatata", "attata"]}),
    # j 0's third call is made but not run
    "cap": Case(rows=[user("Chain.")], tools=[add, amul, echo], max_tool_calling_iterations=2, turns=CHAIN,
                shapes={"Chain.": ["atata", "attata"]}),
    "cap_0": Case(rows=[user("Chain.")], tools=[add, amul, echo], max_tool_calling_iterations=0, turns=CHAIN,
                  shapes={"Chain.": ["a", "a"]}),
    # reset() appends " Reach {target}." to the prompt; get_reward is a second reward function
    "environment": Case(rows=[user("Count.", target=3), user("Count more.", target=5)], tools=[echo],
                        environment_factory=NotedCounter, turns={
        "Count. Reach 3.": [[call("increment", by=3) + call("read") + END, "3" + END],
                            [call("increment", by=1) + END, call("read") + END, "1" + END]],
        "Count more. Reach 5.": [[call("echo", text="hi") + call("increment", by="x") + END, "hm" + END],
                                 ["no tools" + END]],
    }, shapes={"Count. Reach 3.": ["atta", "atata"], "Count more. Reach 5.": ["atta", "a"]}),
    # each row's environment column picks its environment; one's methods are unknown tools to the other's rollouts
    "environments": Case(rows=[user("Count.", target=3, environment="counter"), user("Shout.", environment="quiet")],
                         tools=[echo], environment_factory={"counter": NotedCounter, "quiet": NotedQuiet}, turns={
        "Count. Reach 3.": [[call("increment", by=3) + END, "3" + END], [call("shout", text="a") + END, "?" + END]],
        "Shout.": [[call("shout", text="hi") + call("echo", text="x") + END, "HI" + END],
                   [call("increment", by=1) + END, "no" + END]],
    }, shapes={"Count. Reach 3.": ["ata", "ata"], "Shout.": ["atta", "ata"]}),
    # TRL's Qwen3 template (not prefix-preserving: TRL swaps in its training template, given here as
    # chat_template_path) with reasoning, and its Qwen3.6 template (XML calls, a <think> block the prompt opens)
    "qwen3": Case(rows=[user("3+4?")], tools=[add, amul], template="qwen3", turns={
        "3+4?": [["<think>\nadd them\n</think>\n\n" + call("add", a=3, b=4) + END, "<think>\nok\n</think>\n\n7" + END],
                 [call("amul", a=3, b=4) + END, "12" + END]],
    }, shapes={"3+4?": ["ata", "ata"]}),
    "qwen3_6": Case(rows=[user("3+4?")], tools=[add, amul], template="qwen3_6", turns={
        "3+4?": [["add them\n</think>\n\n" + xml_call("add", a=3, b=4) + END, "ok\n</think>\n\n7" + END],
                 ["</think>\n\n" + xml_call("nope") + xml_call("amul", a=3, b=4) + END, "</think>\n\n12" + END]],
    }, shapes={"3+4?": ["ata", "atta"]}),
    "rollout_func": Case(rows=[user("Guess a number."), user("Guess a letter.")], rollout_func=scripted_rollout,
                         shapes={"Guess a number.": ["a", "a"], "Guess a letter.": ["a", "a"]}),
    # a tokenizer that ships a response_template: TRL parses completions without tools with it too (the reasoning
    # apart), from its sampler or from a rollout_func
    "parsed": Case(rows=[user("Think.")], ships_response_template=True, turns={
        "Think.": [["<think>\nfive\n</think>\n\n5" + END], ["6" + END]],
    }, shapes={"Think.": ["a", "a"]}),
    "parsed_rollout_func": Case(rows=[user("Think first.")], rollout_func=scripted_rollout,
                                ships_response_template=True, shapes={"Think first.": ["a", "a"]}),
}


def exact_budget(tokenizer) -> int:
    """The budget that FILL's j 0 (its call and its result, 55 characters) fills to the token."""
    turn = tokenizer(f"(0) {call('repeat', text='a', times=55)}{END}", add_special_tokens=False).input_ids
    suffix = ToolChat.for_tokenizer(tokenizer).suffix_ids([{"role": "tool", "name": "repeat", "content": "a" * 55}])
    return len(turn) + len(suffix)


# -- the two sides --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(context window, ships a response template) -> a folder with a tiny random Qwen2 (hidden 32, 2 layers) of that
    max_position_embeddings and the byte-level tokenizer with the Qwen-style tool template; each saved once."""
    root, saved = tmp_path_factory.mktemp("agent_trl"), {}

    def model_dir(context: int, ships_response_template: bool = False) -> Path:
        key = (context, ships_response_template)
        if key not in saved:
            tokenizer = byte_tokenizer(QWEN_STYLE_TEMPLATE)
            if ships_response_template:
                tokenizer.response_template = qwen3_template
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(Qwen2Config(
                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))  # fmt: skip
            model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                                       pad_token_id=tokenizer.pad_token_id)
            saved[key] = root / f"model_{context}_{ships_response_template}"
            model.save_pretrained(saved[key])
            tokenizer.save_pretrained(saved[key])
        return saved[key]

    return model_dir


def spec(thing) -> str:
    return f"{HERE}:{thing.__name__}"


def run_fastgrpo(case: Case, model_dir: Path, out: Path, max_completion_length: int) -> dict:
    """One train_step of a fastgrpo Trainer, its engine the scripted policy, the update left out."""
    (out / "data").mkdir(parents=True)
    (out / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in case.rows))
    factory = case.environment_factory
    if factory is not None:
        factory = {k: spec(v) for k, v in factory.items()} if isinstance(factory, dict) else spec(factory)
    config = TrainConfig(
        model_name_or_path=str(model_dir), dataset_name=str(out / "data"), output_dir=str(out / "run"),
        num_generations=G, per_device_train_batch_size=len(case.rows) * G, max_completion_length=max_completion_length,
        max_prompt_length=None, max_steps=1, report_to=["none"], disable_tqdm=True, reward_funcs=[spec(recorded)],
        tools=[spec(t) for t in case.tools], environment_factory=factory,
        max_tool_calling_iterations=case.max_tool_calling_iterations,
        rollout_func=None if case.rollout_func is None else f"{__file__}:{case.rollout_func.__name__}",
        mask_truncated_completions=case.mask_truncated_completions, chat_template_path=template_file(case, out))
    trainer = Trainer(config, device="cpu")
    seen = {}
    if case.turns is not None:
        policy = Policy(trainer.tokenizer, case.turns)
        trainer.engine = ScriptedEngine(lambda prompt, turn, so_far: policy(prompt + so_far), trainer.stop_token_ids)
    score = trainer._score

    def scoring(samples, sampled):
        seen["samples"] = samples
        seen["per_func"], total = score(samples, sampled)
        return seen["per_func"], total

    trainer._score = scoring
    trainer._update = lambda rollout: seen.update(rollout=rollout) or {}
    SEEN.clear()
    RESETS.clear()
    trainer.step = 1
    try:
        metrics = trainer.train_step()
    finally:
        if trainer.agent is not None:
            trainer.agent.close()
        trainer.folder.release()
    rollout = seen["rollout"]
    return {"samples": seen["samples"], "per_func": seen["per_func"], "prompt_ids": rollout.prompt_ids,
            "completion_ids": rollout.completion_ids, "loss_mask": rollout.loss_mask,
            "advantages": rollout.advantages.tolist(), "rewards": list(SEEN), "resets": list(RESETS),
            "tools": {k: v for k, v in metrics.items() if k.startswith("tools/")}}


def template_file(case: Case, out: Path) -> str | None:
    """The chat template TRL renders with, as a file: its own, or the training one it swaps in."""
    if case.template is None:
        return None
    tokenizer = byte_tokenizer(trl_template(case.template))
    path = out / f"{case.template}.jinja"
    path.write_text(tokenizer.chat_template if is_chat_template_prefix_preserving(tokenizer)
                    else get_training_chat_template(tokenizer))
    return str(path)


def run_trl(case: Case, model_dir: Path, out: Path, max_completion_length: int, inputs: list[dict]) -> dict:
    """TRL's _generate_and_score_completions on `inputs`, its sampling step the scripted policy."""
    tokenizer = byte_tokenizer(QWEN_STYLE_TEMPLATE if case.template is None else trl_template(case.template))
    # TRL's add_response_schema knows TRL's templates, not this one: its Qwen grammar is given with tools
    if case.ships_response_template or ((case.tools or case.environment_factory) and case.template is None):
        tokenizer.response_template = qwen3_template
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=len(inputs), num_generations=G,
                      gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, beta=0.0,
                      max_completion_length=max_completion_length,
                      max_tool_calling_iterations=case.max_tool_calling_iterations, report_to="none", use_cpu=True,
                      bf16=False, save_strategy="no", logging_strategy="no", seed=0,
                      mask_truncated_completions=case.mask_truncated_completions)
    trainer = GRPOTrainer(model=Qwen2ForCausalLM.from_pretrained(model_dir), reward_funcs=[recorded], args=args,
                          train_dataset=datasets.Dataset.from_list(case.rows), processing_class=tokenizer,
                          tools=case.tools or None, environment_factory=case.environment_factory,
                          rollout_func=case.rollout_func)
    if case.turns is not None:
        policy = Policy(tokenizer, case.turns)

        def sample(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            return [policy(ids)[:max_completion_length] for ids in prompt_ids], None  # generate stops at its budget

        trainer._generate_single_turn = sample
    seen = {}
    calculate = trainer._calculate_rewards

    def rewards(*a):
        seen["per_func"] = calculate(*a)
        return seen["per_func"]

    trainer._calculate_rewards = rewards
    trainer.model.train()
    SEEN.clear()
    RESETS.clear()
    output = trainer._generate_and_score_completions(copy.deepcopy(inputs))
    ids = SEEN[0]["completion_ids"]  # TRL's completion_ids_list (completion_mask is 0 on truncated ones when masked)
    lengths = [len(row) for row in ids]
    mask = output["completion_mask"] * output.get("tool_mask", 1)
    prompt_ids = [row[m.bool()].tolist() for row, m in zip(output["prompt_ids"], output["prompt_mask"], strict=True)]
    metrics = trainer._metrics["train"]
    return {"per_func": seen["per_func"], "prompt_ids": prompt_ids,
            "completion_ids": [row[:n].tolist() for row, n in zip(output["completion_ids"], lengths, strict=True)],
            "loss_mask": [row[:n].tolist() for row, n in zip(mask, lengths, strict=True)],
            "advantages": output["advantages"].tolist(), "rewards": list(SEEN), "resets": list(RESETS),
            "tools": {k: metrics[k][-1] for k in ("tools/call_frequency", "tools/failure_frequency") if k in metrics}}


@pytest.mark.parametrize("name", list(CASES))
def test_agent_matches_trl(name, model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory / rollout_func are experimental in TRL
    case = CASES[name]
    tokenizer = byte_tokenizer(QWEN_STYLE_TEMPLATE)
    budget = case.max_completion_length or exact_budget(tokenizer)
    prompt = tokenizer.apply_chat_template(case.rows[0]["prompt"], tools=case.tools or None, tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
    model_dir = model_dirs(case.context(len(prompt), budget), case.ships_response_template)
    ours = run_fastgrpo(case, model_dir, tmp_path / "fastgrpo", budget)
    # what TRL's dataloader yields in the order fastgrpo picked (each row G times): one dict per sample (TRL writes a
    # rollout_func's fields into them), every column of the table (None where a row has none)
    dataset = datasets.Dataset.from_list(case.rows)
    inputs = [dataset[i] for i in ours["samples"]]
    trl = run_trl(case, model_dir, tmp_path / "trl", budget, inputs)

    assert shapes(ours["rewards"][0]) == case.shapes  # the case makes the rollouts it is meant to
    assert ours["resets"] == trl["resets"]
    assert ours["prompt_ids"] == trl["prompt_ids"]
    for k, (got, want) in enumerate(zip(ours["completion_ids"], trl["completion_ids"], strict=True)):
        assert got == want, f"sample {k}: completion ids differ\n{_text(got)!r}\n{_text(want)!r}"
    assert ours["loss_mask"] == trl["loss_mask"]
    assert len(ours["rewards"]) == len(trl["rewards"]) == 1
    got, want = ours["rewards"][0], trl["rewards"][0]
    assert got["prompts"] == want["prompts"]
    for k, (a, b) in enumerate(zip(got["completions"], want["completions"], strict=True)):
        assert a == b, f"sample {k}: the messages reward functions got differ"
    assert got["completion_ids"] == want["completion_ids"] == trl["completion_ids"]
    assert got["environments"] == want["environments"]
    assert got["columns"] == want["columns"]
    torch.testing.assert_close(ours["per_func"], trl["per_func"], rtol=0, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(torch.tensor(ours["advantages"]), torch.tensor(trl["advantages"]), rtol=0, atol=1e-6)
    assert ours["tools"] == pytest.approx(trl["tools"], rel=1e-6, abs=1e-6)


def shapes(seen: dict) -> dict:
    """What a reward function was given -> per question, per j: the roles of the completion's messages."""
    out = {}
    for prompt, completion in zip(seen["prompts"], seen["completions"], strict=True):
        out.setdefault(prompt[-1]["content"], []).append("".join(m["role"][0] for m in completion))
    return out


def _text(ids: list[int]) -> str:
    return byte_tokenizer(QWEN_STYLE_TEMPLATE).decode(ids)


def test_async_call_before_sync_one(model_dirs, tmp_path, monkeypatch):
    """The one difference tools.py documents: a turn's results come in the order of its calls here, while TRL puts
    the sync tools' results first, then the async ones'. The same messages, counts and masks otherwise."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    case = Case(rows=[user("Both.")], tools=[add, amul], turns={
        "Both.": [[call("amul", a=2, b=3) + call("add", a=2, b=3) + END, "6 5" + END], ["none" + END]],
    }, shapes={"Both.": ["atta", "a"]})
    ours = run_fastgrpo(case, model_dirs(8192), tmp_path / "fastgrpo", 256)
    dataset = datasets.Dataset.from_list(case.rows)
    trl = run_trl(case, model_dirs(8192), tmp_path / "trl", 256, [dataset[i] for i in ours["samples"]])
    got, want = ours["rewards"][0]["completions"][0], trl["rewards"][0]["completions"][0]
    assert [m["name"] for m in got[1:3]] == ["amul", "add"] and [m["name"] for m in want[1:3]] == ["add", "amul"]
    assert [got[0], got[2], got[1], got[3]] == want
    assert [len(ids) for ids in ours["completion_ids"]] == [len(ids) for ids in trl["completion_ids"]]
    assert ours["loss_mask"] == trl["loss_mask"] and ours["tools"] == pytest.approx(trl["tools"], rel=1e-6)
