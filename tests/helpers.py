"""Shared test helpers: three-way comparisons with verbose failures, GRPO problem builders (an lm head, a whole loss
problem), a tokenizer, tiny model configs, a torch thread-count guard."""

from contextlib import contextmanager

import pytest
import tokenizers
import torch
import transformers
from packaging.version import Version
from transformers import PreTrainedTokenizerFast

from fastgrpo import reference
from fastgrpo.check.tolerance import EXTRA_TOL, describe_mismatch, max_error, no_worse_limit  # noqa: F401
from fastgrpo.sampling.state import HYBRID_TRANSFORMERS


def assert_no_worse(name, fast, same_dtype_ref, truth, dtype):
    """The fast path's error vs float64 truth is at most the same-dtype reference's error plus EXTRA_TOL[dtype]
    (fastgrpo.check.tolerance: the rule `fastgrpo check` applies on a GPU)."""
    assert fast.shape == truth.shape, f"{name}: shape {tuple(fast.shape)} != {tuple(truth.shape)}"
    assert torch.isfinite(fast).all(), f"{name}: non-finite values in the fast path"
    limit = no_worse_limit(same_dtype_ref, truth, dtype)
    assert max_error(fast, truth) <= limit, describe_mismatch(name, fast, truth, limit)


def assert_close(name, got, want, atol, rtol=0.0):
    limit = atol + rtol * want.double().abs().max().item()
    err = (got.double() - want.double()).abs().nan_to_num(0.0).max().item() if got.numel() else 0.0
    assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN pattern differs: {got} vs {want}"
    assert err <= limit, describe_mismatch(name, got, want, limit)


def make_head(N_shape, H, V, seed=0, scale=1.0, bias=False, dtype=torch.float64):
    """hidden [*N_shape, H], weight [V, H], bias [V] or None, ids [*N_shape]; logits of std ~scale."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*N_shape, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (scale / H**0.5)
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.1 if bias else None
    ids = torch.randint(0, V, N_shape, generator=g)
    cast = lambda t: None if t is None else t.to(dtype)
    return cast(hidden), cast(weight), cast(b), ids


B, T, H, V = 4, 9, 24, 150  # make_problem's sizes: none a multiple of any block size


def make_problem(seed=0, adv_per_token=False, dtype=torch.float64):
    """A GRPO loss problem: hidden [B, T, H] (non-contiguous), weight [V, H], bias [V], ids [B, T] (-100 on padding),
    mask [B, T] (a padded tail, an all-masked row), old / ref logprobs [B, T] fp32, advantages [B] (or [B, T]) fp32."""
    hidden, weight, bias, ids = make_head((B, T + 1), H, V, seed=seed, scale=4.0, bias=True, dtype=dtype)
    hidden = hidden[:, :-1]  # non-contiguous, as `last_hidden_state[:, :-1]` is
    ids = ids[:, 1:]
    g = torch.Generator().manual_seed(seed + 1)
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[1, 5:] = 0  # a padded tail
    mask[2] = 0  # an all-masked row
    ids = ids.masked_fill(mask == 0, -100)  # padding ids are out of range and must be ignored
    logps, _ = reference.token_logprobs(hidden.double(), weight.double(), ids.clamp(min=0), bias=bias.double())
    old = (logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    adv = torch.randn((B, T) if adv_per_token else (B,), generator=g, dtype=torch.float64).float()
    return dict(hidden=hidden, weight=weight, bias=bias, ids=ids, mask=mask, old=old, ref=ref, adv=adv)


def leaf(t, dtype):
    return None if t is None else t.detach().to(dtype).clone().requires_grad_()


def word_tokenizer(num_words: int) -> PreTrainedTokenizerFast:
    """Offline word-level tokenizer: <pad> 0, <eos> 1, <unk> 2, then words w0 .. w{num_words - 1}."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(num_words)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_config(cls, vocab_size: int, pad_id: int = 0, eos_id: int = 1):
    """A 2-layer, hidden-32 config of `cls` (e.g. Qwen2Config) with GQA 2, untied lm_head, eos doubling as bos."""
    return cls(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=pad_id,
               bos_token_id=eos_id, eos_token_id=eos_id)


@contextmanager
def torch_threads(num: int):
    """torch's intra-op thread count set to `num`, restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def skip_below_transformers(version: str, what: str) -> None:
    """Skips the test under transformers older than `version`, which lack `what`."""
    if Version(transformers.__version__) < Version(version):
        pytest.skip(f"{what} needs transformers >= {version} ({transformers.__version__} is installed)")


def skip_without_hybrid_state() -> None:
    """Skips the test where the engine refuses hybrid models (fastgrpo/sampling/state.py: HYBRID_TRANSFORMERS)."""
    skip_below_transformers(HYBRID_TRANSFORMERS, "the engine's recurrent state (hybrid models)")
