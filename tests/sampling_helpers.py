"""Shared helpers of the sampling-engine tests: tiny random Qwen2 / Qwen3 / Llama models with peaked outputs, prompts
of ragged lengths across page boundaries, and independent expectations (HF greedy, full-forward logits, the
logprobs of the processed distribution)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

NUM_WORDS = 125  # vocab 128 with the 3 special tokens
# tiny()'s families as test parameters: qwen2 in the fast run (-m "not slow"), all three in the full run.
FAMILIES = ["qwen2", pytest.param("qwen3", marks=pytest.mark.slow), pytest.param("llama", marks=pytest.mark.slow)]


def tiny(family: str, seed: int = 0):
    """A tiny fp32 model with peaked output distributions (random init std 0.02 makes them almost uniform, and
    greedy ties would then hinge on the last ulp)."""
    common = dict(vocab_size=NUM_WORDS + 3, num_hidden_layers=2, max_position_embeddings=256, eos_token_id=1,
                  pad_token_id=0, bos_token_id=1, tie_word_embeddings=False)
    if family == "qwen2":  # 4 query heads on 2 KV heads
        model_cls, config = Qwen2ForCausalLM, Qwen2Config(hidden_size=64, intermediate_size=128,
                                                          num_attention_heads=4, num_key_value_heads=2, **common)
    elif family == "qwen3":  # q/k norms, explicit head_dim
        model_cls, config = Qwen3ForCausalLM, Qwen3Config(hidden_size=64, intermediate_size=128, head_dim=16,
                                                          num_attention_heads=4, num_key_value_heads=4, **common)
    else:  # 6 query heads on 1 KV head
        model_cls, config = LlamaForCausalLM, LlamaConfig(hidden_size=96, intermediate_size=128,
                                                          num_attention_heads=6, num_key_value_heads=1, **common)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    return model


def prompts_for(block_size: int, seed: int = 0) -> list[list[int]]:
    """Ragged lengths at and across page boundaries."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 1, 37]
    return [torch.randint(3, NUM_WORDS + 3, (n,), generator=g).tolist() for n in lengths if n > 0]


def hf_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


NO_STOP = dict(stop_token_ids=())


def full_forward_logits(model, prompt, completion):
    """[len(completion), V] fp32 logits that predicted each completion token, from one plain forward pass."""
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def expected_logprobs(logits, tokens, temperature, top_k, top_p):
    """Log-softmax of the processed logits at `tokens`, written out independently of the sampler."""
    z = logits / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k:
        keep &= z >= z.topk(top_k, dim=-1).values[:, -1:]
    if top_p < 1:
        for row in range(z.shape[0]):
            order = z[row].masked_fill(~keep[row], float("-inf")).argsort(descending=True)
            probs = z[row].masked_fill(~keep[row], float("-inf")).softmax(0)[order]
            mass, kept = 0.0, torch.zeros_like(keep[row])
            for token, p in zip(order.tolist(), probs.tolist(), strict=True):
                if mass >= top_p:
                    break
                kept[token], mass = True, mass + p
            keep[row] &= kept
    logp = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
