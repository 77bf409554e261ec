"""Test-wide set-up: the Triton interpreter without a GPU; the `assets` fixture (a tiny model and dataset for
`fastgrpo train` tests)."""

import json
import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    """A tiny random Qwen2 (hidden 64, 2 layers, untied head) with the arithmetic task's character tokenizer, and
    the task's JSONL files (300 train, 24 test rows): {"model": folder, "data": folder}, built once per module."""
    # Imported here, after TRITON_INTERPRET is chosen above.
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from fastgrpo.train import arithmetic

    root = tmp_path_factory.mktemp("assets")
    tokenizer = arithmetic.build_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    ))  # fmt: skip
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data").mkdir()
    for split, num in (("train", 300), ("test", 24)):
        rows = arithmetic.problems(split, num, seed=1)
        (root / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(root / "model"), "data": str(root / "data")}
