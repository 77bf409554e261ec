"""The README example of "Using fastgrpo from TRL", runnable offline on a CPU in seconds.

The README trains a hub model; here a tiny random-weight Qwen2 saved to a temporary folder is passed by path the
same way (`model=<id or path>`: TRL loads it), with a word-level tokenizer passed as `processing_class` (from the
folder, transformers would pick Qwen2's BPE tokenizer class for it), so that the example runs without network or
GPU. Below the "as in the README" line is the README's code, with smaller sizes and that one extra argument; the
last lines print how far training moved the weights.

    python examples/trl_grpo_tiny.py
"""

import tempfile

import tokenizers
import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

path = tempfile.mkdtemp()
vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(200)}}
backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
torch.manual_seed(0)  # the same tiny model every run (TRL seeds the rest: GRPOConfig.seed)
initial = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       pad_token_id=0, eos_token_id=1, bos_token_id=1))
initial.save_pretrained(path)
dataset = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(64)]})

# -- as in the README ------------------------------------------------------------------------------------------------
from trl import GRPOConfig  # noqa: E402

from fastgrpo.integrations.trl import FastGRPOTrainer as GRPOTrainer  # noqa: E402  (was: from trl import GRPOTrainer)


def reward_short(completions, **kwargs):
    """Prefer completions of about 5 words."""
    return [-abs(5 - len(completion.split())) for completion in completions]


trainer = GRPOTrainer(
    model=path,
    reward_funcs=reward_short,
    args=GRPOConfig(output_dir=tempfile.mkdtemp(), loss_type="dapo", beta=0.04, num_iterations=2,
                    per_device_train_batch_size=8, num_generations=4, max_completion_length=16, max_steps=3,
                    logging_steps=1, report_to=[], use_cpu=True, bf16=False),
    train_dataset=dataset,
    processing_class=tokenizer,  # not in the README: see the module docstring
)
trainer.train()
print({k: v for k, v in trainer.state.log_history[-2].items() if k in ("loss", "reward", "kl", "entropy")})

# not in the README: how far training moved the weights, the largest change of any parameter since the saved model
trained = trainer.model.state_dict()
change = max((trained[name] - weight).abs().max().item() for name, weight in initial.state_dict().items())
print(f"max parameter change: {change:.3e}")
