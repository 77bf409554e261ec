"""kv_cache_dtype="fp8": e4m3 KV pages with one power-of-two scale per layer, K or V, and KV head, bounded from the
weights (fastgrpo.sampling.decode_layers.kv_scales).

- The scales: no key or value the model produces passes e4m3's 448, and an input aligned with a weight row reaches
  more than half of it (the bound is tight; the scale is its power of two).
- The torch path: the fused layers and transformers' modules write the same pages; against the model-dtype cache, the
  greedy tokens and logprobs, and the sampler/trainer logprob mismatch that the IS correction sees (printed with -s).
- The Triton kernels under the interpreter against the torch fp8 path (fp32 products, pages quantized with torch).
- The option: EngineConfig, the engine, TrainConfig and the trainer's engine.
The AOT builds for sm_90 (e4m3 conversions in PTX and SASS, no spills, half the KV bytes copied per decode step) are
in tests/test_aot.py.
"""

import math
import os

import pytest
import torch
from helpers import assert_no_worse
from paged_attention_helpers import batches, dense_attention, make_cache
from sampling_helpers import FAMILIES, NO_STOP, full_forward_logits, prompts_for, tiny

from fastgrpo.kernels.paged_attention import attention_tiles, paged_attention, tiles_for
from fastgrpo.sampling import Engine, EngineConfig, SamplingParams
from fastgrpo.sampling import attention as attention_module
from fastgrpo.sampling.attention import FP8, FP8_MAX, quantize_kv, reference_paged_attention, store_kv
from fastgrpo.sampling.decode_layers import kv_scales, linear_weight, rotate_half
from fastgrpo.train.rollout import Rollout, sampler_importance_weights

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="Triton kernels: CUDA or the interpreter")
GREEDY = SamplingParams(temperature=0, max_new_tokens=32, **NO_STOP)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=32, seed=7, **NO_STOP)


def with_biases(model):
    """Qwen2's k/v biases start at zero; random ones exercise the bound's |b| term."""
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0.0, 0.5)
    return model


def power_of_two_scales(x: torch.Tensor) -> torch.Tensor:  # x [..., Hkv, D] -> [Hkv] fp32
    amax = x.abs().flatten(0, -3).amax(0).amax(-1).float()
    return torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))


# -- the scales --


@pytest.mark.parametrize("family", FAMILIES)
def test_scales_bound_every_key_and_value(family, monkeypatch):
    model = with_biases(tiny(family))
    scales = kv_scales(model)  # [layers, 2, Hkv]
    assert scales.shape == (2, 2, model.config.num_key_value_heads)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two
    seen = []
    quantize = attention_module.quantize_kv
    monkeypatch.setattr(attention_module, "quantize_kv",
                        lambda x, scale: seen.append((x.float() / scale[:, None]).abs().amax().item()) or
                        quantize(x, scale))  # fmt: skip
    Engine(model, block_size=4, kv_cache_dtype="fp8", fused_layers=False).generate(prompts_for(4), n=2,
                                                                                  params=SAMPLED)  # fmt: skip
    # Nothing was clamped; random inputs use the top bits of e4m3's range (~1/3 of the bound here).
    assert 448 / 16 < max(seen) <= 448, max(seen)

    # An input aligned with a value row: the residual w_j * g (normalised by the input RMSNorm) gives
    # |v_j| = sqrt(H) ||w_j * g|| + |b_j|, the bound itself, which the power-of-two scale puts in (224, 448].
    layer = model.model.layers[0]
    weight, bias = linear_weight(layer.self_attn.v_proj)
    gamma = layer.input_layernorm.weight.float()
    row_bounds = model.config.hidden_size**0.5 * (weight * gamma).norm(dim=1) + (0 if bias is None else bias.abs())
    j = int(row_bounds[: layer.self_attn.head_dim].argmax())  # a row of KV head 0
    sign = 1.0 if bias is None or bias[j] >= 0 else -1.0
    with torch.no_grad():
        v = layer.self_attn.v_proj(layer.input_layernorm(sign * weight[j] * gamma))
    assert 224 < v[j].abs().item() / scales[0, 1, 0].item() <= 448 * (1 + 1e-5)


# -- the torch path --


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layers_and_transformers_modules_write_the_same_fp8_pages(family):
    """Both quantize through attention.store_kv with the same scales: bit-equal tokens and logprobs."""
    model = tiny(family)
    fused = Engine(model, block_size=4, kv_cache_dtype="fp8", max_num_batched_tokens=24)
    plain = Engine(model, block_size=4, kv_cache_dtype="fp8", max_num_batched_tokens=24, fused_layers=False)
    assert fused.layers == "fused" and plain.layers.startswith("transformers")
    for params in (GREEDY, SAMPLED):
        got, want = fused.generate(prompts_for(4), n=2, params=params), plain.generate(prompts_for(4), n=2,
                                                                                      params=params)
        assert [(c.token_ids, c.logprobs) for g in got for c in g] == [(c.token_ids, c.logprobs) for g in want
                                                                       for c in g]  # fmt: skip


def greedy_against_the_model_dtype_cache(model) -> dict:
    """Greedy completions of the fp8 cache and the model-dtype cache: positions with the same token, and the logprob
    differences over each completion's common prefix (before the first different token)."""
    prompts = prompts_for(4)
    want = Engine(model, block_size=4).generate(prompts, params=GREEDY)
    got = Engine(model, block_size=4, kv_cache_dtype="fp8").generate(prompts, params=GREEDY)
    same, total, diffs = 0, 0, []
    for (w,), (g,) in zip(want, got, strict=True):
        total += len(w.token_ids)
        same += sum(a == b for a, b in zip(w.token_ids, g.token_ids, strict=True))
        prefix = next((i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids, strict=True)) if a != b),
                      len(w.token_ids))
        diffs += (torch.tensor(w.logprobs[:prefix]) - torch.tensor(g.logprobs[:prefix])).abs().tolist()
    diffs = torch.tensor(diffs)
    return dict(same=same, total=total, max=diffs.max().item(), mean=diffs.mean().item())


def sampler_trainer_mismatch(model, kv_cache_dtype: str) -> dict:
    """Seeded completions (4 per prompt) from the engine; the "trainer" logprobs of the same tokens from the model's
    own full forward; TRL's sampling/* metrics of the two (fastgrpo.train.rollout), per-token truncation and the
    default per-sequence mask."""
    prompts = prompts_for(4)
    outputs = Engine(model, block_size=4, kv_cache_dtype=kv_cache_dtype).generate(prompts, n=4, params=SAMPLED)
    completions = [(prompt, c) for prompt, group in zip(prompts, outputs, strict=True) for c in group]
    trainer = []
    for prompt, c in completions:
        logp = full_forward_logits(model, prompt, c.token_ids).log_softmax(-1)
        trainer.append(logp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0])
    num = len(completions)
    rollout = Rollout(prompt_ids=[p for p, _ in completions], completion_ids=[c.token_ids for _, c in completions],
                      truncated=torch.zeros(num, dtype=torch.bool), advantages=torch.zeros(num),
                      loss_mask=[[1] * len(c.token_ids) for _, c in completions], old_logps=trainer,
                      sampling_logps=[torch.tensor(c.logprobs) for _, c in completions])  # fmt: skip
    _, token = sampler_importance_weights(rollout, "token_truncate", None, 3.0)
    sequence_weights, sequence = sampler_importance_weights(rollout, "sequence_mask", None, 3.0)
    return dict(mean=token["sampling/sampling_logp_difference/mean"],
                max=token["sampling/sampling_logp_difference/max"],
                token_ratio=(token["sampling/importance_sampling_ratio/min"],
                             token["sampling/importance_sampling_ratio/max"]),
                sequence_ratio=(sequence["sampling/importance_sampling_ratio/min"],
                                sequence["sampling/importance_sampling_ratio/max"]),
                masked=int((sequence_weights == 0).sum()), sequences=len(completions))  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_cache_against_the_model_dtype_cache(family):
    """The measurements of docs/sampling.md (run with -s to see them). e4m3 keeps 3 mantissa bits: each cached value
    moves by up to 2^-4 of itself. On these tiny random models, whose peaked outputs make logprobs sensitive, that
    moves the greedy logprobs by 0.02-0.035 on average and 0.19 at most before the first different token, and 7-47%
    of the greedy positions change token (a completion rarely returns once it diverges). The sampler/trainer mismatch
    grows from ~0.001 (the bf16 cache: rounding only) to 0.026-0.045 mean |logp difference|: per-token ratios within
    [0.82, 1.23], per-sequence ones (32 tokens) within [0.38, 1.75], none past the default mask's C_max = 3
    (measured; the bounds below leave room of ~1.5x)."""
    model = tiny(family)
    fp32 = greedy_against_the_model_dtype_cache(model)
    bf16_model = tiny(family).to(torch.bfloat16)
    bf16 = greedy_against_the_model_dtype_cache(bf16_model)
    mismatch = {kv: sampler_trainer_mismatch(bf16_model, kv) for kv in ("auto", "fp8")}
    print(f"\n{family} greedy, fp8 vs fp32 cache: {fp32}\n{family} greedy, fp8 vs bf16 cache: {bf16}")
    for kv, m in mismatch.items():
        print(f"{family} bf16 model, {kv} cache, sampler vs trainer: {m}")
    for greedy in (fp32, bf16):
        assert greedy["same"] >= greedy["total"] / 3 and greedy["mean"] < 0.06 and greedy["max"] < 0.3, greedy
    auto, fp8 = mismatch["auto"], mismatch["fp8"]
    assert auto["mean"] < 0.003 and 5 * auto["mean"] < fp8["mean"] < 0.06, (auto, fp8)
    assert 0.75 < fp8["token_ratio"][0] and fp8["token_ratio"][1] < 1.33 and fp8["masked"] == 0, fp8


# -- the Triton kernels (interpreter, fp32 products) against the torch fp8 path --


@interpreter
@pytest.mark.parametrize("batch", ["decode_block", "prefill", "mixed"])
@pytest.mark.parametrize("group", [1, 6])
def test_triton_attention_reads_fp8_pages(batch, group):
    """Pages quantized with torch (quantize_kv), two KV heads with scales 2^6 apart. Ground truth: float64 dense
    attention over the dequantized pages; the torch reference reads the fp8 pages with their scales in fp32."""
    seqs = batches(16)[batch]
    tables, block_tables, k64, v64 = make_cache(seqs, 2, 32, 16, share_prefix=True, seed=2)
    spread = torch.tensor([8.0, 1 / 8])[:, None]  # [Hkv, 1]
    k, v = (k64 * spread).float(), (v64 * spread * 2).float()
    k_scale, v_scale = power_of_two_scales(k), power_of_two_scales(v)
    assert k_scale[0] / k_scale[1] == 64
    k8, v8 = (quantize_kv(x.flatten(0, 1), s).view(x.shape) for x, s in ((k, k_scale), (v, v_scale)))
    q_lens = [q for _, q in seqs]
    q = torch.randn(sum(q_lens), 2 * group, 32, generator=torch.Generator().manual_seed(3))
    context_lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    query_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 32**-0.5

    dequantized = [x8.double() * s.double()[:, None] for x8, s in ((k8, k_scale), (v8, v_scale))]
    truth = dense_attention(q.double(), *dequantized, tables, seqs, scale)
    ref = reference_paged_attention(q, k8, v8, block_tables, context_lens, query_starts, scale, k_scale=k_scale,
                                    v_scale=v_scale)  # fmt: skip
    tiles = tiles_for(group, max(q_lens), torch.float32)
    tile_seqs, tile_starts = (torch.tensor(t, dtype=torch.int32)
                              for t in attention_tiles(q_lens, tiles.block_m // group))  # fmt: skip
    fast = paged_attention(q, k8, v8, block_tables, context_lens, query_starts, tile_seqs, tile_starts, scale, tiles,
                           k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert_no_worse(f"reference fp8[{batch}]", ref, ref, truth, torch.float32)
    assert_no_worse(f"triton fp8[{batch}]", fast, ref, truth, torch.float32)


def quarter_turns(tokens: int, dim: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] of rotations by multiples of 90 degrees: exactly 0 and +-1, so rotary needs no rounding."""
    turns = torch.randint(0, 4, (tokens, dim // 2), generator=g)
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0])[turns]
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0])[turns]
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


def e4m3_values(shape, g: torch.Generator) -> torch.Tensor:
    """Random normal (not subnormal) e4m3 values, both signs: magnitudes 2^-6 .. 448."""
    exponent = torch.randint(-6, 9, shape, generator=g).float()
    mantissa = 1 + torch.randint(0, 8, shape, generator=g).float() / 8
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return (sign * mantissa * torch.exp2(exponent)).clamp(-FP8_MAX, FP8_MAX)


@interpreter
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kernel_writes_fp8_pages(qk_norm):
    """The kernel's pages equal torch's store_kv byte for byte. Triton 3.9's interpreter rounds fp32 -> e4m3 wrongly
    (7.94 -> 4.0: a mantissa carry is lost; subnormals truncate), so the inputs need no rounding: e4m3 values times
    their head's scale, rotated by quarter turns; with q/k norms, keys of one magnitude per head, which
    normalise to exactly +-1, times e4m3 norm weights. One token's values are 2^20x too large: clamped to +-448
    (its keys too, without the norms).
    The rounding itself is the GPU's cvt.rn.satfinite (tests/test_aot.py), the same round-to-nearest-even with
    saturation as torch's clamp + .to(float8_e4m3fn)."""
    from fastgrpo.kernels import decode_ops  # noqa: F401

    g = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim, page = 5, 6, 2, 16, 4
    k_scale, v_scale = torch.tensor([2.0**-3, 2.0**4]), torch.tensor([2.0**5, 2.0**-7])
    q = torch.randn(tokens, heads, dim, generator=g)
    k = e4m3_values((tokens, kv_heads, dim), g) * k_scale[:, None]
    v = e4m3_values((tokens, kv_heads, dim), g) * v_scale[:, None]
    q_w = k_w = None
    if qk_norm:
        q_w = torch.randn(dim, generator=g)
        k_w = e4m3_values((dim,), g) / 8  # keys +-1 * k_w, over k_scale <= 448 but for the clamped token
        k = torch.exp2(torch.randint(-3, 3, (tokens, kv_heads, 1), generator=g).float()) * torch.sign(k)
        k_scale = torch.tensor([2.0**-3, 2.0**-3])
    k[2] *= 2.0**20  # (the q/k norms normalise it back)
    v[2] *= 2.0**20
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], -1)
    cos, sin = quarter_turns(tokens, dim, g)
    slots = torch.tensor([3, 9, 4, 17, 0])
    caches = [torch.zeros(6, page, kv_heads, dim, dtype=FP8) for _ in range(2)]
    eps = 2.0**-100  # absorbed by the sums of squares (>= 2^-6): the norms stay exact
    got_q = torch.ops.fastgrpo.rope_store(qkv, cos, sin, q_w, k_w, *caches, slots, heads, eps, k_scale, v_scale)

    norm = lambda t, w: w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))
    rope = lambda t: t * cos[:, None] + rotate_half(t) * sin[:, None]
    want_q, want_k = (rope(norm(q, q_w)), rope(norm(k, k_w))) if qk_norm else (rope(q), rope(k))
    want = [torch.zeros_like(c) for c in caches]
    store_kv(*want, slots, want_k, v, k_scale, v_scale)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    for got_cache, want_cache in zip(caches, want, strict=True):
        assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    clamped = [want[1]] if qk_norm else want
    assert all(bool((c.flatten(0, 1)[slots[2]].float().abs() == FP8_MAX).all()) for c in clamped)


@interpreter
@pytest.mark.slow
def test_triton_attention_engine_samples_the_torch_fp8_engines_tokens():
    """The engine end to end with Triton paged attention over fp8 pages (and the fused sampler), seeded, against the
    torch fp8 engine: the same tokens, logprobs to 1e-5. transformers' modules store the pages (torch's rounding):
    the interpreter's wrong e4m3 rounding would make the fused rope_store's pages differ."""
    model = tiny("llama")  # one KV head: the fewest interpreted attention programs
    prompts = prompts_for(4)[:4]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11, **NO_STOP)
    common = dict(block_size=4, max_num_batched_tokens=16, kv_cache_dtype="fp8", fused_layers=False)
    got = Engine(model, attention="triton", **common).generate(prompts, n=2, params=params)
    want = Engine(model, attention="torch", **common).generate(prompts, n=2, params=params)
    for g_group, w_group in zip(got, want, strict=True):
        for g_c, w_c in zip(g_group, w_group, strict=True):
            assert g_c.token_ids == w_c.token_ids
            torch.testing.assert_close(torch.tensor(g_c.logprobs), torch.tensor(w_c.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_fp8_decode_forward_has_no_host_syncs(ops):
    """As tests/test_decode_layers.py's check over model-dtype pages: one graph, no graph breaks, so a CUDA graph
    captures an fp8 decode step whole (the quantizing store and the scaled reads add no host read)."""
    from fastgrpo.sampling.attention import build_paged_batch
    from fastgrpo.sampling.batch import DecodeBatch

    if ops == "triton":
        from fastgrpo.kernels import decode_ops  # noqa: F401
    engine = Engine(tiny("qwen3"), block_size=4, kv_cache_dtype="fp8")
    engine.decoder.ops = ops
    seqs, pages, context = 6, 4, 13
    kv_cache = torch.zeros(engine.num_layers, 2, seqs * pages, 4, engine.num_kv_heads, engine.head_dim, dtype=FP8)
    batch = DecodeBatch(seqs, pages, 4, engine.device)
    batch.seqs, batch.context_h[:seqs], batch.pages_h[:seqs] = [None] * seqs, context - 1, pages
    batch.block_tables[:seqs] = torch.arange(seqs * pages, dtype=torch.int32).view(seqs, pages)
    rows = batch.inputs()
    paged = build_paged_batch(kv_cache, [], [], [], [], "torch", engine.num_heads // engine.num_kv_heads, rows=rows,
                              rows_max_context=context, query_dtype=engine.dtype,
                              kv_scales=kv_scales(engine.hf_model))  # fmt: skip
    try:
        with engine._sampling_mode():
            explained = torch._dynamo.explain(engine._forward)(rows["input_ids"], rows["positions"], paged)
    finally:
        torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# -- the option --


def test_engine_config_validates_kv_cache_dtype():
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or 'fp8', got 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs attention 'auto', 'torch' or 'triton'"):
        EngineConfig(kv_cache_dtype="fp8", attention="flash", block_size=256)


def test_engine_allocates_fp8_pages_and_takes_each_calls_scales():
    model = tiny("qwen2")
    engine = Engine(model, block_size=4, kv_cache_dtype="fp8")
    assert engine.kv_dtype == FP8 and Engine(model).kv_dtype == torch.float32
    seen = []
    forward = engine._forward
    engine._forward = lambda ids, pos, paged, keep=0, states=None: seen.append(
        (paged.kv_cache.dtype, engine._kv_scales.clone())) or forward(ids, pos, paged, keep, states)
    params = SamplingParams(temperature=0, max_new_tokens=3, **NO_STOP)
    before = kv_scales(model)
    engine.generate([[5, 6, 7]], params=params)
    assert engine._kv_scales is None  # released with the pool
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.mul_(8)  # as a training step would: the next call follows
    engine.generate([[5, 6, 7]], params=params)
    after = kv_scales(model)
    assert {dtype for dtype, _ in seen} == {FP8} and len(seen) == 6
    assert all(torch.equal(scales, before) for _, scales in seen[:3])
    assert all(torch.equal(scales, after) for _, scales in seen[3:])
    assert torch.equal(after[1, 1], before[1, 1] * 8) and torch.equal(after[0], before[0])


def test_fp8_needs_a_model_whose_keys_and_values_it_can_bound():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' bounds .* GPT2LMHeadModel is not one of"):
        Engine(gpt2, kv_cache_dtype="fp8")
    assert Engine(gpt2, attention="torch").kv_dtype == torch.float32  # the model-dtype cache takes any model


def test_lora_scales_include_the_adapters():
    """peft's LoRA layers run transformers' modules; the bound reads base + B A * scaling, as a merge would."""
    peft = pytest.importorskip("peft")
    model = tiny("qwen2")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["k_proj", "v_proj"],
                                                      init_lora_weights=False))  # fmt: skip
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.mul_(40)  # adapters large enough to change the scales
    engine = Engine(lora, block_size=4, kv_cache_dtype="fp8")
    assert engine.layers.startswith("transformers")
    with_adapters = kv_scales(engine.hf_model)
    engine.generate(prompts_for(4), n=2, params=SAMPLED)
    merged = lora.merge_and_unload()
    assert torch.equal(with_adapters, kv_scales(merged)) and not torch.equal(with_adapters, kv_scales(tiny("qwen2")))


def test_a_4bit_base_is_read_as_the_map_it_computes():
    """A bitsandbytes 4-bit base (--load-in-4bit under LoRA): the weight the bound reads is the dequantized one the
    layer multiplies by, not the float weight it was quantized from."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    quantized = bnb.nn.Linear4bit(64, 32, compute_dtype=torch.float32, quant_type="nf4")
    quantized.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type="nf4")
    quantized.bias = torch.nn.Parameter(linear.bias.data.clone())
    quantized = quantized.to("cpu")  # quantizes
    weight, bias = linear_weight(quantized)
    with torch.no_grad():
        computed = (quantized(torch.eye(64)) - quantized(torch.zeros(1, 64))).T  # [out, in]
    torch.testing.assert_close(weight, computed, rtol=0, atol=1e-6)
    assert torch.equal(bias, linear.bias) and (weight - linear.weight).abs().max() > 1e-3


def test_train_option_reaches_the_engine(assets, tmp_path):
    """--kv-cache-dtype fp8: the trainer's engine samples into fp8 pages, and with --importance-sampling-correction
    the larger sampler/trainer mismatch shows in the sampling/* metrics (fp32 on a CPU: the model-dtype cache's
    mismatch is rounding, ~1e-7)."""
    from train_helpers import make_config

    from fastgrpo.cli import main
    from fastgrpo.train import TrainConfig, Trainer

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        TrainConfig(model_name_or_path="builtin", dataset_name="builtin", kv_cache_dtype="fp16")
    with pytest.raises(SystemExit):
        main(["train", "--kv-cache-dtype", "int8"])
    differences = {}
    for kv in ("auto", "fp8"):
        trainer = Trainer(make_config(assets, tmp_path / kv, kv_cache_dtype=kv, max_steps=1,
                                      importance_sampling_correction=True))  # fmt: skip
        assert trainer.engine.config.kv_cache_dtype == kv
        trainer.train()
        metrics = trainer.log.history[-1]
        differences[kv] = metrics["sampling/sampling_logp_difference/mean"]
        assert math.isfinite(metrics["sampling/importance_sampling_ratio/mean"])
    print(f"\ntrainer (fp32 tiny Qwen2), mean |old - sampling| logprob: {differences}")
    assert differences["auto"] < 1e-4 < 1e-3 < differences["fp8"] < 0.1, differences


@pytest.mark.slow
def test_two_processes_sample_fp8_pages_as_one(assets, tmp_path):
    """FSDP2 (transformers' modules over sharded weights: the scales gather each weight whole) and DDP (the fused
    layers) on 2 processes x 4 train as 1 process x 8 with the fp8 cache: the same scales and pages, so the same
    samples, metrics and parameters (tests/test_distributed.py's tolerance)."""
    from distributed_helpers import TOL, assert_same_parameters, drive, one_process, options
    from train_helpers import assert_same_metrics

    from fastgrpo.train.logs import read_metrics

    values = dict(kv_cache_dtype="fp8", importance_sampling_correction=True, max_steps=2)
    runs = [options(assets, tmp_path / parallelism, **values, parallelism=parallelism, per_device_train_batch_size=4,
                    params_file=str(tmp_path / parallelism) + ".pt") for parallelism in ("fsdp", "ddp")]  # fmt: skip
    done = drive(runs, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics, params = one_process(options(assets, tmp_path / "one", **values))
    assert metrics[-1]["sampling/sampling_logp_difference/mean"] > 1e-4  # the fp8 pages' mismatch, not rounding
    for parallelism in ("fsdp", "ddp"):
        assert_same_metrics(metrics, read_metrics(tmp_path / parallelism), tol=TOL)
        assert_same_parameters(params, torch.load(str(tmp_path / parallelism) + ".pt"))
