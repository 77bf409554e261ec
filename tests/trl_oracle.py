"""An oracle for rewards and advantages: stock TRL 1.16 scores completions *we* choose, with its own code.

`trl_rewards_and_advantages` builds a real `trl.GRPOTrainer` (CPU, fp32, beta 0, one generation batch of N = P * G
samples, one optimizer step per generation so no model forward runs) and calls its
`_generate_and_score_completions` on the inputs its RepeatSampler would yield (each dataset row repeated G times,
prompt-major). Only three things on that trainer *instance* are replaced; nothing of TRL's is copied:

- `_generate_single_turn` (the narrowest generation hook: the sampling step itself) returns the given completion ids
  instead of calling `model.generate`. Everything around it runs unchanged: prompt tokenization / chat templating in
  `_tokenize_prompts`, decoding in `_generate` (`batch_decode(skip_special_tokens=True)`, the conversational
  `[{"role": "assistant", "content": ...}]` wrapping, or `parse_response` for tokenizers with a response schema),
  padding / masks, `_calculate_rewards` and the nansum / nanmean / nanstd advantage code with its unscorable-row rule.
  Real generation stops at the first EOS (it masks and drops everything after it), so ids with an EOS before their
  last position are rejected here: TRL could never have produced them. Whether the ids end with EOS is kept as given.
- `_calculate_rewards` is wrapped to capture its return value, the [N, F] rewards per function (None -> NaN).
- Each *Python* reward function in `trainer.reward_funcs` is wrapped (after construction, so TRL's reward-function
  names, which come from `__name__`, are unchanged; an async function gets an async wrapper, so TRL still takes its
  async path) to record the keyword arguments TRL passed it. Reward models (nn.Module) are left as they are.
"""

import copy
import functools
import json
import tempfile
from pathlib import Path

import datasets
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import is_async_callable

GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _recording(func, calls):
    """`func` wrapped to append a shallow copy of each call's keyword arguments to `calls` (sync or async alike)."""
    if is_async_callable(func):
        async def wrapper(**kwargs):
            calls.append(dict(kwargs))
            return await func(**kwargs)
    else:
        def wrapper(**kwargs):
            calls.append(dict(kwargs))
            return func(**kwargs)
    return functools.update_wrapper(wrapper, func) if hasattr(func, "__name__") else wrapper


def load_tokenizer(model_dir):
    """The tokenizer saved in model_dir. A folder whose tokenizer_config.json names the generic fast class (what
    `word_tokenizer(...).save_pretrained` writes) is loaded as exactly its tokenizer.json: transformers 5's
    AutoTokenizer would rebuild it as the config's model-type tokenizer (a Qwen2 byte-level BPE, which encodes "w1 w2"
    to [] and decodes without spaces)."""
    config = Path(model_dir) / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


def trl_rewards_and_advantages(model_dir, dataset_rows, reward_funcs, completion_ids, *, num_generations,
                               reward_weights=None, scale_rewards="group", chat_template_kwargs=None,
                               multi_objective_aggregation="sum_then_normalize", processing_class=None,
                               reward_processing_classes=None):
    """TRL's rewards per function and advantages for the given completions.

    Args:
        model_dir: folder holding a saved causal LM and its tokenizer (with a chat template for conversational rows).
        dataset_rows: P dicts in TRL's format ("prompt": a string or a list of {"role", "content"} messages, plus any
            other columns, which TRL passes to reward functions).
        reward_funcs: a callable, a reward-model path string, or a list of them, as `GRPOTrainer` accepts.
        completion_ids: N = P * num_generations lists of token ids; sample i belongs to row i // num_generations.
        num_generations, reward_weights, scale_rewards, chat_template_kwargs, multi_objective_aggregation: the
            `GRPOConfig` options of the same names.
        processing_class: the policy's tokenizer; None: `load_tokenizer(model_dir)`.
        reward_processing_classes: passed to `GRPOTrainer` as is (None: TRL loads each reward model's tokenizer with
            `AutoTokenizer`, which turns a word-level tokenizer saved next to a Qwen2 config into a byte-level one).

    Returns:
        rewards_per_func: [N, F] fp32, NaN where a function returned None.
        advantages: [N] fp32, as `_generate_and_score_completions` returns them.
        calls: one dict per call of each Python reward function: the keyword arguments TRL passed it.
    """
    num_prompts = len(dataset_rows)
    n = num_prompts * num_generations
    completion_ids = [list(map(int, ids)) for ids in completion_ids]
    if len(completion_ids) != n:
        raise ValueError(f"{len(completion_ids)} completions for {num_prompts} prompts x {num_generations} generations")
    if not all(completion_ids):
        raise ValueError("empty completion: TRL's generation always yields at least one token (and its logging "
                         "code indexes ids[-1])")

    tokenizer = processing_class if processing_class is not None else load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = datasets.Dataset.from_list(dataset_rows)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=n, num_generations=num_generations,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, beta=0.0,
            max_completion_length=max(map(len, completion_ids)), reward_weights=reward_weights,
            scale_rewards=scale_rewards, chat_template_kwargs=chat_template_kwargs,
            multi_objective_aggregation=multi_objective_aggregation, report_to="none", use_cpu=True, bf16=False,
            save_strategy="no", logging_strategy="no", seed=0,
        )
        funcs = list(reward_funcs) if isinstance(reward_funcs, list) else reward_funcs  # TRL edits the list in place
        trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=dataset,
                              processing_class=tokenizer, reward_processing_classes=reward_processing_classes)
    trainer.model.train()  # mode "train", as in a training step (num_generations, not num_generations_eval)

    eos_ids = set(trainer.eos_token_ids)
    for i, ids in enumerate(completion_ids):
        if eos_ids.intersection(ids[:-1]):
            raise ValueError(f"completion {i} has an EOS before its last token; TRL's generation cuts there: {ids}")

    def given_completions(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        assert len(prompt_ids) == n, (len(prompt_ids), n)
        return copy.deepcopy(completion_ids), None  # (completion ids, sampling logprobs: none off vLLM)

    captured = {}
    calculate_rewards = trainer._calculate_rewards

    def capture_rewards(*a, **kw):
        captured["rewards_per_func"] = calculate_rewards(*a, **kw)
        return captured["rewards_per_func"]

    calls = []
    trainer.reward_funcs = [f if isinstance(f, nn.Module) else _recording(f, calls) for f in trainer.reward_funcs]
    trainer._generate_single_turn = given_completions
    trainer._calculate_rewards = capture_rewards

    inputs = [dataset[i] for i in range(num_prompts) for _ in range(num_generations)]  # RepeatSampler's order
    output = trainer._generate_and_score_completions(inputs)
    return captured["rewards_per_func"].float().cpu(), output["advantages"].float().cpu(), calls
