"""fastgrpo.bench.memory_trace: live-tensor byte counts, fake-tensor traces of a micro-batch and a decode step, and the
per-phase peaks of a real Trainer's step."""

import gc

import pytest
import torch
from helpers import skip_without_hybrid_state
from train_helpers import make_config
from transformers import Qwen2Config

from fastgrpo.bench.memory_trace import LiveBytes, storage_bytes, trace_decode_step, trace_train_step
from fastgrpo.train import Trainer

F32 = 4


def traced_qwen2_config(**overrides) -> Qwen2Config:
    """The Qwen2 config the traces run on: 3 layers, hidden 64, GQA 2, vocab 512, untied head; `overrides` change it.
    (helpers.tiny_config is the 2-layer config of any model class that the TRL tests use.)"""
    values = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen2Config(**{**values, **overrides})


SHAPE = dict(micro_batch=2, prompt_length=8, completion_length=24)
LONG = dict(micro_batch=4, prompt_length=16, completion_length=112)  # activations over the optimizer step's peak


# -- LiveBytes -------------------------------------------------------------------------------------------------------


def test_live_bytes_counts_storages_once_and_frees_them():
    base = torch.zeros(10)
    with LiveBytes([base, base[2:]]) as live:
        assert live.base == live.current == 10 * F32  # a view of a base tensor adds nothing
        with live.phase("alloc"):
            a = torch.empty(100)
            b = torch.empty(50, dtype=torch.float64)
            views = (a[10:], a.view(10, 10), a.unsqueeze(0))
            assert live.current == (10 + 100) * F32 + 50 * 8
            a.add_(1)  # in place: the same storage
            assert live.current == (10 + 100) * F32 + 50 * 8
            del a
            assert live.current == (10 + 100) * F32 + 50 * 8  # its views keep the storage
            del views
            assert live.current == 10 * F32 + 50 * 8
        with live.phase("later"):
            c = torch.empty(20)
        del b
        assert live.current == (10 + 20) * F32
    assert live.peaks["alloc"] == live.peak == (10 + 100) * F32 + 50 * 8
    assert live.peaks["later"] == 10 * F32 + 50 * 8 + 20 * F32  # what was live when the phase began counts
    del c
    assert live.current == 10 * F32  # frees are still seen once the mode is off


def test_live_bytes_on_fake_tensors_and_uncounted():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), LiveBytes() as live:
        a = torch.empty(1 << 20, 1 << 10, dtype=torch.bfloat16)  # 2 GiB: nothing allocated
        assert live.current == 2 * 2**30
        with live.uncounted():
            host = a.clone()
        host.add_(1)
        view = host[1:]
        assert live.current == 2 * 2**30  # the uncounted copy and its views stay out
        back = host.clone()
        assert live.current == 4 * 2**30
        del a, back, host, view
        assert live.current == 0
    assert live.peak == 4 * 2**30


def test_live_bytes_autograd():
    x = torch.ones(1000, requires_grad=True)
    with LiveBytes([x]) as live:
        with live.phase("forward"):
            y = (x * 2).exp()  # saves its output; x * 2 is freed after exp
            loss = y.sum()
        with live.phase("backward"):
            loss.backward()
        grad = storage_bytes([x.grad])
    assert grad == 1000 * F32
    assert live.peaks["forward"] == 3 * 1000 * F32  # x, x * 2 and y (x * 2 is gone when the sum is made)
    assert live.peaks["backward"] >= 3 * 1000 * F32  # x, y and the gradient at least


# -- trace_train_step ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traces() -> dict:
    config = traced_qwen2_config()
    runs = {"ckpt": {}, "no_ckpt": dict(gradient_checkpointing=False), "offload": dict(offload_activations=True),
            "full": dict(use_peft=False, **LONG),
            "full_offload": dict(use_peft=False, offload_activations=True, **LONG)}
    return {name: trace_train_step(config, dtype=torch.bfloat16, **{**SHAPE, **extra}) for name, extra in runs.items()}


def test_trace_train_step_phases(traces):
    run = traces["ckpt"]
    assert run["train"] == max(run[k] for k in ("forward", "backward", "optimizer"))
    assert run["train"] > run["weights"] + run["optimizer_states"]
    assert 0 < run["trainable"] < run["weights"]
    assert run["gradients"] == run["trainable"]  # LoRA: a gradient for every trainable parameter
    assert run["optimizer_states"] >= 2 * run["trainable"]  # AdamW's two moments (fp32 adapters)
    assert run["chunk_tokens"] >= 256
    full = traces["full"]
    assert 0 < full["weights"] - full["trainable"] <= 1024  # all but the rotary buffers


def test_trace_train_step_checkpointing_lowers_the_peak(traces):
    on, off = traces["ckpt"], traces["no_ckpt"]
    assert on["weights"] == off["weights"]
    assert on["saved"] < off["saved"]
    assert on["train"] < off["train"]


def test_trace_train_step_offload(traces):
    """Offloading keeps one [tokens, hidden] bf16 input per layer, all but the last, off the device. With LoRA the
    first layer's input stays: peft makes the embeddings' output a leaf that requires grad, which autograd holds."""
    config = traced_qwen2_config()
    per_layer = lambda shape: shape["micro_batch"] * (shape["prompt_length"] + shape["completion_length"]) * (
        config.hidden_size * 2)
    full, offloaded = traces["full"], traces["full_offload"]
    assert full["saved"] - offloaded["saved"] == (config.num_hidden_layers - 1) * per_layer(LONG)
    assert full["train"] - offloaded["train"] == pytest.approx((config.num_hidden_layers - 1) * per_layer(LONG),
                                                               abs=per_layer(LONG) // 2)
    lora, lora_offloaded = traces["ckpt"], traces["offload"]
    assert lora["saved"] - lora_offloaded["saved"] == (config.num_hidden_layers - 2) * per_layer(SHAPE)


def test_trace_train_step_4bit_and_8bit_optimizer():
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    config = traced_qwen2_config(hidden_size=128, intermediate_size=256)
    plain = trace_train_step(config, **SHAPE)
    quantized = trace_train_step(config, **SHAPE, load_in_4bit=True, optim="adamw_8bit")
    H, inter, L = 128, 256, 3
    kv = 2 * 32  # kv_heads x head_dim
    linear = H * H + 2 * H * kv + H * H + 3 * H * inter  # q, k, v, o, gate, up, down weights per layer
    # bf16 weights (2 B) become 4-bit (0.5 B) with a uint8 absmax per 64 and an fp32 absmax per 256 * 64; each of
    # the 7 L layers also holds an NF4 code (64 B), an offset and (as traced) its copy of the 1 KiB blockwise map
    saved = L * linear * (2 - 0.5 - 1 / 64)
    assert saved - 7 * L * 1200 <= plain["weights"] - quantized["weights"] <= saved
    assert quantized["trainable"] == plain["trainable"]
    assert quantized["train"] < plain["train"]


# -- trace_decode_step -----------------------------------------------------------------------------------------------


def test_trace_decode_step_kv_cache_exact():
    config = traced_qwen2_config()
    seqs, ctx = 6, 64  # ctx: whole pages of 16
    run = trace_decode_step(config, dtype=torch.bfloat16, num_sequences=seqs, context_length=ctx)
    head_dim = config.hidden_size // config.num_attention_heads
    assert run["kv_cache"] == 2 * config.num_hidden_layers * seqs * ctx * config.num_key_value_heads * head_dim * 2
    assert run["decode"] >= run["forward"] > run["weights"] + run["kv_cache"]
    assert run["decode"] >= run["weights"] + run["kv_cache"] + seqs * config.vocab_size * (4 + 8)  # fp32 + fp64 cdf
    # the CPU's torch backend gathers each sequence's pages into a copy per layer: more than the triton one allocates
    cpu = trace_decode_step(config, num_sequences=seqs, context_length=ctx, attention="torch")
    assert cpu["forward"] > run["forward"]


def test_decode_traces_register_their_attention_and_leave_the_built_in_ones():
    from fastgrpo.sampling import attention

    built_in = {name: attention.BACKENDS[name] for name in attention.BUILT_IN}
    trace_decode_step(traced_qwen2_config(), num_sequences=2, context_length=32)
    assert {name: attention.BACKENDS[name] for name in attention.BUILT_IN} == built_in
    assert attention.TRITON_BACKENDS >= {"triton", "flash"}
    with pytest.raises(ValueError, match="'torch' is built in"):
        attention.register_backend("torch", lambda query, k_cache, v_cache, batch, scale: query)


# -- measure_trainer_step --------------------------------------------------------------------------------------------


def test_measure_trainer_step(assets, tmp_path):
    from fastgrpo.bench.memory_trace import measure_trainer_step

    trainer = Trainer(make_config(assets, tmp_path, beta=0.04, max_steps=1))  # beta: reference logprobs
    try:
        result = measure_trainer_step(trainer)
    finally:
        trainer.folder.release()
    weights = storage_bytes([*trainer.model.parameters(), *trainer.ref_model.parameters()])
    assert result["base"] >= weights
    for phase in ("sampling", "logprobs", "train"):
        assert isinstance(result[phase], int) and result[phase] > result["base"], phase
    assert result["sampling"] >= result["base"] + result["kv_pool"]  # the pool is live while sampling
    assert result["step"] >= max(result["sampling"], result["logprobs"], result["train"])
    assert result["train"] > result["logprobs"]  # gradients and AdamW's states on top of a forward
    del trainer
    gc.collect()


# -- the plan against traces with the layer memory options --------------------------------------------------------


LAYER_OPTIONS = {"none": dict(recompute_lora_inputs=False, mask_free_attention=False, recompute_norms=False),
                 "defaults": {}, "tiled": dict(mlp_tile_tokens=1024),
                 "tiled-peft-inputs": dict(mlp_tile_tokens=1024, recompute_lora_inputs=False),
                 "fp32-norms": dict(recompute_norms=False), "tiled-fp32-norms": dict(mlp_tile_tokens=1024,
                                                                                     recompute_norms=False)}


@pytest.mark.parametrize("options", LAYER_OPTIONS.values(), ids=LAYER_OPTIONS.keys())
def test_plan_matches_traces_with_the_layer_options(options):
    """Qwen3-8B's layers at real widths (2 of its 36, so a trace takes seconds), 4-bit LoRA r 16, offload, 2 x (256 +
    2048) tokens: each training moment's plan within 5% of the trace. Not the real-shape benchmark's 1.5%: with 2
    layers the weights are 2.5 GiB of ~4 GiB, so the per-token terms that the plan rounds (CUDA's 1-byte dropout mask
    for peft's kept inputs, where the CPU trace keeps 4-byte noise) weigh more; backward measured -0.6% (none), +0.9%,
    +1.1%, -3.6%, -0.7% and +0.0% (recompute_norms off, untiled and tiled)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from fastgrpo.bench.memory_plan import qwen3_8b_config
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import model_shapes, plan_memory

    model_config = qwen3_8b_config()
    model_config.num_hidden_layers = 2
    config = TrainConfig(model_name_or_path="qwen3-8b", dataset_name="builtin", use_peft=True, load_in_4bit=True,
                         offload_activations=True, num_generations=8, max_completion_length=2048,
                         max_prompt_length=256, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                         bf16=True, **options)
    plan = plan_memory(config, shapes=model_shapes(model_config))
    trace = trace_train_step(model_config, micro_batch=2, prompt_length=256, completion_length=2048,
                             load_in_4bit=True, offload_activations=True, head="cuda", **options)
    forward = max(plan.peak("train: forward"), plan.peak("train: loss"))  # the trace's forward holds the loss
    assert forward == pytest.approx(trace["forward"], rel=0.05)
    assert plan.peak("train: backward") == pytest.approx(trace["backward"], rel=0.05)
    assert plan.peak("train: optimizer step") == pytest.approx(trace["optimizer"], rel=0.05)


@pytest.mark.slow
def test_qwen3_8b_at_110k_tokens_traces_under_75_gib():
    """Issue 33: the micro-batch auto-fit picks for Qwen3-8B at 110K-token completions on 80 GiB (4 x 110512 tokens
    with recompute_norms, tiles of 16384, 4-bit LoRA r 16, offload): planned under 75 GiB at its 36 layers (63.0 GiB;
    the full-depth trace, 5.5 min on 2 cores, is the memory-plan bench's), and at 4 of its layers traced at its real
    widths and lengths (~1 min), the plan within 1.5% of the trace (full depth measured -0.13%)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from fastgrpo.bench.memory_plan import qwen3_8b_config
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import model_shapes, plan_memory

    config = TrainConfig(model_name_or_path="qwen3-8b", dataset_name="builtin", use_peft=True, load_in_4bit=True,
                         offload_activations=True, num_generations=8, max_completion_length=110000,
                         max_prompt_length=512, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         bf16=True, mlp_tile_tokens=16384)
    model_config = qwen3_8b_config(131072)  # past the published 40960 positions
    full = plan_memory(config, shapes=model_shapes(model_config))
    assert max(full.peak(p) for p in full.phases if p.startswith("train")) < 75 * 2**30
    model_config.num_hidden_layers = 4
    plan = plan_memory(config, shapes=model_shapes(model_config))
    trace = trace_train_step(model_config, micro_batch=4, prompt_length=512, completion_length=110000,
                             load_in_4bit=True, offload_activations=True, head="cuda", mlp_tile_tokens=16384)
    assert plan.peak("train: backward") == pytest.approx(trace["backward"], rel=0.015)
    assert plan.peak("logprobs") == pytest.approx(trace["logprobs"], rel=0.015)


# -- trace_sampling --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_sampling_trace_matches_the_plan(kv_cache_dtype):
    """Qwen3-8B's widths (2 of its 36 layers), 4-bit LoRA r 16, a pool of 2000 pages, 2 prompts of 512 tokens x 8
    completions of 4096: the KV pool and the engine's buffers exactly the plan's, the phase's peak within 0.5% (measured
    +0.2%: the plan's engine forward is the larger of prefill and decode, the trace's the forward it runs); fp8 pages
    are half the bf16 ones."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from fastgrpo.bench.memory_plan import qwen3_8b_config
    from fastgrpo.bench.memory_trace import trace_sampling
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import kv_block_bytes, model_shapes, plan_memory

    model_config = qwen3_8b_config()
    model_config.num_hidden_layers = 2
    shapes = model_shapes(model_config)
    config = TrainConfig(model_name_or_path="qwen3-8b", dataset_name="builtin", use_peft=True, load_in_4bit=True,
                         num_generations=8, max_completion_length=4096, max_prompt_length=512,
                         per_device_train_batch_size=2, gradient_accumulation_steps=8, bf16=True,
                         kv_cache_dtype=kv_cache_dtype)
    plan = plan_memory(config, shapes=shapes, kv_blocks=2000)
    trace = trace_sampling(model_config, kv_blocks=2000, prompt_length=512, completion_length=4096, num_generations=8,
                           num_prompts=2, kv_cache_dtype=kv_cache_dtype, load_in_4bit=True)
    value_bytes = 1 if kv_cache_dtype == "fp8" else 2
    assert trace["kv_cache"] == plan.phases["sampling"]["KV pool"] >= 2001 * kv_block_bytes(shapes, 16, value_bytes)
    assert trace["buffers"] == plan.phases["sampling"]["output buffers"]
    assert trace["sampling"] == max(trace["prefill"], trace["decode"])
    assert plan.peak("sampling") == pytest.approx(trace["sampling"], rel=0.005)
    assert plan.peak("sampling") >= trace["sampling"]


@pytest.mark.slow
def test_qwen3_8b_at_32k_tokens_every_phase_traces_under_22_gib():
    """Issue 33: Qwen3-8B, 4-bit LoRA r 16, G 8, completions of 32768 tokens, auto-fit for a 24 GiB card (21.8 GiB for
    tensors): the sampling phase (KV pool bf16 traced, fp8 planned: as many pages as fit), the no-grad logprobs and the
    training micro-batch at the setting auto-fit picks (2 x 33280 tokens, tiles of 16384), traced at real shapes: each
    planned and traced under 22 GiB (the train peak 16.8 GiB, 18.5 without recompute_norms), sampling's plan within 3%
    of its trace (measured +0.01%) and the backward's within 1.5% (measured -0.11%)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from fastgrpo.bench.memory_plan import qwen3_8b_config
    from fastgrpo.bench.memory_trace import trace_sampling
    from fastgrpo.sizes import GiB
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import auto_fit, model_shapes

    model_config = qwen3_8b_config()
    shapes = model_shapes(model_config)
    for kv in ("auto", "fp8"):
        config = TrainConfig(model_name_or_path="qwen3-8b", dataset_name="builtin", use_peft=True, load_in_4bit=True,
                             offload_activations=True, num_generations=8, max_completion_length=32768, bf16=True,
                             kv_cache_dtype=kv)
        plan = auto_fit(config, 24 * GiB, shapes)
        assert plan.settings["kv_blocks_least"] <= plan.settings["kv_blocks"] < plan.settings["kv_blocks_needed"]
        if kv == "fp8":  # (planned only: its pages against their trace at 2 layers in test_sampling_trace_matches...)
            assert plan.peak("sampling") < 22 * GiB
            continue
        sampled = trace_sampling(model_config, kv_blocks=plan.settings["kv_blocks"], prompt_length=512,
                                 completion_length=32768, num_generations=8, num_prompts=1, kv_cache_dtype=kv,
                                 load_in_4bit=True, mlp_tile_tokens=plan.settings["mlp_tile_tokens"])
        assert sampled["sampling"] < 22 * GiB
        assert plan.peak("sampling") == pytest.approx(sampled["sampling"], rel=0.03)
    trace = trace_train_step(model_config, micro_batch=plan.settings["per_device_train_batch_size"], prompt_length=512,
                             completion_length=32768, load_in_4bit=True, offload_activations=True, head="cuda",
                             mlp_tile_tokens=plan.settings["mlp_tile_tokens"])
    assert max(trace["train"], trace["logprobs"]) < 22 * GiB
    assert max(plan.peak(p) for p in plan.phases if p != "sampling") < 22 * GiB
    assert plan.peak("train: backward") == pytest.approx(trace["backward"], rel=0.015)


# -- the 2026 families at real widths (issue 38) -------------------------------------------------------------------


def published_config(name: str, layers: int, kv_shared_layers: int | None = None, **overrides):
    """fastgrpo/bench/models/<name>'s published config with its first `layers` layers (their layer_types; Gemma 4's
    last `kv_shared_layers` of them reading earlier layers' K/V), so a trace at real widths takes seconds."""
    import json

    from transformers import AutoConfig

    from fastgrpo.bench import MODELS

    fields = json.loads((MODELS / name / "config.json").read_text())
    fields.pop("architectures")
    fields["num_hidden_layers"] = layers
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"][:layers]
    if kv_shared_layers is not None:
        fields["num_kv_shared_layers"] = kv_shared_layers
    return AutoConfig.for_model(fields.pop("model_type"), **{**fields, **overrides})


def qwen3_moe_30b_widths(layers: int = 2):
    """Qwen3-30B-A3B's widths (hidden 2048, 32 heads of 128 over 4 K/V heads, 128 experts of 768, 8 a token)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False)


# (config, micro-batch, prompt, completion, options): each family's new terms where they weigh
FAMILY_CASES = {
    # 5 sliding layers (window 1024: [1, 1, T, T] masks) and a global one; GeGLU; four norms a layer; 4-bit
    "gemma-3-12b": (lambda: published_config("gemma-3-12b", 6), 1, 512, 8192, dict(load_in_4bit=True)),
    # eager attention with sinks ([1, 64, T, T + 1] scores), 32 experts top-4 with LoRA on them, 4-bit attention
    "gpt-oss-20b": (lambda: published_config("gpt-oss-20b", 2), 1, 512, 4096, dict(load_in_4bit=True,
                                                                                   lora_dropout=0.0)),
    # global layers of head dim 512, 4 of 10 layers reading shared K/V with twice the MLP, per-layer inputs
    "gemma-4-e2b": (lambda: published_config("gemma-4-e2b", 10, 4), 2, 256, 2048, {}),
    # 128 experts top-8 with LoRA on them (peft's ParamWrapper)
    "qwen3-moe": (qwen3_moe_30b_widths, 2, 256, 1024, dict(lora_dropout=0.0)),
    # 3 Gated DeltaNet layers (the mixer's own forward and backward measured on meta tensors) and a gated attention
    # layer; 4-bit
    "qwen3.5-9b": (lambda: published_config("qwen3.5-9b", 4), 1, 256, 2048, dict(load_in_4bit=True)),
    # the same mix with 256 experts top-8 (frozen: lora_experts off) and a shared expert
    "qwen3.5-35b-a3b": (lambda: published_config("qwen3.5-35b-a3b", 4), 1, 256, 1024, dict(lora_experts=False)),
}


@pytest.mark.parametrize("case", FAMILY_CASES.values(), ids=FAMILY_CASES.keys())
def test_family_plans_match_their_traces(case, request):
    """Each family's plan against trace_train_step at its real widths (a few layers, so a trace takes seconds), LoRA
    r 16 and offload: every phase within 4%, the plan never more than 1.5% low. Not the 1.5% of the long-reasoning
    bench: with 2-10 layers the weights are half the peak and the few per-token terms the plan rounds weigh more
    (measured: -1.7% to +3.3%; backward high by the repeated K/V copies and eager attention's third score tensor)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    if request.node.callspec.id.startswith("qwen3.5"):  # Gated DeltaNet layers
        skip_without_hybrid_state()
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import model_shapes, plan_memory

    build, micro_batch, prompt, completion, options = case
    model_config = build()
    config = TrainConfig(model_name_or_path="family", dataset_name="builtin", use_peft=True, offload_activations=True,
                         num_generations=8, max_completion_length=completion, max_prompt_length=prompt,
                         per_device_train_batch_size=micro_batch, gradient_accumulation_steps=8 // micro_batch,
                         bf16=True, **options)
    plan = plan_memory(config, shapes=model_shapes(model_config))
    trace = trace_train_step(model_config, micro_batch=micro_batch, prompt_length=prompt, completion_length=completion,
                             offload_activations=True, head="cuda", **options)
    pairs = {"logprobs": (plan.peak("logprobs"), trace["logprobs"]),
             "forward": (max(plan.peak("train: forward"), plan.peak("train: loss")), trace["forward"]),
             "backward": (plan.peak("train: backward"), trace["backward"]),
             "optimizer": (plan.peak("train: optimizer step"), trace["optimizer"])}
    for phase, (planned, traced) in pairs.items():
        assert planned == pytest.approx(traced, rel=0.04), phase
        assert planned >= 0.985 * traced, phase


def test_sliding_windows_sample_in_pools_the_plan_counts():
    """Gemma 3 12B's widths, 6 layers (5 slide over 1024 positions): trace_sampling allocates the engine's KV cache
    (fastgrpo.sampling.kv_cache.KVCache) with a logical pool for the global layer and a window pool of
    window_group_pages for the sliding ones: its bytes are the plan's pools exactly, the window pool smaller than
    the logical one once the round's pages pass its cap, and the phase's peak within 1% of the plan."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from fastgrpo.bench.memory_trace import trace_sampling
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import model_shapes, plan_memory, window_group_pages

    model_config = published_config("gemma-3-12b", 6)
    config = TrainConfig(model_name_or_path="gemma-3-12b", dataset_name="builtin", use_peft=True, load_in_4bit=True,
                         num_generations=8, max_completion_length=16384, max_prompt_length=512,
                         per_device_train_batch_size=2, gradient_accumulation_steps=4, bf16=True)
    N = 20000  # past the window pool's cap (a round's 8224 pages are not)
    plan = plan_memory(config, shapes=model_shapes(model_config), kv_blocks=N)
    trace = trace_sampling(model_config, kv_blocks=N, prompt_length=512, completion_length=16384, num_generations=8,
                           num_prompts=1, load_in_4bit=True)
    cap = window_group_pages(1024, N, 16, -(-(512 + 16384) // 16), 8)  # sequences of 1056 pages, 8 of them
    assert trace["kv_pools"] == [N, cap] and cap < N
    pools = {k: v for k, v in plan.phases["sampling"].items() if k.startswith("KV pool")}
    assert pools == {"KV pool": (N + 1) * 16 * 8 * 512 * 2, "KV pool, window 1024": (cap + 1) * 5 * 16 * 8 * 512 * 2}
    assert trace["kv_cache"] == sum(pools.values())
    assert trace["buffers"] == plan.phases["sampling"]["output buffers"]
    assert plan.peak("sampling") == pytest.approx(trace["sampling"], rel=0.01)


def test_a_hybrid_samples_with_the_recurrent_state_the_plan_counts():
    """Qwen3.5-9B's widths, 4 layers (3 Gated DeltaNet): trace_sampling allocates the engine's recurrent state slots
    (a slot per row and per running group's prompt, and a scratch slot: 3 layers x 2.06 MiB each) and steps them in
    its prefill and decode; the plan's "recurrent state" is those bytes exactly, and the phase's peak within 3%,
    never under: the plan adds the sampler's bytes to the engine's forward, and the decode's moment at the recurrent
    layer (32 rows' states gathered and stepped, 262 MiB here) is over before the sampler runs (measured: +2.4%)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    skip_without_hybrid_state()
    from fastgrpo.bench.memory_trace import trace_sampling
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import model_shapes, plan_memory

    model_config = published_config("qwen3.5-9b", 4)
    config = TrainConfig(model_name_or_path="qwen3.5-9b", dataset_name="builtin", use_peft=True, load_in_4bit=True,
                         num_generations=8, max_completion_length=2048,
                         max_prompt_length=256, per_device_train_batch_size=2, gradient_accumulation_steps=16,
                         bf16=True)
    plan = plan_memory(config, shapes=model_shapes(model_config))
    trace = trace_sampling(model_config, kv_blocks=plan.settings["kv_blocks"], prompt_length=256,
                           completion_length=2048, num_generations=8, num_prompts=4, load_in_4bit=True)
    per_seq = 3 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 4 * 2)
    slots = 32 + 4  # 32 rows (4 prompts x 8), and the 4 groups' prompts (all of them: 32 / 8 + 1 > 4)
    assert trace["recurrent_state"] == plan.phases["sampling"]["recurrent state"] == (slots + 1) * per_seq
    assert trace["sampling"] <= plan.peak("sampling") <= 1.03 * trace["sampling"]


def test_an_moe_samples_with_the_route_records_the_plan_counts():
    """Qwen3-30B-A3B's widths, 2 layers of 128 experts, 8 a token: trace_sampling allocates the engine's route records
    (a row of 8 uint8 expert ids per MoE layer for every prompt position of each group and every completion position
    of each sample); the plan's "route records" is those bytes exactly."""
    pytest.importorskip("peft")
    from fastgrpo.bench.memory_trace import trace_sampling
    from fastgrpo.train import TrainConfig
    from fastgrpo.train.plan import model_shapes, plan_memory

    model_config = qwen3_moe_30b_widths()
    config = TrainConfig(model_name_or_path="qwen3-moe", dataset_name="builtin", use_peft=True, lora_dropout=0.0,
                         num_generations=8, max_completion_length=1024, max_prompt_length=256,
                         per_device_train_batch_size=2, gradient_accumulation_steps=8, bf16=True, routing_replay=True)
    plan = plan_memory(config, shapes=model_shapes(model_config))
    trace = trace_sampling(model_config, kv_blocks=plan.settings["kv_blocks"], prompt_length=256,
                           completion_length=1024, num_generations=8, num_prompts=2, lora_dropout=0.0)
    records = (2 * 256 + 16 * 1024) * 2 * 8  # positions x MoE layers x k, 1 byte each
    assert trace["route_records"] == plan.phases["sampling"]["route records"] == records
