"""The engine on the attention layers of 2026's models (tiny random fp32 models from transformers' own configs): sliding
windows (Mistral's keyword, Qwen2's per-layer, Gemma 2/3/4's, gpt-oss's), softcaps (Gemma 2), sinks (gpt-oss),
KV-shared layers and per-layer head dims (Gemma 4), keys and values of different head dims (DeepSeek-V3's MLA).

Each family samples what its own forward computes: greedy tokens equal `model.generate`'s past the window (8
positions; prompts up to 37 tokens, 24 new tokens), sampled logprobs equal a full forward's, with G children sharing
the prompt, preemption in a small pool and multi-turn rollouts; on the torch backend and the Triton kernels under the
interpreter. Pages of sliding layers that leave the window go back to their pool."""

import pytest
import torch
from sampling_helpers import (
    NO_STOP,
    TURN_STOPS,
    full_forward_logits,
    hf_greedy,
    prompts_for,
    reprefill,
    tokens_of,
    tool,
)
from transformers import AutoConfig, AutoModelForCausalLM

from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.sampling import attention as attention_module
from fastgrpo.sampling.attention import PLAIN, reference_paged_attention
from fastgrpo.sampling.pages import first_live_page

WINDOW, BLOCK = 8, 4
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ALTERNATING = ["sliding_attention", "full_attention"] * 2
FAMILIES = {
    "mistral": dict(head_dim=16, sliding_window=WINDOW),  # the window as a keyword, every layer
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),  # layers 2 and 3 slide
    "gemma2": dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=1.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING),
    "gpt_oss": dict(head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING, num_local_experts=4,
                    num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # 6 layers: 2 KV-shared; global layers with head dim 32 and one KV head, keys as values; per-layer inputs
    "gemma4_text": dict(head_dim=16, sliding_window=WINDOW, num_hidden_layers=6, layer_types=ALTERNATING[:2] * 3,
                        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                        num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=128),
    # MLA: keys of 24 dims (16 + 8 rotary), values of 16
    "deepseek_v3": dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=1, topk_group=1, num_key_value_heads=4),
}
# The Triton kernel runs one head dim for keys and values: MLA samples on the torch backend (refused on triton).
TRITON_FAMILIES = [f for f in FAMILIES if f != "deepseek_v3"]


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # peaked outputs (greedy ties would hinge on the last ulp) and sinks that matter
        model.get_output_embeddings().weight.normal_(0.0, 0.3)
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 2.0)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, build(request.param)


def prompts():
    return prompts_for(BLOCK)  # 1, 3, 4, 5, 9 and 37 tokens


def engine_for(model, **config):
    return Engine(model, block_size=BLOCK, fused_layers=False, **{"attention": "torch", **config})


def triton_prompts():
    """The Triton interpreter runs each kernel program in Python (~50 ms a program): 9 and 37 tokens (across pages,
    past the window from the prompt on), one completion each, keep a family at about 20 s.
    G children sharing the prompt's pages are the torch tests' (the kernel reads a page table either way)."""
    return [prompts()[i] for i in (4, 5)]


def assert_matches_the_model(model, engine, n=2, new_tokens=24, chosen=prompts):
    """Greedy tokens equal model.generate's; sampled logprobs (T=1) equal a full forward's log-softmax."""
    greedy = engine.generate(chosen(), n=n, params=SamplingParams(temperature=0, max_new_tokens=new_tokens,
                                                                  **NO_STOP))  # fmt: skip
    for prompt, group in zip(chosen(), greedy, strict=True):
        want = hf_greedy(model, prompt, new_tokens)
        assert all(c.token_ids == want for c in group), (prompt, [c.token_ids for c in group], want)
    sampled = engine.generate(chosen(), n=n, params=SamplingParams(temperature=1.0, max_new_tokens=new_tokens,
                                                                   seed=3, **NO_STOP))  # fmt: skip
    for prompt, group in zip(chosen(), sampled, strict=True):
        for c in group:
            logp = full_forward_logits(model, prompt, c.token_ids).log_softmax(-1)
            want = logp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)
    assert engine.stats.leaked_blocks == 0


def test_the_probe_reads_each_layer(family):
    name, model = family
    layers = Engine(model, attention="torch").layer_model.layers
    windows = [layer.window for layer in layers]
    if name == "mistral":
        assert windows == [WINDOW] * 4
    elif name == "qwen2":
        assert windows == [None, None, WINDOW, WINDOW]
    elif name == "gemma4_text":  # the last two layers read layers 2 and 3's pages (the last of each kind)
        assert windows == [WINDOW, None] * 3 and [layer.source for layer in layers] == [0, 1, 2, 3, 2, 3]
        assert [(layer.kv_heads, layer.key_dim) for layer in layers[:2]] == [(2, 16), (1, 32)]
    elif name == "deepseek_v3":
        assert {(layer.key_dim, layer.value_dim) for layer in layers} == {(24, 16)}
    else:
        assert windows == [WINDOW, None] * 2
    assert all(layer.softcap == (name == "gemma2") and layer.sinks == (name == "gpt_oss") for layer in layers)


def test_greedy_and_sampled_match_the_model(family):
    name, model = family
    assert_matches_the_model(model, engine_for(model))


@pytest.mark.slow
@pytest.mark.parametrize("name", TRITON_FAMILIES)
def test_triton_kernels_match_the_model(name):
    model = build(name)
    assert_matches_the_model(model, engine_for(model, attention="triton"), n=1, new_tokens=8, chosen=triton_prompts)


def test_preemption_in_a_small_pool_changes_nothing(family):
    name, model = family
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5, **NO_STOP)
    want = engine_for(model).generate(prompts(), n=3, params=params)
    small = engine_for(model, num_blocks=20, max_num_seqs=4)
    got = small.generate(prompts(), n=3, params=params)
    assert small.stats.num_preemptions > 0 and small.stats.leaked_blocks == 0
    assert tokens_of(got) == tokens_of(want)


def test_multi_turn_rollouts_match_the_reprefill_loop(family):
    """Parked sequences keep their pages (full and window) while the tool runs; its tokens continue them."""
    name, model = family
    engine = engine_for(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=2, stop_token_ids=TURN_STOPS)
    got = engine.generate(prompts(), n=2, params=params, turn_end=tool)
    assert engine.stats.num_turns > 0 and engine.stats.leaked_blocks == 0
    assert tokens_of(got) == tokens_of(reprefill(engine_for(model), prompts(), 2, params, tool))


def test_window_pages_go_back_to_the_pool():
    """One completion of 200 tokens on Gemma 3's layers: the full-attention layers hold every page, the sliding ones
    at most the window's (ceil((8 - 1) / 4) + 1 = 3 pages, and the page the next token starts)."""
    model = build("gemma3_text")
    engine = engine_for(model)
    engine.generate([[5, 6, 7]], n=1, params=SamplingParams(temperature=0, max_new_tokens=200, **NO_STOP))
    logical, window = engine.stats.peak_pages
    assert logical == -(-(3 + 200) // BLOCK) and window <= 4
    assert engine.stats.leaked_blocks == 0


def test_window_pool_is_sized_by_the_logical_pool_and_the_seats():
    """pages.window_pool_pages: a window (ceil(7 / 4) + 2 = 4 pages) for each sequence the logical pool holds at full
    length (37 + 100 tokens: 35 pages), at most one for each of the 8 seats and one more, plus a step's prefill (64
    tokens: 16 pages). A pool that small still samples what the model computes: the scheduler preempts when the window
    pool runs dry, as for the logical one."""
    model = build("gemma3_text")
    params = SamplingParams(temperature=0, max_new_tokens=100, **NO_STOP)
    want = engine_for(model).generate(prompts(), n=2, params=params)
    for num_blocks, pages in ((1000, 9 * 4 + 16), (140, 4 * 4 + 16), (70, 2 * 4 + 16)):
        engine = engine_for(model, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=num_blocks)
        got = engine.generate(prompts(), n=2, params=params)
        assert engine.stats.window_blocks == (pages,) and engine.stats.leaked_blocks == 0
        assert tokens_of(got) == tokens_of(want)
        assert engine.stats.peak_pages[1] <= pages


def test_first_live_page():
    # the next token at position c reads c - window + 1 .. c
    assert [first_live_page(c, 8, 4) for c in (0, 7, 8, 10, 11, 12, 15)] == [0, 0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_each_variant_is_needed(name, monkeypatch):
    """Attention computed plain (no window, cap or sinks) samples other tokens: the tests above see each one."""
    model = build(name)
    plain = attention_module.attend
    monkeypatch.setattr(attention_module, "attend", lambda *args, variant=PLAIN: plain(*args))
    got = engine_for(model).generate(prompts(), n=1, params=SamplingParams(temperature=0, max_new_tokens=24,
                                                                           **NO_STOP))  # fmt: skip
    assert any(g[0].token_ids != hf_greedy(model, p, 24) for p, g in zip(prompts(), got, strict=True))


def test_mla_is_refused_on_the_triton_kernel_in_one_line():
    model = build("deepseek_v3")
    with pytest.raises(ValueError, match=r"needs attention with value_dim, which attention='triton' does not") as e:
        Engine(model, attention="triton")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("variant", ["window", "softcap", "sinks", "all"])
def test_triton_kernel_variants_match_the_reference(variant):
    """The paged kernel (interpreter, fp32) against the reference on a mixed batch: decode rows and chunks that start
    past the window (whole tiles skipped) and inside it."""
    from fastgrpo.kernels.paged_attention import paged_attention, tiles_for
    from fastgrpo.sampling.attention import Variant, attention_tiles

    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 64
    q_lens, ctx_lens = [1, 1, 17, 5], [3, 70, 90, 21]
    q = torch.randn(sum(q_lens), heads, dim)
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim).unbind(0)
    tables = torch.randint(0, num_blocks, (4, 23), dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    sinks = torch.randn(heads) * 2
    pick = dict(window=dict(window=WINDOW), softcap=dict(softcap=0.7), sinks=dict(sinks=sinks),
                all=dict(window=WINDOW, softcap=0.7, sinks=sinks))[variant]
    context = torch.tensor(ctx_lens, dtype=torch.int32)
    want = reference_paged_attention(q, k_cache, v_cache, tables, context, starts, 0.25, variant=Variant(**pick))
    tiles = tiles_for(heads // kv_heads, max(q_lens), torch.float32)
    seqs, firsts = attention_tiles(q_lens, tiles.block_m // (heads // kv_heads))
    got = paged_attention(q, k_cache, v_cache, tables, context, starts, torch.tensor(seqs, dtype=torch.int32),
                          torch.tensor(firsts, dtype=torch.int32), 0.25, tiles, **pick)  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    plain = reference_paged_attention(q, k_cache, v_cache, tables, context, starts, 0.25)
    assert (plain - want).abs().max() > 1e-2  # the variant changes the output


# -- fp8 pages: the families whose keys and values kv_scales bounds from the weights --

FP8_FAMILIES = ["mistral", "qwen2", "gemma2", "gemma3_text", "gpt_oss"]


@pytest.mark.parametrize("name", FP8_FAMILIES)
def test_fp8_scales_bound_every_key_and_value(name, monkeypatch):
    """No key or value passes its scale's 448 (nothing clamped), and the scales are not loose (the largest use the
    top bits of e4m3's range); sampled tokens stay close to the model's (fp8 rounds each cached value by <= 2^-4)."""
    model = build(name)
    seen = []
    quantize = attention_module.quantize_kv
    monkeypatch.setattr(attention_module, "quantize_kv",
                        lambda x, scale: seen.append((x.float() / scale[:, None]).abs().amax().item()) or
                        quantize(x, scale))  # fmt: skip
    engine = engine_for(model, kv_cache_dtype="fp8")
    out = engine.generate(prompts(), n=2, params=SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, **NO_STOP))
    assert 448 / 64 < max(seen) <= 448, max(seen)
    errors = []
    for prompt, group in zip(prompts(), out, strict=True):
        for c in group:
            logp = full_forward_logits(model, prompt, c.token_ids).log_softmax(-1)
            errors.append((logp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0] - torch.tensor(c.logprobs)).abs())
    assert torch.cat(errors).mean() < 0.1, torch.cat(errors).mean()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_fp8_triton_kernels_sample_the_torch_fp8_tokens(name):
    model = build(name)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3, **NO_STOP)
    want = engine_for(model, kv_cache_dtype="fp8").generate(triton_prompts(), params=params)
    got = engine_for(model, kv_cache_dtype="fp8", attention="triton").generate(triton_prompts(), params=params)
    assert tokens_of(got) == tokens_of(want)


@pytest.mark.parametrize("name", ["gemma4_text", "deepseek_v3"])
def test_fp8_is_refused_in_one_line_where_the_keys_are_not_bounded(name):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' bounds") as e:
        engine_for(build(name), kv_cache_dtype="fp8")
    assert "\n" not in str(e.value)
