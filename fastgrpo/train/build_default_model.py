"""Build the tiny model that `fastgrpo train` starts from when given no model.

    python -m fastgrpo.train.build_default_model [--output-dir DIR] [--steps N] [--seed S] [--architecture A]

The character tokenizer of `arithmetic.build_tokenizer` and a 2-layer Llama (0.53M parameters, 2.1 MB of fp32),
trained with cross-entropy on the answer tokens of train-split problems and stopped early on purpose. At 340 steps
it gets 28% of the 2,005 held-out problems right greedily (the curve is steep and noisy there: 15% at 290 steps,
31% at 335), and its samples at temperature 1 are right 13% of the time, so 60% of GRPO groups of 8 hold both a
right and a wrong answer to learn from.

Llama rather than Qwen2: transformers 5 loads any qwen2 checkpoint's tokenizer as Qwen2Tokenizer, whatever
tokenizer_config.json says, and that class swaps in byte-level pre-tokenization that drops unknown characters.

`--architecture qwen3_5` builds a tiny Qwen3.5 instead (hidden 128: 3 Gated DeltaNet layers and 1 gated-attention
layer, 1.0M parameters), the hybrid the GRPO users of 2026 start from, warmed up the same way; it is not shipped
(benchmarks/results/train-qwen3-5-tiny-*.md records a run from it). `--architecture qwen3_moe` builds a tiny
Qwen3-MoE (hidden 128, 2 layers of 8 experts of width 256, 2 a token, renormalised as Qwen3-30B-A3B's; 1.7M
parameters, 0.6M active), for routing replay's comparison (benchmarks/results/routing-replay-*.md).

Same arguments, same torch build: same weights (seeded init, seeded data order, the same 2 CPU threads).
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fastgrpo.train import arithmetic

DEFAULT_OUTPUT_DIR = Path(__file__).parent / "default_model"
DEFAULT_STEPS = 340  # 28% held-out greedy accuracy; see the module docstring
DEFAULT_SEED = 0
BATCH_SIZE = 64
LEARNING_RATE = 1e-3  # 3e-3 barely learns: 1-8% held-out accuracy up to 1000 steps, against 72% at 1e-3 after 600
NUM_EVAL_PROBLEMS = 200
# The longest answer, "198", and <eos> take 4 tokens; one to spare shows a model that does not stop.
MAX_NEW_TOKENS = 5


# architecture -> (model_type, its options beside the shared ones) of the ones built from transformers' configs
OTHERS = {
    "qwen3_5": ("qwen3_5_text", dict(intermediate_size=512, num_hidden_layers=4, num_key_value_heads=2,
                                     layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                                     linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=2, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=256, norm_topk_prob=True)),
}
ARCHITECTURES = ("llama", *OTHERS)


def build_model(tokenizer: PreTrainedTokenizerBase, seed: int, architecture: str = "llama") -> PreTrainedModel:
    """A freshly initialised tiny Llama (or Qwen3.5, Qwen3-MoE) whose generation config stops at <eos> and pads with
    <pad>."""
    if architecture in OTHERS:
        model_type, options = OTHERS[architecture]
        config = AutoConfig.for_model(
            model_type, vocab_size=len(tokenizer), hidden_size=128, num_attention_heads=4, head_dim=32,
            max_position_embeddings=32, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **options,
        )  # fmt: skip
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                                   pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                                                   do_sample=False)  # fmt: skip
        return model
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32
        num_key_value_heads=4,
        max_position_embeddings=32,  # the longest problem, "99+99=198<eos>", is 10 tokens
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


def encode_batch(tokenizer: PreTrainedTokenizerBase, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+<eos> ids, and labels that are -100 everywhere but on the answer and <eos>."""
    sequences, labels = [], []
    for row in rows:
        prompt = tokenizer(row[arithmetic.PROMPT_COLUMN])["input_ids"]
        answer = tokenizer(row[arithmetic.ANSWER_COLUMN])["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, sequences))
    input_ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in sequences])  # [B, L]
    label_ids = torch.tensor([s + [-100] * (width - len(s)) for s in labels])  # [B, L]
    return input_ids, label_ids


def warm_up(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, steps: int, seed: int) -> None:
    """`steps` AdamW steps, each on the next BATCH_SIZE problems of the seeded train-split order."""
    rows = arithmetic.problems("train", steps * BATCH_SIZE, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    model.train()
    for step in range(steps):
        input_ids, labels = encode_batch(tokenizer, rows[step * BATCH_SIZE : (step + 1) * BATCH_SIZE])
        # No attention mask: the padding follows every real token, so causal attention never reads it from a
        # labelled position, and positions count from 0 at the prompt's first character as when sampling.
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()


@torch.no_grad()
def greedy_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[dict]) -> float:
    """Share of rows whose greedy completion (HF generate on one left-padded batch) is right."""
    prompts = [row[arithmetic.PROMPT_COLUMN] for row in rows]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    output = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)  # [B, P + new]
    completions = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    rewards = arithmetic.accuracy_reward(prompts, completions, [row[arithmetic.ANSWER_COLUMN] for row in rows])
    return sum(rewards) / len(rows)


def build(output_dir: Path, steps: int, seed: int, architecture: str = "llama") -> float:
    """Build, warm up and save the model and tokenizer to `output_dir`; return its held-out greedy accuracy."""
    tokenizer = arithmetic.build_tokenizer()
    model = build_model(tokenizer, seed, architecture)
    warm_up(model, tokenizer, steps, seed)
    accuracy = greedy_accuracy(model, tokenizer, arithmetic.problems("test", NUM_EVAL_PROBLEMS))
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return accuracy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="llama")
    args = parser.parse_args(argv)
    # 2 threads everywhere: the shipped weights were built with 2, and the thread count can change the order of
    # floating-point sums. The model is too small to gain from more (6 s for 300 steps).
    torch.set_num_threads(2)
    start = time.perf_counter()
    accuracy = build(args.output_dir, args.steps, args.seed, args.architecture)
    print(f"saved to {args.output_dir} in {time.perf_counter() - start:.0f} s; "
          f"held-out greedy accuracy {accuracy:.1%} on {NUM_EVAL_PROBLEMS} test problems")  # fmt: skip


if __name__ == "__main__":
    main()
