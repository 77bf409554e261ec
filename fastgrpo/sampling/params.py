"""Options of the sampling engine: what to sample (SamplingParams) and how to run (EngineConfig)."""

import math
from dataclasses import dataclass

from fastgrpo.sampling.attention import BACKENDS, FP8_BACKENDS


def check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to sample. `temperature=0` is greedy; `top_k=0`, `top_p=1`, `min_p=0` and `repetition_penalty=1` switch
    those off. The logits are processed in transformers' order: repetition penalty (over the prompt and every token of
    the completion so far; greedy decoding too), then / temperature, top-k, top-p, min-p (sampling only).

    `stop_token_ids=None` stops at the model's `generation_config.eos_token_id` (one or several ids); pass `()` to
    never stop on a token. Stop tokens and the token that completes a stop string are kept in the completion.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # keep tokens whose probability is at least min_p x the most likely one's
    repetition_penalty: float = 1.0  # a seen token's logit x: / penalty when positive, x penalty when negative
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        check_int("top_k", self.top_k, 0)
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 is off), got {self.min_p!r}")
        if not is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a number in (0, inf) (1 is off), got "
                             f"{self.repetition_penalty!r}")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        if self.stop_token_ids is not None:
            ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else tuple(self.stop_token_ids)
            for token in ids:
                check_int("stop_token_ids[i]", token, 0)
            object.__setattr__(self, "stop_token_ids", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.seed is not None:
            check_int("seed", self.seed, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs.

    block_size: tokens per KV page. flash-attn's paged kernels need a multiple of 256.
    num_blocks: pages in the pool; None sizes it from free memory (`memory_fraction` of what is free when
        `generate` starts), capped at what the call can ever use.
    max_num_seqs: sequences decoded together at most (and no more than max_num_batched_tokens; a group of more
        than that still runs, alone).
    max_num_batched_tokens: tokens per forward at most (decode tokens first, then chunks of prompts).
    attention: "auto" (flash when installed and block_size allows, else triton on CUDA, torch on CPU),
        "torch" (gather + SDPA reference), "triton", "flash", or one added with attention.register_backend.
    cuda_graphs: capture decode steps in CUDA graphs (CUDA with the triton or flash backend only).
    fused_layers: run Llama/Qwen2/Qwen3 models through the engine's own layers (decode_layers.py: q/k/v and
        gate/up fused in place into one GEMM each, fused norm/rotary/SiLU kernels with the triton or flash backend);
        False, or another architecture, runs transformers' modules with the paged attention function.
    kv_cache_dtype: "auto" (the model's dtype) or "fp8" (float8_e4m3fn pages, half of bf16's bytes, with one
        power-of-two scale per layer, K or V, and KV head, bounded from the weights: decode_layers.kv_scales). fp8
        needs a Llama/Qwen2/Qwen3 model and the torch or triton attention backend ("auto" then never picks flash).
    record_routes: record the experts every position went through (mixture-of-experts models: Completion.routes,
        what the trainer's routing replay uses; routes.py); `generate(record_routes=...)` overrides it per call.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.8
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    attention: str = "auto"
    cuda_graphs: bool = True
    fused_layers: bool = True
    kv_cache_dtype: str = "auto"
    record_routes: bool = False

    def __post_init__(self):
        check_int("block_size", self.block_size, 1)
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1)
        if not isinstance(self.memory_fraction, (int, float)) or not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.attention != "auto" and self.attention not in BACKENDS:
            raise ValueError(f"attention must be one of {('auto', *BACKENDS)}, got {self.attention!r}")
        if self.attention == "flash" and self.block_size % 256:
            raise ValueError(f"attention='flash' needs block_size to be a multiple of 256, got {self.block_size}")
        for name in ("cuda_graphs", "fused_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8" and self.attention not in ("auto", *FP8_BACKENDS):
            raise ValueError(f"kv_cache_dtype='fp8' needs attention 'auto', 'torch' or 'triton' (the backends that "
                             f"read fp8 pages with their scales), got {self.attention!r}")
