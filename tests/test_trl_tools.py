"""`FastGRPOTrainer` with TRL's own `tools`, `environment_factory` and `rollout_func` trains exactly as stock
`trl.GRPOTrainer` (trl 1.16): TRL's `tool_mask` (a rollout_func's `env_mask`) reaches fastgrpo's fused loss.

Each case trains a tiny fp32 Qwen2 (byte-level tokenizer with Qwen's tool tokens) for two optimizer steps twice, once
with `GRPOTrainer` and once with `FastGRPOTrainer`, from the same seed, on CPU, through `trainer.train()`. Only the
sampling step is replaced, on both instances alike: `_generate_single_turn` returns scripted turns (`Script`), so the
"model" calls tools over up to three turns and TRL's own tool loop runs them (sync and async tools, tools that raise, a
tool that does not exist, environment methods), appends the results and builds `tool_mask`. With `rollout_func` the
function itself is scripted and returns `env_mask`. One generation batch (2 prompts x 4 completions) is split into two
micro-batches, one per optimizer step, so TRL computes old logprobs and the second step is off-policy (ratios != 1,
where the sequence-level ratio and the clip terms read the mask).

Compared: the rollouts (completion ids, completion and tool masks, advantages: TRL's code on both sides, so equal
exactly), every micro-step's loss, every parameter's gradient at the first step, the parameters after two steps (SGD,
so they check step two's gradients), and the logged loss and tool metrics. A trainer that drops `tool_mask` before
fastgrpo's loss must fail the same comparison (`test_ignoring_the_tool_mask_fails`).
"""

import asyncio
import copy
import json

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
from helpers import tiny_config, torch_threads  # noqa: E402
from tools_helpers import SHORT_TOOL_TEMPLATE, byte_tokenizer  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import qwen3_template  # noqa: E402

from fastgrpo.integrations.trl import FastGRPOTrainer  # noqa: E402

# The tolerances of tests/test_trl_trainer.py, for the same reason: both trainers run in fp32 on the same completions
# and differ only in how the logprobs and the loss are summed (~1e-7 relative per op, amplified ~10x through the
# log-softmax over V = 265 and sums over <= 256 tokens), while a mask difference moves the gradients by > 1e-2 of their
# largest entry (the mutant test below). Observed maxima are printed at module teardown (visible with -s).
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_REL = 1e-5
PARAM_ATOL = 1e-5
LR = 0.003  # small, as in test_trl_trainer: the tiny model's second step is ill-conditioned at lr 0.01
METRIC_PREFIXES = ("kl", "entropy", "clip_ratio/", "cispo_clip_ratio", "tools/", "completions/", "num_tokens")

GROUP = 4  # completions per prompt; 2 prompts per generation batch, split into 2 micro-batches of 4
MAX_COMPLETION_LENGTH = 256
EOS = "<|im_end|>"

_MAX_DIFF = {}  # quantity -> max difference seen in the matching runs (grad_rel: / max|grad|)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_max_diffs(monkeypatch_module):
    monkeypatch_module.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory / rollout_func are experimental
    with torch_threads(1):  # tiny tensors: intra-op threads only add spin-waits on a shared 2-core machine
        yield
    if _MAX_DIFF:
        print("\nFastGRPOTrainer vs GRPOTrainer with tools, max differences:")
        for what, value in sorted(_MAX_DIFF.items()):
            print(f"  {what:<10} {value:.3e}")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level, Qwen's tool tokens, a Qwen2.5-style template; TRL parses its replies with Qwen3's response template
    (the same <tool_call> JSON format)."""
    tokenizer = byte_tokenizer(SHORT_TOOL_TEMPLATE)
    tokenizer.response_template = qwen3_template
    return tokenizer


@pytest.fixture(scope="module")
def model_path(tokenizer, tmp_path_factory):
    """A tiny fp32 Qwen2 with lm_head weights of std 0.5 (init std 0.02 makes every distribution almost uniform),
    saved (TRL loads the reference model, beta > 0, from the policy's path)."""
    torch.manual_seed(0)
    config = tiny_config(Qwen2Config, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    config.max_position_embeddings = 512  # prompt + tool results + turns; TRL drops tool results past this
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("trl_tools")
    model.save_pretrained(path)
    return path


def _load(path):
    return Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)


# -- tools ----------------------------------------------------------------------------------------------------------


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def amul(a: int, b: int) -> int:
    """Multiplies, asynchronously.

    Args:
        a: the first number
        b: the second number
    """
    await asyncio.sleep(0)
    return a * b


def boom() -> str:
    """Always fails."""
    raise ValueError("kaboom")


async def afail() -> str:
    """Fails, asynchronously."""
    await asyncio.sleep(0)
    raise RuntimeError("async kaboom")


def call(name, **arguments) -> str:
    """One tool call as the model writes it."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# Sample i's turns: the first answers the prompt, each next one follows the previous turn's tool results. Samples 0-3
# share a prompt, as do 4-7 (RepeatSampler's order).
TOOL_TURNS = [
    [call("add", a=2, b=3) + EOS, call("amul", a=4, b=5) + EOS, "It is 20." + EOS],  # sync, then async
    [call("boom") + "\n" + call("nope", x=1) + EOS, "Both failed." + EOS],  # raises, unknown tool
    ["No tools needed: 7." + EOS],  # tool_mask all 1
    ["Let me see.\n" + call("amul", a=6, b=7) + "\n" + call("afail") + EOS, call("add", a=42, b=1) + EOS, "43" + EOS],
    [call("add", a=1, b=1) + EOS, "2" + EOS],
    [call("afail") + EOS, call("boom") + EOS, "Gave up." + EOS],
    ["Just guessing: 12, 13 or 14." + EOS],
    [call("add", a=5, b=5) + EOS, "ten " * 60],  # cut at max_completion_length after a tool result: truncated
]


class Counter:
    """An environment per rollout: the task names a target, the model moves a counter towards it and reads it."""

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

    def jump(self, to: int) -> str:
        """Sets the counter.

        Args:
            to: the new value
        """
        raise ValueError("jumping is not allowed")

    def get_reward(self) -> float:
        return float(-abs(self.value - self.target))


ENV_TURNS = [
    [call("increment", by=2) + EOS, call("increment", by=1) + "\n" + call("read") + EOS, "Done." + EOS],
    [call("jump", to=3) + EOS, call("increment", by=3) + EOS, "Ok." + EOS],  # an environment method that raises
    ["I will not count." + EOS],
    [call("increment", by="one") + EOS, call("add", a=1, b=2) + EOS, "Hmm." + EOS],  # a TypeError; a standalone tool
    [call("increment", by=5) + "\n" + call("read") + EOS, "Five." + EOS],
    [call("increment", by=4) + EOS, call("read") + EOS, call("increment", by=2) + EOS, "Six." + EOS],  # three rounds
    [call("read") + EOS, "Zero." + EOS],
    ["Counting is hard." + EOS],
]


class Script:
    """Stands in for `GRPOTrainer._generate_single_turn`: sample i's turns in order, as token ids (no logprobs).

    The first call gets every sample's prompt; each later call (TRL's tool loop) gets the samples that called tools,
    each as prompt + its completion so far + tool results, recognised by its prompt and first turn."""

    def __init__(self, tokenizer, turns):
        self.turns = [[tokenizer(t, add_special_tokens=False).input_ids for t in sample] for sample in turns]
        self.starts, self.next = None, [1] * len(turns)

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.starts is None:
            assert len(prompt_ids) == len(self.turns), "one generation batch per script"
            self.starts = [list(ids) + turns[0] for ids, turns in zip(prompt_ids, self.turns, strict=True)]
            return [list(turns[0]) for turns in self.turns], None
        completions = []
        for ids in prompt_ids:
            (i,) = [i for i, start in enumerate(self.starts) if list(ids[: len(start)]) == start]
            completions.append(list(self.turns[i][self.next[i]]))
            self.next[i] += 1
        return completions, None


# A rollout_func's samples: the model's turns, with the function's own feedback between them.
ROLLOUT_TURNS = [["Guess 3.", "Then 4." + EOS], ["Guess 9.", "Lower: 5.", "Done." + EOS], ["7" + EOS],
                 ["Guess 1.", "2." + EOS], ["Guess 2." + EOS], ["Guess 8.", "Up: 13." + EOS],
                 ["No.", "No!", "No?" + EOS], ["Guess 6.", "It is 6." + EOS]]


def scripted_rollout(tokenizer):
    """A rollout_func returning ROLLOUT_TURNS, its feedback marked 0 in env_mask."""

    def rollout(prompts, trainer):
        prompt_ids, completion_ids, env_mask = [], [], []
        for i, (prompt, turns) in enumerate(zip(prompts, ROLLOUT_TURNS, strict=True)):
            prompt_ids.append(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
            ids, mask = [], []
            for k, turn in enumerate(turns):
                if k:
                    feedback = tokenizer(f"\n[env: turn {k} of sample {i}]\n", add_special_tokens=False).input_ids
                    ids, mask = ids + feedback, mask + [0] * len(feedback)
                turn = tokenizer(turn, add_special_tokens=False).input_ids
                ids, mask = ids + turn, mask + [1] * len(turn)
            completion_ids.append(ids)
            env_mask.append(mask)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "env_mask": env_mask}

    return rollout


def length_reward(completion_ids, **columns) -> list[float]:
    return [len(ids) / 10 for ids in completion_ids]


QUESTIONS = ["What is 2 + 3, then times 4?", "Compute 6 * 7 + 1."]
# name: (what drives the rollouts, their scripted turns (None: the rollout_func's own), GRPOConfig options)
CASES = {
    "tools-grpo": ("tools", TOOL_TURNS, dict(loss_type="grpo", epsilon=0.2, entropy_coef=0.01)),
    "tools-dapo": ("tools", TOOL_TURNS, dict(loss_type="dapo", epsilon_high=0.28, beta=0.04,
                                             mask_truncated_completions=True, top_entropy_quantile=0.5)),
    "tools-gspo": ("tools", TOOL_TURNS, dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4,
                                             epsilon_high=4e-4)),  # GSPO's clip range
    "environment-bnpo": ("environment", ENV_TURNS, dict(loss_type="bnpo", importance_sampling_level="sequence")),
    "rollout_func-cispo": ("rollout_func", None, dict(loss_type="cispo", epsilon_high=1.1)),
}


def _trainer_arguments(kind, tokenizer):
    if kind == "tools":
        rows = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS]
        return rows, dict(reward_funcs=length_reward, tools=[add, amul, boom, afail])
    if kind == "environment":
        rows = [{"prompt": [{"role": "user", "content": "Count."}], "target": 3},
                {"prompt": [{"role": "user", "content": "Count on."}], "target": 5}]
        return rows, dict(reward_funcs=None, tools=[add], environment_factory=Counter)
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS]
    return rows, dict(reward_funcs=length_reward, rollout_func=scripted_rollout(tokenizer))


class _FirstGradients(TrainerCallback):
    """Copies every parameter's gradient just before the first optimizer step."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _recording(cls):
    """cls recording the generation batch TRL builds (masks, ids, advantages), and each micro-step's loss and count of
    tokens the tool mask leaves out of the loss."""

    class Recording(cls):
        def __init__(self, *args, **kwargs):
            self.losses, self.batches, self.tool_masked = [], [], []
            super().__init__(*args, **kwargs)

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.tool_masked.append(((inputs["completion_mask"] == 1) & (inputs["tool_mask"] == 0)).sum().item())
            return super().compute_loss(model, inputs, *args, **kwargs)

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(loss.item())
            return loss

        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            self.batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
            return batch

    return Recording


def _train(trainer_cls, case, tokenizer, model_path, tmp_path):
    kind, turns, options = CASES[case]
    rows, arguments = _trainer_arguments(kind, tokenizer)
    args = GRPOConfig(
        output_dir=str(tmp_path / trainer_cls.__name__), per_device_train_batch_size=GROUP, num_generations=GROUP,
        steps_per_generation=2, gradient_accumulation_steps=1, max_steps=2,  # one generation, two optimizer steps
        max_completion_length=MAX_COMPLETION_LENGTH, optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
        max_grad_norm=0.0, report_to=[], use_cpu=True, bf16=False, save_strategy="no", logging_steps=1, seed=0,
        **options,
    )
    gradients = _FirstGradients()
    trainer = _recording(trainer_cls)(model=_load(model_path), args=args, processing_class=copy.deepcopy(tokenizer),
                                      train_dataset=datasets.Dataset.from_list(rows), callbacks=[gradients],
                                      **arguments)
    if turns is not None:
        trainer._generate_single_turn = Script(tokenizer, turns)
    trainer.train()
    trainer.first_grads = gradients.grads
    return trainer


def _assert_same_rollouts(stock, fast):
    """The generation batch: TRL's code on both sides, on scripted samples, so equal exactly."""
    (batch,), (fast_batch,) = stock.batches, fast.batches
    assert batch.keys() == fast_batch.keys()
    for key, value in batch.items():
        if key not in ("old_per_token_logps", "ref_per_token_logps"):  # fastgrpo's own logprobs: compared via the loss
            assert torch.equal(fast_batch[key], value), key


def _assert_masked_middle(trainer):
    """tool_mask zeroes a stretch in the middle of a completion (model tokens after it), and leaves tokens of the
    completion out of the loss in every micro-step."""
    (batch,) = trainer.batches
    mask, tool_mask = batch["completion_mask"], batch["tool_mask"]  # [B, T]
    inner = (tool_mask == 0) & (mask == 1)  # [B, T]
    after = (tool_mask * mask).flip(1).cumsum(1).flip(1) - tool_mask * mask > 0  # a loss token later in the row
    assert (inner & after).any(), "no tool result inside a completion"
    assert len(trainer.tool_masked) == 2 and min(trainer.tool_masked) > 0, trainer.tool_masked


def _gradient_differences(stock, fast):
    """{parameter: max|fast - stock| / max|stock|} of the first step's gradients."""
    assert fast.first_grads.keys() == stock.first_grads.keys() and stock.first_grads
    return {name: (fast.first_grads[name] - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            for name, want in stock.first_grads.items()}


def _assert_same_training(stock, fast, initial, seen):
    """Micro-step losses, first-step gradients, parameters after two steps and logged metrics agree; the largest
    differences go to `seen`."""
    def record(what, value):
        seen[what] = max(seen.get(what, 0.0), value)

    assert len(fast.losses) == len(stock.losses) == 2
    losses, stock_losses = (torch.tensor(run.losses, dtype=torch.float64) for run in (fast, stock))
    diff = (losses - stock_losses).abs()
    record("loss", diff.max().item())
    record("loss/tol", (diff / (LOSS_TOL["atol"] + LOSS_TOL["rtol"] * stock_losses.abs())).max().item())
    torch.testing.assert_close(losses, stock_losses, **LOSS_TOL)

    for name, diff in _gradient_differences(stock, fast).items():
        record("grad_rel", diff)
        assert diff <= GRAD_REL, f"grad of {name}: max|diff| / max|TRL's grad| = {diff:.3e} > {GRAD_REL}"

    moved = 0.0
    fast_params = dict(fast.model.named_parameters())
    for name, p in stock.model.named_parameters():
        diff = (fast_params[name] - p).abs().max().item()
        moved = max(moved, (p - initial[name]).abs().max().item())
        record("param", diff)
        assert diff <= PARAM_ATOL, f"{name} after two steps: max|diff| {diff:.3e} > {PARAM_ATOL}"
    assert moved > 100 * PARAM_ATOL, f"the parameters barely moved ({moved:.1e}): the comparison would be vacuous"

    logs = [[{k: v for k, v in log.items() if k.startswith(METRIC_PREFIXES)} for log in run.state.log_history]
            for run in (stock, fast)]
    stock_logs, fast_logs = ([row for row in run if row] for run in logs)
    assert len(stock_logs) == 2 and [m.keys() for m in fast_logs] == [m.keys() for m in stock_logs]
    for step, (got, want) in enumerate(zip(fast_logs, stock_logs, strict=True)):
        for name, value in want.items():
            record("metric", abs(got[name] - value) if value == value else 0.0)  # NaN: compared below
            torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(value), equal_nan=True,
                                       msg=lambda m, name=name, step=step: f"step {step} {name}: {m}", **LOSS_TOL)
    return stock_logs


@pytest.mark.parametrize("case", list(CASES))
def test_training_with_tools_matches_trl(case, tokenizer, model_path, tmp_path):
    initial = dict(_load(model_path).named_parameters())
    stock = _train(GRPOTrainer, case, tokenizer, model_path, tmp_path)
    fast = _train(FastGRPOTrainer, case, tokenizer, model_path, tmp_path)
    _assert_same_rollouts(stock, fast)
    _assert_masked_middle(stock)
    (batch,) = stock.batches
    assert batch["advantages"].abs().max() > 0.1, "equal rewards: no gradient to compare"
    logs = _assert_same_training(stock, fast, initial, _MAX_DIFF)

    kind, turns, options = CASES[case]
    if kind != "rollout_func":  # the script ran as written: every tool round, every failure TRL counts
        assert stock._generate_single_turn.next == [len(t) for t in turns]
        calls = sum(turn.count("<tool_call>") for sample in turns for turn in sample)
        assert logs[0]["tools/call_frequency"] == pytest.approx(calls / len(turns))
        assert logs[0]["tools/failure_frequency"] > 0
    if options.get("mask_truncated_completions"):  # sample 7 was cut after its tool result: masked whole
        assert (batch["completion_mask"].sum(1) == 0).sum() == 1


def test_ignoring_the_tool_mask_fails(tokenizer, model_path, tmp_path):
    """The comparison catches a fused loss that trains on the tool results: the same rollouts, other gradients."""

    class IgnoresToolMask(FastGRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, {k: v for k, v in inputs.items() if k != "tool_mask"})

    initial = dict(_load(model_path).named_parameters())
    stock = _train(GRPOTrainer, "tools-grpo", tokenizer, model_path, tmp_path)
    wrong = _train(IgnoresToolMask, "tools-grpo", tokenizer, model_path, tmp_path)
    _assert_same_rollouts(stock, wrong)
    with pytest.raises(AssertionError):
        _assert_same_training(stock, wrong, initial, {})
    assert max(_gradient_differences(stock, wrong).values()) > 100 * GRAD_REL
