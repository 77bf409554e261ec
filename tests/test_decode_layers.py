"""The engine's own decoder layers (fused q/k/v and gate/up as views of one buffer, fused elementwise kernels) and
the fused sampler: the same tokens and logprobs as transformers' modules and the PyTorch sampler."""

import copy
import os

import pytest
import torch
from sampling_helpers import FAMILIES, NO_STOP, prompts_for, tiny

from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.sampling.decode_layers import FusedDecoder, rotate_half, unsupported
from fastgrpo.sampling.sampler import sample, uniforms

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="Triton kernels: CUDA or the interpreter")
PARAMS = [SamplingParams(temperature=0, max_new_tokens=20, **NO_STOP),
          SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, **NO_STOP),
          SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=20, seed=5, **NO_STOP)]


def completions(outputs):
    return [(c.token_ids, c.logprobs, c.finish_reason) for group in outputs for c in group]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layers_sample_what_transformers_modules_sample(family):
    """CPU: bit-equal tokens and logprobs, greedy and seeded, with chunked prefill and mixed batches."""
    model = tiny(family)
    prompts = prompts_for(4)
    for params in PARAMS:
        fused = Engine(model, block_size=4, max_num_batched_tokens=24)
        assert fused.layers == "fused"
        plain = Engine(model, block_size=4, max_num_batched_tokens=24, fused_layers=False)
        assert plain.layers == "transformers (fused_layers=False)"
        assert completions(fused.generate(prompts, n=2, params=params)) == completions(
            plain.generate(prompts, n=2, params=params))


def test_projections_become_slices_of_one_buffer():
    """q/k/v and gate/up are fused in place: the same Parameter objects, the same values and gradients, one
    storage per layer and group; the optimizer steps them, save_pretrained writes them, `.to()` is noticed."""
    model = tiny("qwen2")
    before = copy.deepcopy(model)
    params = dict(model.named_parameters())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    engine = Engine(model, block_size=4)
    assert dict(model.named_parameters()) == params  # same objects
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            storages = {m.weight.untyped_storage().data_ptr() for m in group}
            assert len(storages) == 1 and all(m.weight.is_contiguous() for m in group)
        assert len({m.bias.untyped_storage().data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)}) == 1
    for (name, p), q in zip(model.named_parameters(), before.parameters(), strict=True):
        assert torch.equal(p, q), name
    model(ids, labels=ids).loss.backward()
    before(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), before.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for m in (model, before):
        torch.optim.AdamW(m.parameters(), lr=1e-2).step()
    for (name, p), q in zip(model.named_parameters(), before.parameters(), strict=True):
        assert torch.equal(p, q), name
    # the fused buffer is what the engine reads: the step above is visible to it
    layer = engine.decoder.layers[0]
    assert torch.equal(layer.qkv_weight[: model.config.hidden_size], model.model.layers[0].self_attn.q_proj.weight)

    model.double()  # replaces every parameter's storage: the next generate fuses again
    assert engine.decoder.layers[0].stale()
    engine.dtype = torch.float64
    engine.generate([[5, 6, 7]], n=1, params=SamplingParams(temperature=0, max_new_tokens=3, **NO_STOP))
    assert not engine.decoder.layers[0].stale()
    assert engine.decoder.layers[0].qkv_weight.dtype == torch.float64


def test_fused_model_saves_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny("llama")
    Engine(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_lora_added_after_the_engine_is_seen():
    """get_peft_model wraps the projections in place: the next generate runs transformers' modules, with LoRA."""
    peft = pytest.importorskip("peft")
    model = tiny("qwen2")
    engine = Engine(model)
    params = SamplingParams(temperature=0, max_new_tokens=6, **NO_STOP)
    plain = engine.generate([[5, 6, 7]], params=params)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    adapted = engine.generate([[5, 6, 7]], params=params)
    assert engine.decoder is None and "layers[0].q_proj is a Linear" in engine.layers
    assert adapted == Engine(lora).generate([[5, 6, 7]], params=params) and adapted != plain


def test_other_models_keep_transformers_modules():
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine = Engine(lora)
    assert engine.decoder is None and "layers[0].q_proj is a Linear" in engine.layers and "LoRA" in engine.layers
    hooked = tiny("llama")
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert unsupported(hooked) == "layers[1] has forward hooks"
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    assert "GPT2LMHeadModel is not one of" in unsupported(gpt2)
    with pytest.raises(ValueError, match="fused decode layers cannot run this model: GPT2LMHeadModel"):
        FusedDecoder(gpt2, "torch")


# -- the Triton kernels (interpreter, fp32) against the PyTorch ops they replace --


@interpreter
@pytest.mark.parametrize("residual", [True, False])
def test_add_rms_norm_kernel(residual):
    from fastgrpo.kernels import decode_ops  # noqa: F401

    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(7, 96, generator=g), torch.randn(7, 96, generator=g), torch.randn(96, generator=g)
    out, summed = torch.ops.fastgrpo.add_rms_norm(x, r if residual else None, w, 1e-6)
    want_sum = r + x if residual else x
    want = w * (want_sum * torch.rsqrt(want_sum.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@interpreter
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kernel(qk_norm):
    """Rotary (and Qwen3's per-head q/k norms) of one fused q/k/v output, K/V written into their pages."""
    from fastgrpo.kernels import decode_ops  # noqa: F401

    g = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim, page = 5, 6, 2, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.rand(tokens, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q_w, k_w = (torch.randn(dim, generator=g), torch.randn(dim, generator=g)) if qk_norm else (None, None)
    slots = torch.tensor([3, 9, 4, 17, 0])
    caches = [torch.zeros(6, page, kv_heads, dim) for _ in range(2)]
    q = torch.ops.fastgrpo.rope_store(qkv, cos, sin, q_w, k_w, *caches, slots, heads, 1e-6)

    want_q, want_k, want_v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    want_q, want_k, want_v = (t.reshape(tokens, -1, dim) for t in (want_q, want_k, want_v))
    if qk_norm:
        norm = lambda t, w: w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))
        want_q, want_k = norm(want_q, q_w), norm(want_k, k_w)
    rope = lambda t: t * cos[:, None] + rotate_half(t) * sin[:, None]
    torch.testing.assert_close(q, rope(want_q), rtol=1e-6, atol=1e-6)
    k_cache, v_cache = (c.flatten(0, 1) for c in caches)
    torch.testing.assert_close(k_cache[slots], rope(want_k), rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache[slots], want_v)
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@interpreter
def test_silu_mul_kernel():
    from fastgrpo.kernels import decode_ops  # noqa: F401

    gate_up = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(0))  # two column blocks
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(torch.ops.fastgrpo.silu_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               rtol=1e-6, atol=1e-6)  # fmt: skip


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("temperature,top_k", [(0, 0), (1.0, 0), (0.6, 0), (0.6, 300), (1.0, 1), (0, 300)])
def test_fused_sampler_matches_the_pytorch_sampler(dtype, temperature, top_k):
    """Same tokens, logprobs to 1e-6, over several vocabulary tiles (the last one partial), from logits in the
    lm_head's dtype, with top-k as the engine passes it (torch.topk's k-th value)."""
    from fastgrpo.kernels.sampling import BLOCK_V, fused_sample

    rows, vocab = 64, 2 * BLOCK_V + 333
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[3, 5] = logits[3, BLOCK_V + 7] = logits[3].max() + 1  # a tie across tiles: the first index wins
    u = None if temperature == 0 else uniforms(7, torch.arange(rows), torch.full((rows,), 2))
    kth = torch.topk(logits, top_k, dim=-1).values[:, -1].float() if top_k else None
    tokens, logprobs = fused_sample(logits, temperature, u, kth)
    params = SamplingParams(temperature=temperature, top_k=top_k)
    want_tokens, want_logprobs = sample(logits.float(), params, u)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-6)
    if temperature == 0:
        assert tokens[3] == 5
    elif top_k == 1:  # a maximum (row 3 has two; bf16 rows may tie too), each of probability 1 / ties
        top = logits.max(-1, keepdim=True).values
        assert torch.equal(logits.gather(1, tokens[:, None]), top)
        torch.testing.assert_close(logprobs, -(logits == top).sum(-1).float().log(), rtol=0, atol=1e-6)
    elif top_k == 0:  # the draws spread over the tiles
        assert len(set((tokens // BLOCK_V).tolist())) == 3
    if top_k and temperature:
        kept = logits.float() >= kth[:, None]
        assert kept.gather(1, tokens[:, None]).all()


@interpreter
@pytest.mark.slow
def test_triton_engine_samples_the_torch_engines_tokens():
    """The fused kernels end to end (decode layers, paged attention, fused sampler) against the CPU engine, seeded:
    the same tokens, logprobs to 1e-5."""
    model = tiny("llama")  # one KV head: the fewest interpreted attention programs
    prompts = prompts_for(4)[:4]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11, **NO_STOP)
    triton_engine = Engine(model, block_size=4, attention="triton", max_num_batched_tokens=16)
    assert triton_engine.layers == "fused" and triton_engine.fused_kernels
    got = triton_engine.generate(prompts, n=2, params=params)
    want = Engine(model, block_size=4, attention="torch", max_num_batched_tokens=16).generate(prompts, n=2,
                                                                                           params=params)
    for g_group, w_group in zip(got, want, strict=True):
        for g_c, w_c in zip(g_group, w_group, strict=True):
            assert g_c.token_ids == w_c.token_ids
            torch.testing.assert_close(torch.tensor(g_c.logprobs), torch.tensor(w_c.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_decode_forward_has_no_host_syncs(ops):
    """One graph, no graph breaks (torch._dynamo.explain) for a decode step's forward: nothing in it reads a device
    value on the host, so a CUDA graph captures it whole."""
    from fastgrpo.sampling.attention import build_paged_batch
    from fastgrpo.sampling.batch import DecodeBatch

    if ops == "triton":
        from fastgrpo.kernels import decode_ops  # noqa: F401
    engine = Engine(tiny("qwen3"), block_size=4)
    engine.decoder.ops = ops
    seqs, pages, context = 6, 4, 13
    kv_cache = torch.zeros(engine.num_layers, 2, seqs * pages, 4, engine.num_kv_heads, engine.head_dim)
    batch = DecodeBatch(seqs, pages, 4, engine.device)
    batch.seqs, batch.context_h[:seqs], batch.pages_h[:seqs] = [None] * seqs, context - 1, pages
    batch.block_tables[:seqs] = torch.arange(seqs * pages, dtype=torch.int32).view(seqs, pages)
    rows = batch.inputs()
    paged = build_paged_batch(kv_cache, [], [], [], [], "torch", engine.num_heads // engine.num_kv_heads, rows=rows,
                              rows_max_context=context)  # fmt: skip
    try:
        with engine._sampling_mode():
            explained = torch._dynamo.explain(engine._forward)(rows["input_ids"], rows["positions"], paged)
    finally:
        torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
