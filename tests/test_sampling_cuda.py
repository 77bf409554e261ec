"""The sampling engine and the paged attention kernel on a real GPU (skipped without CUDA)."""

import pytest
import torch
from helpers import assert_close, assert_no_worse
from paged_attention_helpers import batches, run_case
from sampling_helpers import NO_STOP, expected_logprobs, full_forward_logits, hf_greedy, prompts_for, tiny

from fastgrpo.sampling import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# About one bf16 ulp of the largest logits: a bf16 model's logprobs are no closer than its bf16 logits. In
# tiny("qwen2") |logit| reaches ~10 (lm_head std 0.3 over H = 64 unit-RMS terms: std 2.4, then the max of V = 128),
# where a bf16 ulp is 2^-4 = 0.0625 ([8, 16)). The engine (paged attention, one-row decode GEMMs) and the plain forward
# (SDPA over the whole sequence) accumulate in different orders before each bf16 rounding of 2 layers' activations and
# of the 64-term logit sums, so a logit can land an ulp off, and log p = z_t / temperature - logsumexp(z / temperature)
# moves with it. On CPU (torch paged backend, 768 tokens): 24% of logits an ulp or more off, max 0.0625; logprob
# error max 0.045 (temperature 0.8, top-k 20), 0.037 (temperature 1).
BF16_LOGPROB_ATOL = 6e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", list(batches(16)))
@pytest.mark.parametrize("group", [1, 6, 7])
def test_triton_paged_attention_on_gpu(dtype, batch, group):
    truth, _, ref, fast = run_case(batch, group, block_size=16, head_dim=128, share_prefix=True, tiles=None,
                                   device="cuda", dtype=dtype)
    assert_no_worse(f"triton[{batch}]", fast, ref, truth, dtype if dtype != torch.float16 else torch.bfloat16)


def cuda_model(family, dtype=torch.float32):
    return tiny(family).to("cuda", dtype)


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_matches_hf_generate_on_gpu(family, cuda_graphs):
    model = cuda_model(family)
    prompts = prompts_for(16)
    engine = Engine(model, attention="triton", cuda_graphs=cuda_graphs)
    outputs = engine.generate(prompts, n=3, params=SamplingParams(temperature=0, max_new_tokens=24, **NO_STOP))
    for prompt, completions in zip(prompts, outputs, strict=True):
        want = hf_greedy(model, prompt, 24)
        assert all(c.token_ids == want for c in completions), (len(prompt), want)
    assert engine.stats.leaked_blocks == 0


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, BF16_LOGPROB_ATOL)])
def test_sampled_logprobs_on_gpu(dtype, atol):
    model = cuda_model("qwen2", dtype)
    prompts = prompts_for(16)
    params = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=32, seed=0, **NO_STOP)
    outputs = Engine(model, attention="triton").generate(prompts, n=4, params=params)
    for prompt, completions in zip(prompts, outputs, strict=True):
        for c in completions:
            logits = full_forward_logits(model, prompt, c.token_ids).cpu()
            want = expected_logprobs(logits, c.token_ids, 0.8, 20, 1.0)
            assert_close("logprobs", torch.tensor(c.logprobs), want, atol=atol)


def test_same_seed_same_completions_with_cuda_graphs():
    model = cuda_model("llama", torch.bfloat16)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=7, **NO_STOP)
    runs = [Engine(model, attention="triton").generate(prompts_for(16), n=8, params=params) for _ in range(2)]
    assert runs[0] == runs[1]


def test_pool_and_graphs_are_released():
    model = cuda_model("qwen2", torch.bfloat16)
    engine = Engine(model, attention="triton", num_blocks=4096)
    engine.generate(prompts_for(16), n=8, params=SamplingParams(max_new_tokens=16, seed=0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine.generate(prompts_for(16), n=8, params=SamplingParams(max_new_tokens=16, seed=0))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 2**20
    assert torch.cuda.max_memory_allocated() - before > 4096 * 16 * 2 * 2 * 2 * 16  # the pool did exist


def test_flash_attn_backend():
    pytest.importorskip("flash_attn")
    model = cuda_model("qwen2", torch.bfloat16)
    prompts = prompts_for(16)
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=0, **NO_STOP)
    engine = Engine(model, attention="flash", block_size=256)
    assert engine.backend == "flash"
    outputs = engine.generate(prompts, n=4, params=params)
    for prompt, completions in zip(prompts, outputs, strict=True):
        for c in completions:
            logits = full_forward_logits(model, prompt, c.token_ids).cpu()
            assert_close("logprobs", torch.tensor(c.logprobs), logits.log_softmax(-1).gather(
                -1, torch.tensor(c.token_ids)[:, None]).squeeze(-1), atol=BF16_LOGPROB_ATOL)
    assert engine.stats.leaked_blocks == 0


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_fused_layers_on_gpu_sample_what_transformers_modules_sample(family):
    """fp32: the fused layers' CUDA kernels against transformers' modules, same tokens, logprobs to 1e-4. Both
    engines sample with the fused sampler at top_p = 1 and with PyTorch's at top_p < 1."""
    model = cuda_model(family)
    prompts = prompts_for(16)
    for params in (SamplingParams(temperature=1.0, max_new_tokens=24, seed=1, **NO_STOP),
                   SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=24, seed=2, **NO_STOP)):
        fused = Engine(model, attention="triton")
        assert fused.layers == "fused"
        got = fused.generate(prompts, n=3, params=params)
        want = Engine(model, attention="triton", fused_layers=False).generate(prompts, n=3, params=params)
        for g_group, w_group in zip(got, want, strict=True):
            for g, w in zip(g_group, w_group, strict=True):
                assert g.token_ids == w.token_ids
                assert_close("logprobs", torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)


@pytest.mark.parametrize("temperature,top_k", [(0, 0), (1.0, 0), (0.7, 50)])
def test_fused_sampler_on_gpu(temperature, top_k):
    """bf16 logits at Qwen2.5's vocabulary, 512 rows: the PyTorch sampler's tokens, logprobs to 1e-5."""
    from fastgrpo.kernels.sampling import fused_sample
    from fastgrpo.sampling.sampler import sample, uniforms

    rows, vocab = 512, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g, device="cuda") * 3).bfloat16()
    u = None if temperature == 0 else uniforms(3, torch.arange(rows, device="cuda"), torch.zeros(rows, device="cuda",
                                                                                                  dtype=torch.long))
    kth = torch.topk(logits, top_k, dim=-1).values[:, -1].float() if top_k else None
    tokens, logprobs = fused_sample(logits, temperature, u, kth)
    want_tokens, want_logprobs = sample(logits.float(), SamplingParams(temperature=temperature, top_k=top_k), u)
    assert (tokens != want_tokens).sum() <= 1  # a draw within ~1e-7 of a tile boundary may differ
    assert_close("logprobs", logprobs[tokens == want_tokens], want_logprobs[tokens == want_tokens], atol=1e-5)
