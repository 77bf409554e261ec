"""Build the tiny model that `fastgrpo train` starts from when given no model.

    python -m fastgrpo.train.build_default_model [--output-dir DIR] [--steps N] [--seed S]

A character-level tokenizer (arithmetic.build_tokenizer) and a small Qwen2 trained by supervised next-token loss on
the answer tokens of train-split problems, stopped early on purpose: held-out greedy accuracy is low enough that
GRPO has room to raise it, and high enough that samples at temperature 1 are often right, so groups carry signal.
Same arguments, same weights: seeded init, seeded data order, single-threaded-order-independent CPU math.
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from fastgrpo.train import arithmetic

DEFAULT_OUTPUT_DIR = Path(__file__).parent / "default_model"
DEFAULT_STEPS = 750
DEFAULT_SEED = 0
BATCH_SIZE = 64
LEARNING_RATE = 1e-3
NUM_EVAL_PROBLEMS = 200


def build_model(tokenizer: PreTrainedTokenizerBase, seed: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32
        num_key_value_heads=4,
        max_position_embeddings=32,  # the longest problem is 11 tokens: "-99-99=-198" has no <eos> room issue
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None, do_sample=False
    )
    return model


def encode_batch(tokenizer: PreTrainedTokenizerBase, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+<eos> ids and labels that are -100 everywhere but the answer and <eos>."""
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


def warm_up(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, steps: int, seed: int, log_every: int = 0):
    """`steps` AdamW steps of answer-token cross-entropy on batches of BATCH_SIZE train problems."""
    rows = arithmetic.problems("train", steps * BATCH_SIZE, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    model.train()
    for step in range(steps):
        input_ids, labels = encode_batch(tokenizer, rows[step * BATCH_SIZE : (step + 1) * BATCH_SIZE])
        # Right padding needs no attention mask: pads come after every real token, so causal attention never sees
        # them from a labelled position.
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}: loss {loss.item():.3f}", flush=True)
    model.eval()


@torch.no_grad()
def greedy_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[dict]) -> float:
    """Share of rows whose greedy completion (HF generate, left-padded batch) is correct."""
    prompts = [row[arithmetic.PROMPT_COLUMN] for row in rows]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    # 5 tokens fit the longest answer, "-99" or "198", plus <eos> with one to spare.
    output = model.generate(**batch, max_new_tokens=5, do_sample=False)  # [B, P + new]
    completions = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    rewards = arithmetic.accuracy_reward(prompts, completions, [row[arithmetic.ANSWER_COLUMN] for row in rows])
    return sum(rewards) / len(rows)


def build(output_dir: Path, steps: int, seed: int) -> float:
    tokenizer = arithmetic.build_tokenizer()
    model = build_model(tokenizer, seed)
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
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    start = time.perf_counter()
    accuracy = build(args.output_dir, args.steps, args.seed)
    print(f"saved to {args.output_dir} in {time.perf_counter() - start:.0f} s; "
          f"held-out greedy accuracy {accuracy:.1%} on {NUM_EVAL_PROBLEMS} test problems")  # fmt: skip


if __name__ == "__main__":
    main()
