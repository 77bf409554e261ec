"""A stand-in for the engine in agent tests: `ScriptedEngine.generate` follows Engine.generate's multi-turn protocol
(turns.py: a turn ends on a stop token and goes to turn_end; an answer is appended with tool_mask 0; None finishes
"stop"; max_new_tokens counts everything after the prompt, an answer that does not fit is dropped and finishes
"length") with each turn's tokens taken from a script instead of a model, so that tests choose what the policy
"writes" (tool calls that succeed, fail, time out, overflow) and compare the rest with TRL."""

import json
from pathlib import Path

import torch
from tools_helpers import QWEN_STYLE_TEMPLATE, byte_tokenizer
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from fastgrpo.sampling import Completion, GenerateStats
from fastgrpo.sampling.turns import Turn


def build_agent_assets(root: Path) -> dict:
    """A tiny random Qwen2 (context window 4096) with a byte-level tokenizer and the Qwen2.5-style tool template,
    and conversational arithmetic data (4 train and 4 test rows): {"model": folder, "data": folder}."""
    tokenizer = byte_tokenizer(QWEN_STYLE_TEMPLATE)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    ))  # fmt: skip
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data").mkdir()
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a, b in [(3, 4), (10, 5), (7, 7), (1, 2)]]
    for split in ("train", "test"):
        (root / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(root / "model"), "data": str(root / "data")}


class ScriptedEngine:
    """script(prompt_ids, turn, completion_so_far) -> the turn's token ids (a stop token last to end the turn)."""

    def __init__(self, script, stop_token_ids):
        self.script, self.stop_token_ids = script, set(stop_token_ids)
        self.stats = GenerateStats()
        self.calls = []  # (prompt_token_ids, n) per generate call

    def generate(self, prompt_token_ids, n=1, params=None, group_ids=None, *, first_columns=None, turn_end=None,
                 turn_batch=1):
        self.calls.append((prompt_token_ids, n))
        limit = params.max_new_tokens
        groups = []
        for i, prompt in enumerate(prompt_token_ids):
            group = []
            for j in range(n):
                ids, mask, turn, finish = [], [], 0, None
                while finish is None:
                    tokens = list(self.script(prompt, turn, ids))[: limit - len(ids)]
                    ids += tokens
                    mask += [1] * len(tokens)
                    if not tokens or tokens[-1] not in self.stop_token_ids:
                        finish = "length"
                    elif turn_end is None:
                        finish = "stop" if len(ids) <= limit else "length"
                    else:
                        (answer,) = turn_end([Turn(i, j, turn, tokens, limit - len(ids))])
                        if answer is None:
                            finish = "stop"
                        elif len(ids) + len(answer) > limit:
                            finish = "length"
                        else:
                            ids += answer
                            mask += [0] * len(answer)
                            finish = "length" if len(ids) == limit else None
                    turn += 1
                group.append(Completion(ids, [0.0] * len(ids), finish, mask))
            groups.append(group)
        return groups
