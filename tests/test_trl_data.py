"""A TRL user's data and reward functions in `fastgrpo train`, unchanged.

A tiny random Qwen2 with a one-token-per-character tokenizer that has a chat template stands in for a chat model.
Datasets are TRL's: conversational prompts (lists of {"role", "content"} messages) with the answers in a `solution`
column, or string prompts. Rewards and advantages are compared with what stock TRL 1.16 computes on the same
completions with its own code (tests/trl_oracle.py runs `GRPOTrainer._generate_and_score_completions` with only the
sampling step replaced), and the keyword arguments reward functions receive with those TRL passes.
"""

import json
import string

import pytest

pytest.importorskip("trl")
pytest.importorskip("math_verify")

import torch  # noqa: E402
from helpers import tiny_config  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    TrainerState,
)
from trl.rewards import accuracy_reward, think_format_reward  # noqa: E402
from trl_oracle import trl_rewards_and_advantages  # noqa: E402

from fastgrpo.train import TrainConfig, Trainer  # noqa: E402
from fastgrpo.train.data import load_rows, prepare  # noqa: E402
from fastgrpo.train.loading import load_tokenizer  # noqa: E402
from fastgrpo.train.logs import COMPLETIONS_FILE, read_metrics  # noqa: E402
from fastgrpo.train.rewards import RewardError, Rewards  # noqa: E402
from fastgrpo.train.rollout import decoupled_advantages, group_advantages  # noqa: E402

G = 4
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SYSTEM = "Think in <think></think>, answer in \\boxed{}."
CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 1/2 + 1/4?"}],
     "solution": "\\frac{3}{4}", "level": 1},
    {"prompt": [{"role": "user", "content": "What is 6 * 7?"}], "solution": "42", "level": 2},
    {"prompt": [{"role": "user", "content": "Say hi."}], "solution": "no math here", "level": 3},  # gold unparseable
]
# Completions written by hand so that every reward takes both values: right and wrong answers, with and without the
# think block (TRL's accuracy_reward returns None for the whole third group: its gold does not parse).
COMPLETIONS = [
    "<think>1/2 = 2/4</think> \\boxed{\\frac{3}{4}}", "\\boxed{\\frac{3}{4}}", "<think>hm</think> \\boxed{1}", "no",
    "<think>6*7</think> \\boxed{42}", "\\boxed{41}", "<think>x</think>42", "\\boxed{42}",
    "<think>hi</think> hi", "hi", "<think>", "hello there",
]

# A user's reward functions, imported by the trainer from a file as `path:function` ---------------------------------
USER_REWARDS = '''
CALLS = []

def half(prompts, completions, completion_ids, **kwargs):
    """None for every other sample: TRL's "does not apply"."""
    return [None if i % 2 else float(len(ids)) / 10 for i, ids in enumerate(completion_ids)]

def never(prompts, completions, **kwargs):
    return [None] * len(completions)

def shapes(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    """Asserts the argument shapes TRL passes and records them."""
    n = len(completions)
    assert len(prompts) == len(completion_ids) == n and all(len(v) == n for v in kwargs.values())
    for prompt, completion in zip(prompts, completions):
        if isinstance(prompt, list):
            assert all(set(m) >= {"role", "content"} for m in prompt), prompt
            assert isinstance(completion, list) and len(completion) == 1, completion
            assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
        else:
            assert isinstance(prompt, str) and isinstance(completion, str)
    assert all(isinstance(i, int) for ids in completion_ids for i in ids)
    assert hasattr(trainer_state, "global_step") and callable(log_extra) and callable(log_metric)
    log_metric("shapes/calls", 1.0)
    log_extra("shapes_n", [n] * n)
    CALLS.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs))
    return [0.0] * n
'''


def char_tokenizer() -> PreTrainedTokenizerFast:
    """<pad> 0, <eos> 1, <unk> 2, then one token per printable ASCII character; a chat template."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *string.printable])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<pad>", "<eos>", "<unk>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> dict:
    """A tiny chat policy, a tiny reward model (same tokenizer), the datasets and the user's reward file."""
    root = tmp_path_factory.mktemp("trl_data")
    tokenizer = char_tokenizer()
    config = tiny_config(Qwen2Config, len(tokenizer))
    config.max_position_embeddings = 256
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    reward_model = Qwen2ForSequenceClassification(Qwen2Config(**{**config.to_dict(), "num_labels": 1}))
    with torch.no_grad():
        reward_model.score.weight.normal_(0.0, 1.0)  # scores that differ from sample to sample
    reward_model.save_pretrained(root / "reward-model")
    tokenizer.save_pretrained(root / "reward-model")
    plain = [{**r, "prompt": r["prompt"][-1]["content"]} for r in CHAT_ROWS]
    for name, rows in (("chat", CHAT_ROWS), ("plain", plain)):
        (root / name).mkdir()
        for split in ("train", "test"):
            (root / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "user_rewards.py").write_text(USER_REWARDS)
    return {"root": root, "policy": str(root / "policy"), "reward_model": str(root / "reward-model"),
            "user": str(root / "user_rewards.py")}


def config_for(chat, tmp_path, data="chat", **overrides) -> TrainConfig:
    values = dict(model_name_or_path=chat["policy"], dataset_name=str(chat["root"] / data),
                  output_dir=str(tmp_path / "run"), num_generations=G, per_device_train_batch_size=12,
                  max_completion_length=12, max_steps=2, save_steps=0, eval_num_samples=3, report_to=["none"],
                  disable_tqdm=True, seed=3, max_prompt_length=None, learning_rate=1e-3,
                  reward_funcs=["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward"])
    return TrainConfig(**{**values, **overrides})


def user_module(trainer):
    """The module the trainer loaded the user's reward file as (its functions' globals)."""
    function = next(f for f in trainer.rewards.functions if getattr(f, "__module__", None) == "user_rewards")
    assert all(f.__globals__ is function.__globals__ for f in trainer.rewards.functions
               if getattr(f, "__module__", None) == "user_rewards"), "one file, one module"
    return type("UserModule", (), function.__globals__)


def ours(chat, tmp_path, data, reward_funcs, weights=None, **overrides):
    """fastgrpo's rewards per function and advantages for COMPLETIONS, through the trainer's own scoring."""
    trainer = Trainer(config_for(chat, tmp_path, data, reward_funcs=reward_funcs, reward_weights=weights,
                                 **overrides))
    trainer.step = 1
    ids = [trainer.tokenizer(text, add_special_tokens=False).input_ids + [trainer.tokenizer.eos_token_id]
           for text in COMPLETIONS]
    outputs = [[type("Completion", (), {"token_ids": ids[p * G + g]}) for g in range(G)] for p in range(len(CHAT_ROWS))]
    prompts = list(range(len(CHAT_ROWS)))
    sampled = trainer._plain_sampled(trainer.train_prompts, prompts, outputs)
    per_func, total = trainer._score([p for p in prompts for _ in range(G)], sampled)
    if trainer.config.multi_objective_aggregation == "normalize_then_sum":
        advantages, _ = decoupled_advantages(per_func, trainer.rewards.weights, G)
    else:
        advantages, _, _ = group_advantages(total, G, trainer.config.scale_rewards)
    return trainer, ids, per_func, advantages


@pytest.mark.parametrize("data", ["chat", "plain"])
def test_rewards_and_advantages_equal_stock_trl(chat, tmp_path, data):
    """TRL's accuracy_reward (None for an unparseable gold), think_format_reward and a function returning None for
    half the samples, weighted: rewards per function and advantages equal stock TRL's on the same completions, and
    a function asserting TRL's argument shapes receives what TRL passes."""
    user = chat["user"]
    # TRL's accuracy_reward and think_format_reward read conversational completions only; string data gets
    # fastgrpo's built-in format reward (which reads either form) in their place.
    first = ["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward"] if data == "chat" else ["format"]
    funcs = [*first, f"{user}:half", f"{user}:shapes"]
    weights = [1.0, 0.5, 2.0, 1.0][-len(funcs):]
    trainer, ids, per_func, advantages = ours(chat, tmp_path, data, funcs, weights)
    module = user_module(trainer)
    ours_call = module.CALLS.pop()
    rows = [json.loads(line) for line in (chat["root"] / data / "train.jsonl").read_text().splitlines()]
    from fastgrpo.train.rewards import format as format_reward

    trl_funcs = [accuracy_reward, think_format_reward] if data == "chat" else [format_reward]
    trl_funcs += [module.half, module.shapes]
    trl_per_func, trl_advantages, calls = trl_rewards_and_advantages(
        chat["policy"], rows, trl_funcs, ids, num_generations=G, reward_weights=weights,
        processing_class=trainer.tokenizer)
    module.CALLS.pop()
    torch.testing.assert_close(per_func, trl_per_func, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(advantages, trl_advantages, rtol=1e-6, atol=1e-6)
    assert per_func[:, -2].isnan().sum() == len(ids) // 2  # the Nones were there
    if data == "chat":
        assert per_func[:, 0].isnan().sum() == G and set(per_func[:, 0].nan_to_num(-1).tolist()) == {-1.0, 0.0, 1.0}
        assert set(per_func[:, 1].tolist()) == {0.0, 1.0}

    (trl_call,) = [c for c in calls if c.get("completion_ids") is not None and "log_metric" in c][-1:]
    for key in ("prompts", "completions", "completion_ids", "solution", "level"):
        assert ours_call[key] == trl_call[key], key
    assert isinstance(trl_call["trainer_state"], TrainerState)


def test_normalize_then_sum_equals_stock_trl(chat, tmp_path):
    """GDPO (multi_objective_aggregation="normalize_then_sum"): each function normalised within its group, summed
    with the weights, normalised over the batch; a function returning None for half the samples and an unscorable
    sample included. Advantages equal stock TRL's on the same completions."""
    funcs = ["trl.rewards:accuracy_reward", f"{chat['user']}:half"]  # samples 9 and 11: both None
    weights = [1.0, 2.0]
    with pytest.warns(UserWarning, match="every reward function returned None"):
        trainer, ids, per_func, advantages = ours(chat, tmp_path, "chat", funcs, weights,
                                                  multi_objective_aggregation="normalize_then_sum")
    rows = [json.loads(line) for line in (chat["root"] / "chat" / "train.jsonl").read_text().splitlines()]
    module = user_module(trainer)
    trl_per_func, trl_advantages, _ = trl_rewards_and_advantages(
        chat["policy"], rows, [accuracy_reward, module.half], ids, num_generations=G,
        reward_weights=weights, multi_objective_aggregation="normalize_then_sum", processing_class=trainer.tokenizer)
    torch.testing.assert_close(per_func, trl_per_func, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(advantages, trl_advantages, rtol=1e-5, atol=1e-5)
    assert advantages.abs().max() > 0.1 and advantages[[9, 11]].tolist() == [0.0, 0.0]
    with pytest.warns(UserWarning, match="every reward function returned None"):
        _, sum_first = ours(chat, tmp_path / "sum", "chat", funcs, weights)[2:]
    assert not torch.allclose(advantages, sum_first, atol=1e-3)  # the two aggregations differ on this data


def test_unscorable_samples_get_advantage_zero_with_a_warning(chat, tmp_path):
    """Samples for which every function returned None (accuracy_reward on an unparseable gold, and `half` on every
    other sample: samples 9 and 11): NaN reward, left out of their group's mean and std, advantage 0, a warning
    naming the first; equal to TRL's."""
    funcs = ["trl.rewards:accuracy_reward", f"{chat['user']}:half"]
    with pytest.warns(UserWarning, match=r"every reward function returned None for 2 of 12 samples \(the first: "
                                         r"sample 9"):
        trainer, ids, per_func, advantages = ours(chat, tmp_path, "chat", funcs)
    rows = [json.loads(line) for line in (chat["root"] / "chat" / "train.jsonl").read_text().splitlines()]
    module = user_module(trainer)
    trl_per_func, trl_advantages, _ = trl_rewards_and_advantages(
        chat["policy"], rows, [accuracy_reward, module.half], ids, num_generations=G,
        processing_class=trainer.tokenizer)
    torch.testing.assert_close(per_func, trl_per_func, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(advantages, trl_advantages, rtol=1e-6, atol=1e-6)
    assert advantages[[9, 11]].tolist() == [0.0, 0.0] and advantages[[8, 10]].abs().min() > 0.5  # +-1/sqrt(2)


def test_non_finite_rewards_other_than_none_stay_refused(chat):
    bad = Rewards([f"{chat['user']}:half", "format"], None, 8)
    bad.functions[1] = lambda prompts, completions, **kw: [float("nan"), 0.0]
    with pytest.raises(RewardError, match=r"'format' returned nan for sample 0 .* or None where the function does "
                                          "not apply"):
        bad(["p", "q"], ["a", "b"], [[1], [2]], {})


def test_a_reward_model_scores_prompt_and_completion_as_trl(chat, tmp_path):
    """A sequence-classification model by path in reward_funcs: the chat-templated prompt + completion, the logit of
    class 0, no gradient; equal to TRL's scores for the same completions."""
    trainer, ids, per_func, advantages = ours(chat, tmp_path, "chat", [chat["reward_model"], "format"])
    model = trainer.rewards.functions[0].model
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert trainer.rewards.functions[0].__name__ == "reward-model"
    rows = [json.loads(line) for line in (chat["root"] / "chat" / "train.jsonl").read_text().splitlines()]
    from fastgrpo.train.rewards import format as format_reward

    trl_per_func, trl_advantages, _ = trl_rewards_and_advantages(
        chat["policy"], rows, [chat["reward_model"], format_reward], ids, num_generations=G,
        processing_class=trainer.tokenizer, reward_processing_classes=[trainer.tokenizer, None])
    torch.testing.assert_close(per_func, trl_per_func, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(advantages, trl_advantages, rtol=1e-4, atol=1e-5)
    assert per_func[:, 0].std() > 0


def test_conversational_prompts_go_through_the_chat_template(chat, tmp_path):
    """A system message in the data wins over system_prompt; a prompt without one gets it first."""
    config = config_for(chat, tmp_path, system_prompt="Be brief.")
    tokenizer = load_tokenizer(config)
    prompts = prepare(load_rows(config, "train"), tokenizer, config, "train")
    assert prompts.answer_column == "solution" and prompts.conversational
    assert tokenizer.decode(prompts.token_ids[0]) == f"<|system|>{SYSTEM}\n<|user|>What is 1/2 + 1/4?\n<|assistant|>"
    assert tokenizer.decode(prompts.token_ids[1]) == "<|system|>Be brief.\n<|user|>What is 6 * 7?\n<|assistant|>"
    assert prompts.prompts[1] == [{"role": "system", "content": "Be brief."}, CHAT_ROWS[1]["prompt"][0]]


def test_bad_conversational_prompts_name_the_row(chat, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"content": "no role"}], "solution": "1"}) + "\n")
    config = config_for(chat, tmp_path, dataset_name=str(bad), dataset_test_split=None)
    with pytest.raises(ValueError, match=rf"{bad}, row 1 \(line 1\): prompt column 'prompt' holds a list, so each "
                                         r"item must be a message .*item 0 is \{'content': 'no role'\}"):
        prepare(load_rows(config, "train"), load_tokenizer(config), config, "train")
    tokenizer = load_tokenizer(config)
    tokenizer.chat_template = None
    bad.write_text(json.dumps(CHAT_ROWS[1]) + "\n")
    with pytest.raises(ValueError, match=r"row 1 \(line 1\): prompt column 'prompt' holds messages, which need a "
                                         "tokenizer with a chat template"):
        prepare(load_rows(config, "train"), tokenizer, config, "train")


def test_answer_column_only_for_the_accuracy_reward(chat, tmp_path):
    """Data without any answer column trains with other rewards (no evaluation); the built-in accuracy reads TRL's
    `solution`, and without any answer column it is refused naming answer_column."""
    no_answers = tmp_path / "prompts.jsonl"
    no_answers.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in CHAT_ROWS))
    config = config_for(chat, tmp_path, dataset_name=str(no_answers), dataset_test_split=None, max_steps=1,
                        reward_funcs=["format", f"{chat['user']}:half"])
    summary = Trainer(config).train()
    assert summary["initial_accuracy"] is None and summary["steps"] == 1
    with pytest.raises(ValueError, match="answer_column: column 'answer' is not in the train data .*the built-in "
                                         "accuracy reward reads the reference answers from it"):
        Trainer(config_for(chat, tmp_path / "b", dataset_name=str(no_answers), dataset_test_split=None,
                           reward_funcs=["accuracy"]))
    trainer, ids, per_func, _ = ours(chat, tmp_path / "c", "chat", ["accuracy"])
    assert per_func[:, 0].tolist() == [1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0]


@pytest.mark.slow
def test_fastgrpo_train_on_trl_conversational_data(chat, tmp_path):
    """`fastgrpo train` on a conversational dataset with TRL's reward functions and one that returns None for half
    the samples: it trains, evaluates pass@1 on the conversational held-out split, logs TRL's metric names, what the
    functions logged with log_metric, and with log_completions every sample and the log_extra columns."""
    user = chat["user"]
    config = config_for(chat, tmp_path, log_completions=True,
                        reward_funcs=["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward",
                                      f"{user}:half", f"{user}:shapes"])
    summary = Trainer(config).train()
    assert summary["steps"] == 2 and summary["initial_accuracy"] is not None
    metrics = read_metrics(tmp_path / "run")
    last = metrics[-1]
    for key in ("rewards/accuracy_reward/mean", "rewards/think_format_reward/mean", "rewards/half/mean", "reward",
                "reward_std", "loss", "eval/accuracy"):
        assert key in last, key
    assert last["shapes/calls"] == 1.0 and last["rewards/half/mean"] is not None
    rows = read_metrics(tmp_path / "run", file=COMPLETIONS_FILE)
    assert len(rows) == 2 * 12 and {r["step"] for r in rows} == {1, 2}
    assert rows[0]["prompt"][-1]["role"] == "user" and isinstance(rows[0]["completion"], str)
    assert rows[0]["shapes_n"] == 12 and "rewards/half" in rows[0] and "advantage" in rows[0]
    assert sum(r["rewards/half"] is None for r in rows) == 12


def test_async_reward_functions_are_awaited(chat, tmp_path):
    (tmp_path / "async_rewards.py").write_text(
        "async def length(prompts, completions, completion_ids, **kwargs):\n"
        "    return [float(len(ids)) for ids in completion_ids]\n")
    per_func, total = Rewards([f"{tmp_path / 'async_rewards.py'}:length"], None, 8)(
        ["p", "q"], ["a", "bc"], [[5], [6, 7]], {})
    assert per_func[:, 0].tolist() == [1.0, 2.0] and total.tolist() == [1.0, 2.0]
