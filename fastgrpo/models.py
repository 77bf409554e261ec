"""Lookups on transformers models, shared by the sampling engine and the trainer."""

import torch
from transformers import PreTrainedModel


def find_hf_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model itself, or the one a wrapper (e.g. a peft model) holds."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"model must be a transformers PreTrainedModel or wrap one, got {type(model).__name__}")


def stop_token_ids(model: torch.nn.Module, tokenizer=None) -> tuple[int, ...]:
    """The ids that end a completion by default, sorted: the generation config's eos_token_id (one id or several),
    plus the tokenizer's eos token when a tokenizer is given."""
    generation_config = find_hf_model(model).generation_config
    eos = generation_config.eos_token_id if generation_config is not None else None
    ids = set([eos] if isinstance(eos, int) else eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
