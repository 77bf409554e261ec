"""Agent rollouts of 3 turns (a tool call, a second call, the answer): the engine's continuation against TRL 1.16's
re-prefill loop, on the same model, prompts and tools, greedy: tokens computed and wall time, in one run.

- TRL: a real `trl.GRPOTrainer` (use_vllm False, CPU, fp32, tools=[add, multiply]). Its `_generate(prompts)` renders
  the prompts, samples with HF `generate` (`_generate_single_turn`) and runs `_tool_call_loop`, which after every
  tool call generates again from the prompt, every earlier turn and the tool results. Its tokens computed are read
  from the inputs and outputs of `_generate_single_turn` (per row: the prompt so far, and the new tokens but the
  last); beside them, the positions its model's forwards ran (a forward pre-hook), which add the left padding and
  the rows that had already finished.
- fastgrpo: `Engine.generate(..., turn_end=...)`, each turn parsed, run and answered with fastgrpo.train.tools
  (ToolChat.parse, ToolRunner.run, ToolChat.suffix_ids). A sequence keeps its KV pages, the tool turn is prefilled as
  a continuation, and every position is computed once (`engine.stats`).

Both sides' completion ids, tool masks and tool messages must equal each other and the script below, or the suite
fails. The two run in one process on the same model object, interleaved round by round (the order alternating), so
that a machine whose speed drifts slows both alike; the time ratio is the median of the rounds' ratios (each TRL run
over the engine run beside it).

The model recites a script. A random model calls no tools, so prompt i asks "Add a and b, then multiply the sum by
c." and its rollout is add(a, b), then multiply(a + b, c), then "The answer is ...". A 2-layer, hidden-64 Qwen2 is
trained to recite these rollouts (the tool turns as the tools and chat template produce them), then written into the
first hidden dimensions, heads and layers of the benchmarked shape (`embed`): every other weight there is random but
reads only zeros or writes nothing, so the large model says what the small one does at the FLOPs of a dense model of
its shape. The small model is cached in --cache-dir, keyed by everything that defines it.

    fastgrpo bench agent      # 8 rollouts, tiny shape (H 256, 4 layers), prompts of 821 tokens; ~1 min on 2 CPU
                              # cores, and ~1-2 min once to train the reciter

Writes <out-dir>/agent-<shape>-<device>-<date>.{json,md}.
"""

import argparse
import copy
import hashlib
import json
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fastgrpo import bench as harness

# Qwen2.5's tool format: schemas in <tools>, each call <tool_call>\n{"name", "arguments"}\n</tool_call>, the
# results of consecutive tool messages in one user turn, each in <tool_response>. With `schemas` false the system
# turn names the tools only (short prompts, for the tests).
SYSTEM_WITH_SCHEMAS = (
    "{{- '<|im_start|>system\\nYou may call these functions:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": <name>, \"arguments\": <arguments>}\\n</tool_call>"
    "<|im_end|>\\n' -}}"
)
SYSTEM_WITH_NAMES = (
    "{{- '<|im_start|>system\\nTools:' -}}{%- for tool in tools -%}{{- ' ' + tool.function.name -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
)
CONVERSATION = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant' + ('\\n' + message.content if message.content else '') -}}"
    "{%- for call in message.tool_calls -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + function.name + '\", \"arguments\": ' + (function.arguments | tojson)"
    " + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}{{- message.content -}}{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The reciter: small enough to train in a minute or two on a CPU; head_dim 32 as the tiny shape's (256 / 8 heads).
RECITER = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
# The benchmarked shapes (the reciter is embedded in them; head_dim 32 as its own) and the reciter itself (the tests').
SHAPES = {
    "tiny": harness.SHAPES["tiny"],  # H 256, 4 layers
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4),
    "reciter": RECITER,
}  # fmt: skip
MARGIN = 2.0  # logit of the scripted token over the next best, at every sampled position: far above fp32 rounding
TRAIN_LR = 3e-3
TRAIN_WARMUP = 10
TRAIN_MAX_STEPS = 1500
CACHE_DIR = Path(tempfile.gettempdir()) / "fastgrpo-bench-agent"


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a * b


TOOLS = [add, multiply]


@dataclass(frozen=True)
class Workload:
    prompts: int = 8  # rollouts: greedy, one per prompt
    schemas: bool = True  # the system turn shows the tools' JSON schemas (821-token prompts); False: their names
    shape: str = "tiny"  # the benchmarked model: SHAPES[shape], the reciter embedded in it
    max_new_tokens: int = 256  # TRL's max_completion_length: tool tokens count
    repeats: int = 5  # timed rounds after `warmup` rounds, each running both sides
    warmup: int = 1
    threads: int = 1
    seed: int = 0


# -- the tokenizer and the script ------------------------------------------------------------------------------------


def byte_tokenizer(schemas: bool):
    """Every byte one token (byte-level BPE without merges), Qwen's special and tool tokens added; eos <|im_end|>."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    tokenizer.add_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"])
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    system = SYSTEM_WITH_SCHEMAS if schemas else SYSTEM_WITH_NAMES
    tokenizer.chat_template = "{%- if tools -%}" + system + "{%- endif -%}" + CONVERSATION
    return tokenizer


@dataclass(frozen=True)
class Rollout:
    """A scripted rollout: what greedy decoding must give on both sides."""

    prompt: list[dict]  # the conversation up to the first assistant turn
    prompt_ids: list[int]
    completion_ids: list[int]  # the three turns and the two tool turns between them
    tool_mask: list[int]  # 0 on the tool turns' tokens
    tool_messages: list[dict]


def script(tokenizer, chat, workload: Workload) -> list[Rollout]:
    """Prompt i and its rollout: add(a, b), multiply(a + b, c), "The answer is (a + b) * c."; distinct (a, b, c)."""
    from fastgrpo.train.tools import tool_message

    rng = random.Random(workload.seed)
    tasks = []
    while len(tasks) < workload.prompts:
        task = (rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9))
        if task not in tasks:
            tasks.append(task)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    call = lambda name, a, b: encode(f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n'
                                     "</tool_call><|im_end|>")  # fmt: skip
    rollouts = []
    for a, b, c in tasks:
        prompt = [{"role": "user", "content": f"Add {a} and {b}, then multiply the sum by {c}."}]
        prompt_ids = tokenizer.apply_chat_template(prompt, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)  # fmt: skip
        results = [tool_message("add", a + b), tool_message("multiply", (a + b) * c)]
        pieces = [(call("add", a, b), 1), (chat.suffix_ids(results[:1]), 0), (call("multiply", a + b, c), 1),
                  (chat.suffix_ids(results[1:]), 0), (encode(f"The answer is {(a + b) * c}.<|im_end|>"), 1)]
        rollouts.append(Rollout(prompt, prompt_ids, [t for ids, _ in pieces for t in ids],
                                [m for ids, m in pieces for _ in ids], results))  # fmt: skip
    return rollouts


# -- the model -------------------------------------------------------------------------------------------------------


def model_config(shape: dict, tokenizer):
    """A Qwen2 config of `shape` (its vocab_size replaced by the tokenizer's), eos <|im_end|>, untied head."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**shape, "vocab_size": len(tokenizer)}, max_position_embeddings=4096,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)  # fmt: skip


def teacher_forced(model, rollouts: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
    """[positions] margins (scripted token's logit - next best) and argmax hits at every sampled position, each
    rollout's plain forward over prompt + completion."""
    margins, hits = [], []
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1]  # [C, V]: each completion token's
        sampled = torch.tensor(r.tool_mask, dtype=torch.bool)
        margin, hit = _margins(logits[sampled], torch.tensor(r.completion_ids)[sampled])
        margins.append(margin)
        hits.append(hit)
    return torch.cat(margins), torch.cat(hits)


def _margins(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V], targets [N] -> (margins [N], hits [N] bool)."""
    target = logits.gather(1, targets[:, None])[:, 0]
    best_other = logits.scatter(1, targets[:, None], -math.inf).max(-1).values
    return target - best_other, logits.argmax(-1) == targets


def train_reciter(rollouts: list[Rollout], tokenizer, seed: int, log=print):
    """The RECITER model trained until every sampled token of every rollout wins by MARGIN under teacher forcing:
    AdamW, all rollouts in one batch, cross-entropy on the sampled positions only (the prompts and tool turns are
    context). The prompts' shared beginning (the system turn: 770 of the default 821 tokens) runs once per step, its
    KV cache repeated for the batch, gradients flowing through it. Raises when TRAIN_MAX_STEPS do not get there."""
    from transformers import DynamicCache, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config(RECITER, tokenizer))
    sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
    shared = 0  # leading tokens all sequences share, short of every prompt's last (which predicts a sampled token)
    while shared < min(len(r.prompt_ids) for r in rollouts) - 1 and len({s[shared] for s in sequences}) == 1:
        shared += 1
    length = max(map(len, sequences)) - shared
    prefix = torch.tensor([sequences[0][:shared]])  # [1, S]
    ids = torch.full((len(rollouts), length), tokenizer.pad_token_id)  # [R, T]: the rest, right-padded
    targets = torch.full((len(rollouts), length), -100)  # [R, T]: the token each position predicts, -100 none
    for i, (r, sequence) in enumerate(zip(rollouts, sequences, strict=True)):
        ids[i, : len(sequence) - shared] = torch.tensor(sequence[shared:])
        for k, (token, sampled) in enumerate(zip(r.completion_ids, r.tool_mask, strict=True)):
            if sampled:
                targets[i, len(r.prompt_ids) + k - 1 - shared] = token
    positions = torch.arange(shared, shared + length).expand(len(rollouts), -1)  # [R, T]
    scored = targets != -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, weight_decay=0.0)
    start = time.perf_counter()
    for step in range(TRAIN_MAX_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = TRAIN_LR * min(1.0, (step + 1) / TRAIN_WARMUP)
        cache = DynamicCache(config=model.config)
        if shared:
            model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
            cache.batch_repeat_interleave(len(rollouts))
        logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits[scored]  # [N, V]
        loss = torch.nn.functional.cross_entropy(logits, targets[scored])
        margins, _ = _margins(logits.detach(), targets[scored])
        if step % 50 == 0:
            log(f"  reciter step {step}: loss {loss.item():.4f}, min margin {margins.min().item():.2f} "
                f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
        if margins.min().item() >= MARGIN:  # these are the weights before this step's update: keep them
            log(f"  reciter recites after {step} steps ({time.perf_counter() - start:.0f} s)")
            return model.eval()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    raise RuntimeError(f"the reciter did not learn the script in {TRAIN_MAX_STEPS} steps (min margin "
                       f"{margins.min().item():.2f} < {MARGIN})")  # fmt: skip


@torch.no_grad()
def embed(small, config, seed: int):
    """A Qwen2 of `config` that computes what `small` (a Qwen2 of the same vocabulary and head_dim) computes.

    Random weights (seed), then: the embedding writes small's h dimensions and zeros after them; layer l < small's
    layers hosts small's layer l: its query heads (each on a head that shares the same KV head), KV heads, MLP units;
    o_proj and down_proj are zero outside small's block in every layer, so the residual stream past dimension h
    stays exactly 0 and every other head, unit and layer writes nothing. RMSNorm then averages over H dims where
    small averaged over h: the norm weights are scaled by sqrt(h / H) and rms_norm_eps by h / H, which gives small's
    normalized values. The rest reads zeros or is read by nothing: the model runs a dense model's FLOPs."""
    from transformers import Qwen2ForCausalLM

    s, b = small.config, config
    h, H, d = s.hidden_size, b.hidden_size, s.hidden_size // s.num_attention_heads
    group_s, group_b = s.num_attention_heads // s.num_key_value_heads, b.num_attention_heads // b.num_key_value_heads
    assert b.hidden_size // b.num_attention_heads == d and s.vocab_size == b.vocab_size, "same head_dim and vocab"
    assert h <= H and s.intermediate_size <= b.intermediate_size and s.num_hidden_layers <= b.num_hidden_layers
    assert s.num_key_value_heads <= b.num_key_value_heads and group_s <= group_b, "small's heads fit the groups"
    assert s.rope_parameters == b.rope_parameters
    config = copy.deepcopy(config)
    config.rms_norm_eps = s.rms_norm_eps * h / H
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    scale = math.sqrt(h / H)
    model.model.embed_tokens.weight[:, h:] = 0
    model.model.embed_tokens.weight[:, :h] = small.model.embed_tokens.weight
    model.lm_head.weight[:, :h] = small.lm_head.weight
    model.model.norm.weight[:h] = small.model.norm.weight * scale
    heads = [(q // group_s) * group_b + q % group_s for q in range(s.num_attention_heads)]  # small q head -> large
    rows = lambda head: slice(head * d, (head + 1) * d)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        if i >= s.num_hidden_layers:
            continue
        source = small.model.layers[i]
        layer.input_layernorm.weight[:h] = source.input_layernorm.weight * scale
        layer.post_attention_layernorm.weight[:h] = source.post_attention_layernorm.weight * scale
        attention, source_attention = layer.self_attn, source.self_attn
        for q, head in enumerate(heads):
            attention.q_proj.weight[rows(head), :h] = source_attention.q_proj.weight[rows(q)]
            attention.q_proj.bias[rows(head)] = source_attention.q_proj.bias[rows(q)]
            attention.o_proj.weight[:h, rows(head)] = source_attention.o_proj.weight[:, rows(q)]
        for kv in range(s.num_key_value_heads):
            for name in ("k_proj", "v_proj"):
                getattr(attention, name).weight[rows(kv), :h] = getattr(source_attention, name).weight[rows(kv)]
                getattr(attention, name).bias[rows(kv)] = getattr(source_attention, name).bias[rows(kv)]
        units = s.intermediate_size
        layer.mlp.gate_proj.weight[:units, :h] = source.mlp.gate_proj.weight
        layer.mlp.up_proj.weight[:units, :h] = source.mlp.up_proj.weight
        layer.mlp.down_proj.weight[:h, :units] = source.mlp.down_proj.weight
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def reciting_model(rollouts: list[Rollout], tokenizer, workload: Workload, cache_dir: Path, log=print):
    """The benchmarked model: the reciter (trained, or loaded from cache_dir) embedded in the workload's shape, checked
    to recite every rollout by MARGIN / 2 under teacher forcing."""
    from transformers import Qwen2ForCausalLM

    key = hashlib.sha256(json.dumps({
        "sequences": [r.prompt_ids + r.completion_ids for r in rollouts], "masks": [r.tool_mask for r in rollouts],
        "reciter": RECITER, "vocab": len(tokenizer), "seed": workload.seed, "lr": TRAIN_LR, "warmup": TRAIN_WARMUP,
        "margin": MARGIN, "torch": torch.__version__.split("+")[0],
    }, sort_keys=True).encode()).hexdigest()[:16]  # fmt: skip
    path = Path(cache_dir) / f"reciter-{key}.pt"
    if path.is_file():
        small = Qwen2ForCausalLM(model_config(RECITER, tokenizer))
        small.load_state_dict(torch.load(path, weights_only=True))
        small.eval()
    else:
        log(f"training the reciter (cached as {path})")
        small = train_reciter(rollouts, tokenizer, workload.seed, log)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(small.state_dict(), path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    model = embed(small, model_config(SHAPES[workload.shape], tokenizer), workload.seed)
    with torch.no_grad():
        margins, hits = teacher_forced(model, rollouts)
    if not hits.all() or margins.min().item() < MARGIN / 2:
        raise RuntimeError(f"the model does not recite the script (min margin {margins.min().item():.2f}); delete "
                           f"{path} to train it again")  # fmt: skip
    return model


# -- the two sides ---------------------------------------------------------------------------------------------------


@dataclass
class Side:
    """One side's rollouts and what they cost."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tool_masks: list[list[int]]
    tool_messages: list[list[dict]]
    turns: list[int]  # per rollout: assistant turns
    generate_calls: int
    tokens_computed: int  # positions run through the model, padding left out
    tokens_per_call: list[int]
    forward_positions: int  # positions the model's forwards ran, padding included
    stats: dict | None = None  # the engine's GenerateStats


def no_reward(completions, **columns) -> list[float]:
    """GRPOTrainer needs a reward function; _generate never calls it."""
    return [0.0] * len(completions)


class TRLLoop:
    """A stock trl.GRPOTrainer with tools, sampling with HF generate; __call__ runs its `_generate`.

    The trainer's `_generate_single_turn` is wrapped to record each call's rows (the prompt so far, the new tokens)
    and a forward pre-hook on the model counts the positions of every forward while `_generate` runs."""

    def __init__(self, model, tokenizer, workload: Workload, out_dir: str):
        import datasets
        from trl import GRPOConfig, GRPOTrainer
        from trl.chat_template_utils import qwen3_template

        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.response_template = qwen3_template  # TRL's own grammar of Qwen's tool calls
        args = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, per_device_train_batch_size=2,
                          num_generations=2, steps_per_generation=1, beta=0.0, report_to="none", save_strategy="no",
                          logging_strategy="no", max_completion_length=workload.max_new_tokens,
                          generation_kwargs={"do_sample": False}, seed=workload.seed)  # fmt: skip
        rows = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "-"}]}] * 2)
        self.trainer = GRPOTrainer(model=model, reward_funcs=[no_reward], args=args, train_dataset=rows,
                                   processing_class=tokenizer, tools=TOOLS)  # fmt: skip
        self.model, self.calls, self.positions = model, [], 0
        generate_single_turn = self.trainer._generate_single_turn

        def recorded(prompt_ids, *args, **kwargs):
            completion_ids, logprobs = generate_single_turn(prompt_ids, *args, **kwargs)
            self.calls.append((list(map(len, prompt_ids)), list(map(len, completion_ids))))
            return completion_ids, logprobs

        self.trainer._generate_single_turn = recorded

    def _count(self, module, args, kwargs):
        self.positions += kwargs["input_ids"].numel()

    def __call__(self, prompts: list[list[dict]]) -> Side:
        self.calls, self.positions = [], 0
        # The per-rollout tool tables _generate_and_score_completions builds before it calls _generate.
        self.trainer._sync_tool_dicts = [{tool.__name__: tool for tool in TOOLS} for _ in prompts]
        self.trainer._async_tool_dicts = [{} for _ in prompts]
        hook = self.model.register_forward_pre_hook(self._count, with_kwargs=True)
        try:
            prompt_ids, completion_ids, tool_mask, completions, *_ = self.trainer._generate(prompts)
        finally:
            hook.remove()
        # Per call and row: its input is computed, then each new token but the last is fed back.
        per_call = [sum(inputs) + sum(max(n - 1, 0) for n in outputs) for inputs, outputs in self.calls]
        return Side(prompt_ids, completion_ids, tool_mask, [[m for m in c if m["role"] == "tool"] for c in completions],
                    [sum(m["role"] == "assistant" for m in c) for c in completions], len(self.calls), sum(per_call),
                    per_call, self.positions)  # fmt: skip


class EngineLoop:
    """fastgrpo's Engine with a turn_end made of fastgrpo.train.tools: parse each ended turn, run its calls, answer
    with the tool turn's tokens (None, ending the rollout, for a turn without calls or without room for them)."""

    def __init__(self, model, tokenizer, workload: Workload):
        from fastgrpo.sampling import Engine, SamplingParams
        from fastgrpo.train.tools import ToolChat, ToolRunner, toolbox

        self.engine = Engine(model, tokenizer=tokenizer)
        self.tokenizer, self.chat = tokenizer, ToolChat.for_tokenizer(tokenizer)
        self.runner, self.box = ToolRunner(), toolbox(TOOLS)
        self.params = SamplingParams(temperature=0.0, max_new_tokens=workload.max_new_tokens,
                                     stop_token_ids=(tokenizer.eos_token_id,))  # fmt: skip

    def close(self) -> None:
        self.runner.close()

    def __call__(self, prompts: list[list[dict]]) -> Side:
        from fastgrpo.train.tools import tool_calls

        prompt_ids = [self.tokenizer.apply_chat_template(p, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False) for p in prompts]  # fmt: skip
        history = [list(ids) for ids in prompt_ids]  # per rollout: everything so far, the prefix its turns parse with
        tool_messages = [[] for _ in prompts]
        assistant_turns = [0] * len(prompts)

        def turn_end(turns):
            messages = [self.chat.parse(t.token_ids, history[t.prompt_index], TOOLS) for t in turns]
            for t in turns:
                history[t.prompt_index] += t.token_ids
                assistant_turns[t.prompt_index] += 1
            calling = [k for k, m in enumerate(messages) if tool_calls(m)]
            results, _ = self.runner.run([tool_calls(messages[k]) for k in calling], [self.box] * len(calling))
            answers = [None] * len(turns)
            for k, result in zip(calling, results, strict=True):
                suffix = self.chat.suffix_ids(result)
                if len(suffix) <= turns[k].room:  # else TRL rolls the results back and the rollout ends
                    history[turns[k].prompt_index] += suffix
                    tool_messages[turns[k].prompt_index] += result
                    answers[k] = suffix
            return answers

        outputs = [group[0] for group in self.engine.generate(prompt_ids, n=1, params=self.params,
                                                              turn_end=turn_end)]  # fmt: skip
        stats = self.engine.stats
        return Side(prompt_ids, [c.token_ids for c in outputs], [c.tool_mask for c in outputs], tool_messages,
                    assistant_turns, 1, stats.num_forward_tokens, [stats.num_forward_tokens],
                    stats.num_forward_tokens, asdict(stats))  # fmt: skip


def check_equal(trl: Side, engine: Side, rollouts: list[Rollout]) -> None:
    """Both sides' prompt and completion ids, tool masks and tool messages equal each other and the script; 3 turns
    each."""
    for name, side in (("TRL", trl), ("engine", engine)):
        for i, r in enumerate(rollouts):
            got = (side.prompt_ids[i], side.completion_ids[i], side.tool_masks[i], side.tool_messages[i], side.turns[i])
            if got != (r.prompt_ids, r.completion_ids, r.tool_mask, r.tool_messages, 3):
                raise AssertionError(f"{name}'s rollout {i} is not the script's: {got} != {r}")


# -- the run ---------------------------------------------------------------------------------------------------------


def measure(workload: Workload, cache_dir: Path = CACHE_DIR, log=print) -> dict:
    """Both sides, `warmup` + `repeats` interleaved rounds (the order alternating): the record of the run."""
    torch.set_num_threads(workload.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from fastgrpo.train.tools import ToolChat

    tokenizer = byte_tokenizer(workload.schemas)
    rollouts = script(tokenizer, ToolChat.for_tokenizer(tokenizer), workload)
    model = reciting_model(rollouts, tokenizer, workload, cache_dir, log)
    prompts = [r.prompt for r in rollouts]
    with tempfile.TemporaryDirectory(prefix="fastgrpo-bench-agent-") as out:
        sides = {"trl": TRLLoop(model, tokenizer, workload, out), "engine": EngineLoop(model, tokenizer, workload)}
        seconds = {name: [] for name in sides}
        results = {}
        try:
            for round_ in range(workload.warmup + workload.repeats):
                for name in sides if round_ % 2 == 0 else reversed(list(sides)):
                    start = time.perf_counter()
                    results[name] = sides[name](prompts)
                    if round_ >= workload.warmup:
                        seconds[name].append(time.perf_counter() - start)
                check_equal(results["trl"], results["engine"], rollouts)
        finally:
            sides["engine"].close()
    trl, engine = results["trl"], results["engine"]
    row = lambda side, name: {"side": name, "turns": sum(side.turns), "generate_calls": side.generate_calls,
                              "tokens_computed": side.tokens_computed, "tokens_per_call": side.tokens_per_call,
                              "forward_positions": side.forward_positions, "engine_stats": side.stats,
                              "seconds": statistics.median(seconds[name]), "seconds_per_round": seconds[name]}
    rows = [row(trl, "trl"), row(engine, "engine")]
    ratios = [t / e for t, e in zip(seconds["trl"], seconds["engine"], strict=True)]  # per round: adjacent runs
    return {
        "workload": asdict(workload),
        "prompt_tokens": [len(r.prompt_ids) for r in rollouts],
        "completion_tokens": [len(r.completion_ids) for r in rollouts],
        "sampled_tokens": [sum(r.tool_mask) for r in rollouts],
        "rows": rows,
        "tokens_ratio": trl.tokens_computed / engine.tokens_computed,
        "positions_ratio": trl.forward_positions / engine.forward_positions,
        "time_ratio": statistics.median(ratios),
        "time_ratio_per_round": ratios,
        "time_ratio_of_medians": rows[0]["seconds"] / rows[1]["seconds"],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Workload()
    parser.add_argument("--prompts", type=int, default=defaults.prompts, help="rollouts, one per prompt (default 8)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default=defaults.shape,
                        help="the benchmarked Qwen2 shape, the reciter embedded in it (default tiny: H 256, 4 layers; "
                             "small: H 512, 8 layers; reciter: the trained model itself, H 64, 2 layers)")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="timed rounds, each both sides")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=defaults.threads,
                        help="torch threads (default 1: on a CPU shared with other work OpenMP spin-waits otherwise "
                             "dominate the timings)")
    parser.add_argument("--cache-dir", default=str(CACHE_DIR), help="where the trained reciter is kept")
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .json and .md results go")


def run(args: argparse.Namespace) -> dict:
    for option, value, minimum in (("--prompts", args.prompts, 1), ("--repeats", args.repeats, 1),
                                   ("--warmup", args.warmup, 0), ("--threads", args.threads, 1)):
        if value < minimum:
            raise SystemExit(f"{option} must be >= {minimum}, got {value}")
    harness.check_out_dir(args.out_dir)
    workload = Workload(prompts=args.prompts, shape=args.shape, repeats=args.repeats, warmup=args.warmup,
                        threads=args.threads)  # fmt: skip
    record = measure(workload, Path(args.cache_dir))
    env = harness.environment(torch.device("cpu"))
    import trl

    env["trl"] = trl.__version__
    title, table = report(record, env)
    rows = [{**row, **env} for row in record["rows"]]
    for row in rows:
        row.update({k: v for k, v in record.items() if k != "rows"})
    harness.publish(args.out_dir, f"agent-{workload.shape}", env, rows, title, table)
    return record


def report(record: dict, env: dict) -> tuple[str, str]:
    w = record["workload"]
    trl, engine = record["rows"]
    prompt = sorted(set(record["prompt_tokens"]))
    title = (f"{w['prompts']} rollouts of 3 turns (call, call, answer), greedy, {w['shape']} Qwen2 shape (fp32), "
             f"prompts of {'-'.join(map(str, prompt))} tokens, completions of {min(record['completion_tokens'])}-"
             f"{max(record['completion_tokens'])} ({min(record['sampled_tokens'])}-{max(record['sampled_tokens'])} "
             f"sampled) on {env['device']}, {w['threads']} torch thread(s): median of {w['repeats']} interleaved "
             f"rounds after {w['warmup']} warm-up round(s); the prompt and completion ids, tool masks and tool "
             "messages are equal on both sides and to the script")  # fmt: skip
    names = {"trl": "TRL 1.16 `_generate` (HF generate, re-prefill per turn)",
             "engine": "fastgrpo `Engine.generate(turn_end=...)`"}
    lines = ["| side | turns | generate calls | tokens computed (per call) | forward positions, padding included | "
             "wall s |", "|---|---|---|---|---|---|"]
    for row in (trl, engine):
        per_call = " + ".join(map(str, row["tokens_per_call"])) if len(row["tokens_per_call"]) > 1 else ""
        lines.append(f"| {names[row['side']]} | {row['turns']} | {row['generate_calls']} | {row['tokens_computed']}"
                     f"{f' ({per_call})' if per_call else ''} | {row['forward_positions']} | {row['seconds']:.2f} |")
    lines.append(f"| **TRL / engine** | | | **{record['tokens_ratio']:.2f}x** | {record['positions_ratio']:.2f}x | "
                 f"**{record['time_ratio']:.2f}x** (median of the rounds' ratios: "
                 f"{', '.join(f'{r:.2f}' for r in record['time_ratio_per_round'])}; of the medians "
                 f"{record['time_ratio_of_medians']:.2f}x) |")
    return title, "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    harness.suite_main(argv, __doc__, add_arguments, run, lambda method, payload: None)


if __name__ == "__main__":
    main()
