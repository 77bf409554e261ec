"""Paged-KV sampling from the policy's own modules: `Engine(model).generate(prompt_token_ids, n, SamplingParams())`."""

from fastgrpo.sampling.engine import Completion, Engine, GenerateStats
from fastgrpo.sampling.params import EngineConfig, SamplingParams

__all__ = ["Completion", "Engine", "EngineConfig", "GenerateStats", "SamplingParams"]
