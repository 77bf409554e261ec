"""Paged-KV sampling from the policy's own modules: `Engine(model).generate(prompt_token_ids, n, SamplingParams())`."""

from fastgrpo.sampling.engine import Completion, Engine, GenerateStats
from fastgrpo.sampling.params import EngineConfig, SamplingParams
from fastgrpo.sampling.turns import Turn

__all__ = ["Completion", "Engine", "EngineConfig", "GenerateStats", "SamplingParams", "Turn"]
