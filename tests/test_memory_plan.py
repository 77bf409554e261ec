"""The memory plan: `fastgrpo plan` on config-only model folders, --auto-fit, and its errors."""

from pathlib import Path

import pytest
import torch
from helpers import skip_without_hybrid_state
from train_helpers import make_config

from fastgrpo.bench import MODELS
from fastgrpo.cli import main
from fastgrpo.train import Trainer
from fastgrpo.train.data import load_rows, prepare
from fastgrpo.train.loading import load_tokenizer, model_config
from fastgrpo.train.logs import read_metrics
from fastgrpo.train.plan import RESERVE_BYTES, RESERVE_FRACTION, GiB, model_shapes, plan_memory

QWEN_7B = str(MODELS / "qwen2.5-7b")
GRPO_7B = ["--model-name-or-path", QWEN_7B, "-G", "8", "--max-completion-length", "1024", "--max-prompt-length", "256",
           "--per-device-train-batch-size", "8", "--use-peft", "--lora-r", "16"]


def test_plan_of_a_config_only_folder(capsys):
    """No weights anywhere: Qwen2.5-7B's plan from its config.json; 4-bit QLoRA fits a 16 GiB card, bf16 LoRA not."""
    assert not any(p.suffix == ".safetensors" for p in Path(QWEN_7B).iterdir())
    main(["plan", *GRPO_7B, "--load-in-4bit", "--gpu-memory", "16GiB"])
    out = capsys.readouterr().out
    assert "fits in 16.0 GiB" in out and "KV pool" in out and "checkpointed layer inputs" in out
    peak = float(out.split("; peak ")[1].split(" GiB")[0])
    assert 6 < peak < 14  # NF4 weights ~5.2 GiB
    with pytest.raises(SystemExit) as done:
        main(["plan", *GRPO_7B, "--gpu-memory", "16GiB"])
    assert done.value.code == 1
    captured = capsys.readouterr()
    assert "does NOT fit in 16.0 GiB" in captured.out and "--load-in-4bit" in captured.err


def test_plan_counts_what_the_options_change():
    """Each option moves the component it should, by the bytes it should."""
    config = model_config(make_config_for(QWEN_7B))
    shapes = model_shapes(config)
    base = make_config_for(QWEN_7B, use_peft=True, bf16=True)
    plain = plan_memory(base, shapes=shapes)
    q4 = plan_memory(make_config_for(QWEN_7B, use_peft=True, bf16=True, load_in_4bit=True), shapes=shapes)
    offload = plan_memory(make_config_for(QWEN_7B, use_peft=True, bf16=True, offload_activations=True), shapes=shapes)
    assert plain.phases["train: backward"]["weights"] == shapes.params * 2 and shapes.params > 7.6e9
    # NF4: half a byte per quantized weight and ~1/64 byte of scales; the rest (embeddings, head, norms) in bf16
    quantized = shapes.linear_params
    want = (shapes.params - quantized) * 2 + quantized * 0.5159
    assert q4.phases["train: backward"]["weights"] == pytest.approx(want, 1e-3)
    tokens = 8 * (256 + 1024)
    layer_input = tokens * shapes.hidden * 2
    assert plain.phases["train: backward"]["checkpointed layer inputs"] == shapes.layers * layer_input
    assert offload.phases["train: backward"]["checkpointed layer inputs"] == 2 * layer_input
    full = plan_memory(make_config_for(QWEN_7B, bf16=True), shapes=shapes)
    assert full.phases["train: backward"]["optimizer states"] == 2 * 2 * shapes.params  # bf16 moments
    eight = plan_memory(make_config_for(QWEN_7B, bf16=True, optim="adamw_8bit"), shapes=shapes)
    assert eight.phases["train: backward"]["optimizer states"] == pytest.approx(2 * shapes.params * (1 + 4 / 256), 1e-6)


def make_config_for(model: str, **overrides):
    from fastgrpo.train import TrainConfig

    values = dict(model_name_or_path=model, dataset_name="builtin", num_generations=8, max_completion_length=1024,
                  max_prompt_length=256, per_device_train_batch_size=8)
    return TrainConfig(**{**values, **overrides})


def test_a_gpu_too_small_is_refused_naming_what_would_fit(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", "--model-name-or-path", QWEN_7B, "--gpu-memory", "8GiB", "--auto-fit"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("fastgrpo plan: error: --gpu-memory: 8.0 GiB (6.6 GiB for tensors) cannot fit even "
                          "--per-device-train-batch-size 1: it needs ")
    assert "with --use-peft: " in err and "with --use-peft --load-in-4bit: " in err and "(fits)" in err
    with pytest.raises(SystemExit):
        main(["plan", "--model-name-or-path", QWEN_7B, "--gpu-memory", "lots"])
    assert "--gpu-memory: 'lots' is not a memory size such as 24GiB" in capsys.readouterr().err


def add_magnitude(total: torch.Tensor):
    """A tensor hook that adds |grad| to `total` and leaves the gradient as it is."""

    def hook(grad: torch.Tensor) -> None:
        total.add_(grad.abs())

    return hook


@pytest.mark.slow
def test_auto_fit_picks_a_smaller_micro_batch_and_the_update_stays(assets, tmp_path):
    """A gpu_memory between the micro-batch-4 and micro-batch-8 plans: --auto-fit trains with 4 (and twice the
    accumulation and steps per generation), and the update is the unfitted run's: the same rewards and the same
    gradient at each optimizer step (to fp32 summation order); the plan is in the output folder."""
    settings = dict(max_steps=1, save_steps=0, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                    steps_per_generation=2, eval_num_samples=1)
    config = make_config(assets, tmp_path / "a", **settings)
    shapes = model_shapes(model_config(config))
    longest = max(map(len, prepare(load_rows(config, "train"), load_tokenizer(config), config, "train").token_ids))
    peaks = {mb: plan_memory(config, shapes=shapes, device_type="cpu", micro_batch=mb, prompt_length=longest).peak()
             for mb in (4, 8)}
    assert peaks[4] < peaks[8]
    gpu = ((peaks[4] + peaks[8]) / 2 + RESERVE_BYTES) / (1 - RESERVE_FRACTION)
    assert gpu < 2 * GiB  # a tiny model's plan: well under a GiB on top of the reserve (1 GiB)
    runs = [Trainer(config), Trainer(make_config(assets, tmp_path / "b", auto_fit=True,
                                                 gpu_memory=f"{gpu / 2**20:.3f}MiB", **settings))]
    assert (runs[1].config.per_device_train_batch_size, runs[1].config.gradient_accumulation_steps,
            runs[1].config.steps_per_generation) == (4, 2, 4)
    # The third run trains one sample per micro-batch: its hooks see each sample's gradient g_s before it is summed.
    runs.append(Trainer(make_config(assets, tmp_path / "single", **{
        **settings, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "steps_per_generation": 16})))
    magnitudes = [torch.zeros_like(p) for p in runs[2].parameters]  # sum over the step's samples of |g_s|
    for p, total in zip(runs[2].parameters, magnitudes, strict=True):
        p.register_hook(add_magnitude(total))
    gradients, terms = [], []  # [run * 2 + optimizer step][parameter]

    def capture(trainer):  # in place of the optimizer's step, which does not run
        def step():
            gradients.append([p.grad.clone() for p in trainer.parameters])
            if trainer is runs[2]:
                terms.append([total.clone() for total in magnitudes])
                for total in magnitudes:
                    total.zero_()

        return step

    for trainer in runs:
        # Without the optimizer's step each run takes its second gradient at the same weights: a step would turn a
        # rounding-sized difference into a weight's (AdamW's first update, lr * g / (|g| + 1e-8), moves by lr / 4e-8
        # times the difference of a gradient near 1e-8).
        trainer.optimizer.step = capture(trainer)
        trainer.train()
    assert len(gradients) == 6 and len(terms) == 2  # two optimizer steps per round in each run
    # A gradient is a sum over the step's n token rows (dW = sum_t g_t x_t^T, in the loss's chunks); the runs add them
    # in other orders (one backward over 8 samples; two over 4, accumulated). Recursive fp32 summation of n terms is
    # off by at most (n - 1) u sum|terms|, u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd
    # ed., eq. 4.4), in each run: |a - b| <= 2 n u sum|terms|, with sum|terms| taken per sample, sum_s |g_s| (per
    # token row it is larger still). The samples' advantages have both signs, so sum_s |g_s| is up to 2.6x |a|: a
    # bound relative to |a| (1e-5 |a| before) is one some machines miss. Measured (2-core AVX-512 CPU): <= 3.5 u
    # sum_s |g_s|, against 2 n u = 176 u here.
    n = 8 * (longest + config.max_completion_length)  # token rows of an optimizer step, padded
    for whole, fitted, magnitude in zip(gradients[:2], gradients[2:4], terms, strict=True):
        for a, b, total in zip(whole, fitted, magnitude, strict=True):
            assert (a - b).abs().max() <= 2 * n * 2**-24 * total.max(), ((a - b).abs().max(), total.max())
    a, b = read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "b" / "run")
    assert [r.get("reward") for r in a] == [r.get("reward") for r in b] and a[-1]["reward"] is not None
    text = (tmp_path / "b" / "run" / "memory_plan.txt").read_text()
    assert "per_device_train_batch_size 4" in text and "fits in" in text
    with pytest.raises(ValueError, match=r"auto_fit: give gpu_memory"):
        Trainer(make_config(assets, tmp_path / "c", auto_fit=True))


def test_plan_counts_the_layer_options_and_fp8_kv():
    """The tiled MLP drops SwiGLU's four [T, I] tensors from what a layer keeps, LoRA inputs kept as they come replace
    peft's fp32 copies, mask-free attention drops the repeated K/V and the [m, 1, T, T] mask, recomputed norms keep
    their inputs as they come instead of fp32 copies (and no [T, H] fp32 temporaries in the backward), fp8 halves the
    KV pool."""
    from fastgrpo.bench.memory_plan import qwen3_8b_config
    from fastgrpo.train.layer_bytes import attention_saved_per_token as attention_saved
    from fastgrpo.train.layer_bytes import mlp_saved_per_token as mlp_saved

    shapes = model_shapes(model_config(make_config_for(QWEN_7B)))
    (layer,) = shapes.kinds  # every layer alike
    attention_saved_per_token = lambda s, config, b: attention_saved(s, layer, config, b)
    mlp_saved_per_token = lambda s, config, b: mlp_saved(s, layer, config, b)
    H, inter, q = shapes.hidden, shapes.intermediate, shapes.heads * shapes.head_dim
    tokens, T = 8 * (256 + 1024), 256 + 1024
    backward = lambda **o: plan_memory(make_config_for(QWEN_7B, use_peft=True, bf16=True, **o),
                                       shapes=shapes).phases["train: backward"]["layer backward"]
    plain = backward(recompute_lora_inputs=False)
    masked = backward(recompute_lora_inputs=False, mask_free_attention=False)
    assert masked - plain == tokens * 2 * q * 2 + 8 * T * T * 2  # GQA's repeated K, V and SDPA's copy of the mask
    held = plan_memory(make_config_for(QWEN_7B, use_peft=True, bf16=True, mask_free_attention=False), shapes=shapes)
    assert all(held.phases[p]["attention masks"] == 8 * T * T for p in held.phases if p.startswith("train: ") and
               "optimizer" not in p)  # the boolean mask: held by every checkpointed layer's inputs, the loss's too
    peft_inputs = 5 * (3 * H + q + 2 * H + inter)  # fp32 and a dropout mask per input value
    assert plain - backward() == tokens * peft_inputs
    config = make_config_for(QWEN_7B, use_peft=True, bf16=True)
    untiled, tiled = (mlp_saved_per_token(shapes, config, 2),
                      mlp_saved_per_token(shapes, make_config_for(QWEN_7B, use_peft=True, bf16=True,
                                                                  mlp_tile_tokens=1024), 2))
    assert untiled - tiled == 4 * inter * 2 + 4 * 16 * 3  # SwiGLU's four [T, I] and gate/up/down's lora_A outputs
    assert backward(mlp_tile_tokens=1024) < backward()
    # recompute_norms off: today's fp32 inputs and rsqrt; on: the post-attention norm keeps the residual sum (H b), the
    # input norm the layer's input when the offload fetched it back (Qwen2.5 has no q/k norms)
    norms_off = make_config_for(QWEN_7B, use_peft=True, bf16=True, mlp_tile_tokens=1024, recompute_norms=False)
    tiled_config = make_config_for(QWEN_7B, use_peft=True, bf16=True, mlp_tile_tokens=1024)
    assert (mlp_saved_per_token(shapes, norms_off, 2) - mlp_saved_per_token(shapes, tiled_config, 2)
            == 4 * (H + 1) - 2 * H)
    assert (attention_saved_per_token(shapes, norms_off, 2) - attention_saved_per_token(shapes, tiled_config, 2)
            == 4 * (H + 1))
    offloaded = make_config_for(QWEN_7B, use_peft=True, bf16=True, mlp_tile_tokens=1024, offload_activations=True)
    assert (attention_saved_per_token(shapes, offloaded, 2) - attention_saved_per_token(shapes, tiled_config, 2)
            == 2 * H)
    assert backward(mlp_tile_tokens=1024) < backward(mlp_tile_tokens=1024, recompute_norms=False)
    qwen3 = model_shapes(qwen3_8b_config(131072))  # per-head q/k norms; at 2 x 110K tokens the fp32 norm moment peaks
    long = lambda **o: plan_memory(long_config(110000, **o), shapes=qwen3, micro_batch=2).phases["train: backward"]
    assert long(mlp_tile_tokens=16384)["layer backward"] < 0.75 * long(mlp_tile_tokens=16384,
                                                                        recompute_norms=False)["layer backward"]
    pool = lambda kv: plan_memory(make_config_for(QWEN_7B, use_peft=True, bf16=True, kv_cache_dtype=kv),
                                  shapes=shapes).phases["sampling"]["KV pool"]
    assert pool("auto") == 2 * (pool("fp8") - shapes.layers * 2 * shapes.kv_heads * 4)  # fp8: + its fp32 scales


LOGPROBS_CASES = {  # (micro-batch, prompt, completion, options): the moment each peaks at
    "head": (2, 256, 2048, {}),  # the head's chunk of fp32 logits with the final hidden states
    "attention": (2, 512, 32768, dict(mlp_tile_tokens=16384)),  # o_proj's LoRA sum (tiled: the MLP is lower)
    "mlp-mask-peft": (2, 256, 16384, dict(recompute_lora_inputs=False, mask_free_attention=False)),  # up_proj's sum
    "tiled-mlp": (2, 256, 7936, dict(mlp_tile_tokens=8192)),  # up_proj's sum in the second tile
    "sdpa-mask": (2, 256, 49152, dict(mlp_tile_tokens=16384, mask_free_attention=False)),  # the additive mask
    "full-mask": (2, 256, 8192, dict(use_peft=False, load_in_4bit=False, offload_activations=False,
                                     mask_free_attention=False)),
    "attention-fp32-norms": (2, 512, 32768, dict(mlp_tile_tokens=16384, recompute_norms=False)),  # as "attention"
    "full-mask-fp32-norms": (2, 256, 8192, dict(use_peft=False, load_in_4bit=False, offload_activations=False,
                                                mask_free_attention=False, recompute_norms=False)),
}


@pytest.mark.parametrize("case", LOGPROBS_CASES.values(), ids=LOGPROBS_CASES.keys())
def test_logprobs_plan_matches_its_trace(case):
    """The no-grad logprobs phase (eval mode: Trainer._logprobs) against trace_train_step's "logprobs" at Qwen3-8B's
    widths (2 of its 36 layers), 4-bit LoRA r 16 with offload unless the case says otherwise: within 0.5% (measured
    -0.03% to 0.00%: the plan leaves out the micro-batch's token ids and masks, 16-28 bytes a token)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from fastgrpo.bench.memory_plan import qwen3_8b_config
    from fastgrpo.bench.memory_trace import trace_train_step

    micro_batch, prompt, completion, options = case
    model_config = qwen3_8b_config(131072)
    model_config.num_hidden_layers = 2
    options = {"load_in_4bit": True, "offload_activations": True, **options}
    config = make_config_for("qwen3-8b", **{"use_peft": True, **options}, bf16=True, max_prompt_length=prompt,
                             max_completion_length=completion, per_device_train_batch_size=micro_batch,
                             gradient_accumulation_steps=8 // micro_batch)
    plan = plan_memory(config, shapes=model_shapes(model_config))
    trace = trace_train_step(model_config, micro_batch=micro_batch, prompt_length=prompt,
                             completion_length=completion, head="cuda", **options)
    assert plan.peak("logprobs") == pytest.approx(trace["logprobs"], rel=0.005)


def test_auto_fit_prefers_the_micro_batch_then_no_tiles_then_large_tiles_then_fewer_pages():
    shapes = model_shapes(model_config(make_config_for(QWEN_7B)))
    config = lambda length: make_config_for(QWEN_7B, use_peft=True, load_in_4bit=True, offload_activations=True,
                                            bf16=True, max_completion_length=length, max_prompt_length=512)
    from fastgrpo.train.plan import auto_fit, fitted, usable

    short = auto_fit(config(1024), 24 * GiB, shapes)
    assert fitted(config(1024), short) == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                                           "steps_per_generation": 1}  # no tiles, the whole pool: it fits as it is
    long = auto_fit(config(16384), 24 * GiB, shapes)
    picks = fitted(config(16384), long)  # 8 x 16896 tokens: the backward traces 21.79 GiB (fp32 norms: 24.1 planned)
    assert picks["mlp_tile_tokens"] == 16384 and picks["per_device_train_batch_size"] == 8 and long.fits(24 * GiB)
    untiled = plan_memory(config(16384), shapes=shapes, micro_batch=8)
    assert untiled.peak("train: backward") > usable(24 * GiB)  # tiles only because untiled does not fit
    # fewer KV pages only where the round's pool does not fit: Qwen3-8B-sized pools at 32K tokens on 24 GiB
    longer = auto_fit(config(32768), 24 * GiB, shapes)
    assert longer.settings["kv_blocks_least"] <= longer.settings["kv_blocks"] <= longer.settings["kv_blocks_needed"]
    assert longer.fits(24 * GiB)


def long_config(length: int, **overrides):
    """The issue's command: 4-bit LoRA r 16 with offload, G 8, 512-token prompts (the model's shapes are passed)."""
    return make_config_for("qwen3-8b", use_peft=True, load_in_4bit=True, offload_activations=True, bf16=True,
                           max_completion_length=length, max_prompt_length=512, **overrides)


def test_qwen3_8b_long_reasoning_fits_24_and_80_gib():
    """Issue 33: Qwen3-8B (config from its published numbers), 4-bit LoRA r 16, G 8. 32K-token completions train under
    22 GiB on a 24 GiB card (the KV pool takes what is left, and its least pool fits too); 110K-token completions
    under 75 GiB on an 80 GiB card with fp8 KV, the whole round's pool included: micro-batch 4 with recompute_norms
    (the backward traces 63.0 GiB), 2 without (its fp32 norms: 84 GiB at 4)."""
    from fastgrpo.bench.memory_plan import qwen3_8b_config
    from fastgrpo.train.plan import auto_fit, fitted

    shapes = model_shapes(qwen3_8b_config(131072))
    small = auto_fit(long_config(32768), 24 * GiB, shapes)
    assert max(small.peak(p) for p in small.phases if p.startswith("train")) < 22 * GiB
    least = plan_memory(long_config(32768, mlp_tile_tokens=small.settings["mlp_tile_tokens"]), shapes=shapes,
                        micro_batch=small.settings["per_device_train_batch_size"],
                        kv_blocks=small.settings["kv_blocks_least"])
    assert least.peak() < 22 * GiB
    config = long_config(110000, kv_cache_dtype="fp8")
    large = auto_fit(config, 80 * GiB, shapes)
    assert large.peak() < 75 * GiB
    assert fitted(config, large) == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                     "steps_per_generation": 2, "mlp_tile_tokens": 16384}  # the whole KV pool
    fp32_norms = long_config(110000, kv_cache_dtype="fp8", recompute_norms=False)
    assert fitted(fp32_norms, auto_fit(fp32_norms, 80 * GiB, shapes))["per_device_train_batch_size"] == 2


def test_plan_says_when_the_kv_pool_is_cut(tmp_path, capsys):
    """Qwen3-8B, 4-bit LoRA, 32K-token completions, auto-fit for 24 GiB: the pool is cut to what fits, and the plan
    says so, with the least pool and (bf16 pages) that fp8 holds twice the pages; a whole round's pool says nothing."""
    from fastgrpo.bench.memory_plan import qwen3_8b_config

    qwen3_8b_config().save_pretrained(tmp_path)
    args = ["plan", "--model-name-or-path", str(tmp_path), "--use-peft", "--load-in-4bit", "--offload-activations",
            "-G", "8", "--max-completion-length", "32768", "--gpu-memory", "24GiB", "--auto-fit"]
    main(args)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("KV pool: "))
    blocks, needed = (int(word) for word in line.split()[2:6:3])
    assert blocks < needed == 16416 and "at least 2080 pages (one completion at a time)" in line
    assert line.endswith("; --kv-cache-dtype fp8 holds twice the pages in the same bytes")
    assert f"--kv-cache-blocks {blocks} " in out
    main([*args, "--kv-cache-dtype", "fp8"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("KV pool: "))
    assert line.endswith("(one completion at a time)") and int(line.split()[2]) > 1.9 * blocks
    main([*args[:-2], "80GiB", "--auto-fit"])
    assert "KV pool: " not in capsys.readouterr().out


# -- the 2026 families: per-layer shapes, page groups, and what train refuses (issues 38, 41) ------------------------


def family_config(family: str, **options):
    """A tiny config of `family` (family_helpers' sizes: hidden 64, windows of 8, 4 experts top-2)."""
    from family_helpers import COMMON, FAMILIES
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **options}, vocab_size=128)


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256, bos_token_id=0, eos_token_id=0)


def lora_config(**overrides):
    """LoRA r 16 without dropout (LoRA on experts takes none), G 8, 64 + 192 tokens, micro-batch 2."""
    values = dict(model_name_or_path="tiny", dataset_name="builtin", use_peft=True, lora_dropout=0.0, num_generations=8,
                  max_completion_length=192, max_prompt_length=64, per_device_train_batch_size=2,
                  gradient_accumulation_steps=4, bf16=True)
    from fastgrpo.train import TrainConfig

    return TrainConfig(**{**values, **overrides})


# family -> (the kinds of layer: (query heads, K/V heads, key dim, window, KV-shared, sinks, dense width, experts))
FAMILY_LAYERS = {
    "gpt2": {(4, 4, 16, None, False, False, 256, 0)},  # Conv1D projections, no intermediate_size in the config
    "gpt_oss": {(4, 2, 16, 8, False, True, 0, 4), (4, 2, 16, None, False, True, 0, 4)},
    "gemma3_text": {(4, 2, 16, 8, False, False, 128, 0), (4, 2, 16, None, False, False, 128, 0)},
    "gemma4_text": {(4, 2, 16, 8, False, False, 128, 0), (4, 2, 32, None, False, False, 128, 0),
                    (4, 2, 16, 8, True, False, 256, 0), (4, 2, 32, None, True, False, 256, 0)},
    "qwen3_moe": {(4, 2, 16, None, False, False, 0, 4)},
    "mistral": {(4, 2, 16, 8, False, False, 128, 0)},  # the window comes from the config, for every layer
    # 3 Gated DeltaNet layers (no heads, no pages: a recurrent mixer) and a gated attention layer
    "qwen3_5_text": {(0, 0, 0, None, False, False, 128, 0), (4, 2, 16, None, False, False, 128, 0)},
    # Mamba-2, attention, Mamba-2, experts: Nemotron-H's layers are one block each
    "nemotron_h": {(0, 0, 0, None, False, False, 0, 0), (4, 2, 16, None, False, False, 0, 0),
                   (0, 0, 0, None, False, False, 32, 4)},
}


@pytest.mark.parametrize("family", FAMILY_LAYERS)
def test_each_family_is_read_layer_by_layer_and_planned(family):
    """Each layer's heads, head dims, window, shared K/V, sinks and MLP or experts, as its modules and the engine's
    probe say (not one global head_dim or intermediate_size: GPT-2's config has none, Gemma 4's global layers have
    their own head dim, its last layers share K/V and have twice the MLP); every phase planned; the KV pools hold
    block_size x kv_heads x (key dim + value dim) bytes a page for each layer that keeps pages."""
    from family_helpers import GEMMA4_KV_SHARED, HYBRIDS

    from fastgrpo.train.plan import kv_pool_bytes, window_group_pages

    if family in HYBRIDS:
        skip_without_hybrid_state()

    options = {"gemma4_text": {**GEMMA4_KV_SHARED, "use_double_wide_mlp": True},  # as E2B: shared layers' MLP x 2
               "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"]}}
    config = gpt2_config() if family == "gpt2" else family_config(family, **options.get(family, {}))
    shapes = model_shapes(config)
    kinds = {(layer.heads, layer.kv_heads, layer.head_dim, layer.window, layer.kv_shared, layer.sinks,
              layer.intermediate, layer.experts) for layer in shapes.per_layer}
    assert kinds == FAMILY_LAYERS[family]
    recurrent = [layer for layer in shapes.per_layer if layer.mixer is not None]
    assert len(recurrent) == {"qwen3_5_text": 3, "nemotron_h": 2}.get(family, 0)
    assert all(layer.mixer.saved[0] > 0 and layer.mixer.decode[0] >= layer.mixer.state > 0 for layer in recurrent)
    plan = plan_memory(lora_config(), shapes=shapes)
    assert all(plan.peak(phase) > plan.phases[phase]["weights"] for phase in plan.phases)
    N, bs = plan.settings["kv_blocks"], 16
    pools = {window: 0 for window in {None, *shapes.windows}}
    for layer in shapes.per_layer:
        if not layer.kv_shared:
            pools[layer.window] += bs * layer.kv_heads * (layer.head_dim + layer.v_head_dim) * 2
    want = {"KV pool" if w is None else f"KV pool, window {w}":
            (N + 1 if w is None else window_group_pages(w, N, bs, *plan.settings["round_sizing"]) + 1) * page
            for w, page in pools.items()}
    assert kv_pool_bytes(shapes, N, bs, 2, sizing=plan.settings["round_sizing"]) == want
    assert {k: v for k, v in plan.phases["sampling"].items() if k.startswith("KV pool")} == want


def test_window_group_pages():
    """A window's pool: a window (ceil((w - 1) / block_size) + 2 pages) for each sequence the logical pool holds at full
    length (at least 2), plus a step's prefill (ceil(max_num_batched_tokens / block_size) = 256 pages at 4096); at
    most a window for every seat and one more; never more than the logical pool."""
    from fastgrpo.train.plan import window_group_pages

    # 10**6 logical pages, sequences of 2080 pages: 481 of them fit; 256 seats bind first
    assert window_group_pages(1024, 10**6, 16, 2080, 256) == 257 * (64 + 2) + 256  # ceil(1023 / 16) = 64
    assert window_group_pages(1024, 20000, 16, 2080, 256) == 10 * (64 + 2) + 256  # 20000 / 2080: 10 sequences
    assert window_group_pages(128, 20000, 16, 2080, 64) == 10 * (8 + 2) + 256
    assert window_group_pages(129, 20000, 16, 2080, 64) == 10 * (8 + 2) + 256  # 128 / 16: still 8 pages
    assert window_group_pages(130, 20000, 16, 2080, 64) == 10 * (9 + 2) + 256
    assert window_group_pages(1024, 3000, 16, 2080, 64) == 2 * (64 + 2) + 256  # at least two sequences' windows
    assert window_group_pages(1024, 300, 16, 2080, 64) == 300  # at most the logical pool
    assert window_group_pages(8, 10**6, 16, 4, 4) == 5 * (1 + 2) + 256  # 4 seats


def test_sliding_only_and_shared_kv_pools():
    """Mistral (every layer sliding): the logical pool costs no bytes; the window's pool is the cap. Gemma 4's
    KV-shared layers keep no pages: the pools are their sources' only. A pool cut by auto-fit shrinks the windows'
    pools only below their cap."""
    from family_helpers import GEMMA4_KV_SHARED

    from fastgrpo.train.plan import ENGINE, kv_pool_bytes, window_group_pages

    mistral = model_shapes(family_config("mistral"))
    sizing = (2, ENGINE.max_num_seqs)  # sequences of 2 pages: 2500 of them fit the logical pool, 256 seats bind
    pools = kv_pool_bytes(mistral, 5000, 16, 2, sizing=sizing)
    cap = window_group_pages(8, 5000, 16, *sizing)
    assert cap == 257 * 3 + 256 < 5000
    assert pools["KV pool"] == 0 and pools["KV pool, window 8"] == (cap + 1) * 16 * 2 * (16 + 16) * 2 * 2  # 2 layers
    gemma4 = model_shapes(family_config("gemma4_text", **GEMMA4_KV_SHARED))
    shared = kv_pool_bytes(gemma4, 100, 16, 2, sizing=sizing)
    own = [layer for layer in gemma4.per_layer if not layer.kv_shared]
    assert len(own) == 2 and shared == {"KV pool": 101 * 16 * 2 * (32 + 32) * 2,  # the global layer's head dim
                                        "KV pool, window 8": 101 * 16 * 2 * (16 + 16) * 2}
    fp8 = kv_pool_bytes(gemma4, 10, 16, 1, sizing=sizing)  # 1 byte a value
    assert fp8["KV pool, window 8"] == 11 * 16 * 2 * (16 + 16)


def test_experts_and_their_lora_are_planned():
    """gpt-oss-20b (its published config): 19.1 of its 20.9B parameters are experts' 3-D weights, which bitsandbytes
    does not quantize (4-bit: only the linear layers), and LoRA on them (lora_experts) forms each layer's whole
    effective weight every forward: 1.5 GiB a layer in bf16, in sampling too."""
    from transformers import AutoConfig

    from fastgrpo.train.plan import weight_bytes

    shapes = model_shapes(AutoConfig.from_pretrained(MODELS / "gpt-oss-20b"))
    assert round(shapes.params / 1e9, 2) == 20.91 and round(shapes.expert_params / 1e9, 2) == 19.11
    four_bit = lora_config(load_in_4bit=True, max_completion_length=1024)
    assert weight_bytes(shapes, four_bit, 2) > 2 * shapes.expert_params  # the experts stay bf16
    with_experts, frozen = plan_memory(four_bit, shapes=shapes), plan_memory(lora_config(
        load_in_4bit=True, max_completion_length=1024, lora_experts=False), shapes=shapes)
    per_layer = 32 * (2880 * 5760 + 2880 * 2880) * 2  # [E, H, 2I] and [E, I, H] in bf16
    assert per_layer == pytest.approx(1.48 * GiB, rel=0.01)
    engine = lambda plan: plan.phases["sampling"]["engine forward"]
    assert engine(with_experts) - engine(frozen) >= per_layer * 2 // 3  # gate_up's at least
    backward = lambda plan: plan.phases["train: backward"]["layer backward"]
    assert backward(with_experts) > max(backward(frozen), per_layer * 4 // 3)  # the weights and down's gradient
    with pytest.raises(ValueError, match=r"^lora_dropout 0.05: LoRA on the experts of GptOssForCausalLM"):
        plan_memory(lora_config(lora_dropout=0.05), shapes=shapes)  # what add_adapters (train) says


def test_gpt2_and_a_model_the_plan_cannot_count_through_the_cli(tmp_path, capsys):
    """Issue 41 item 5: a GPT-2 config (no intermediate_size, Conv1D projections) is planned, not a traceback; a
    model with recurrent layers is refused in one line, the engine's own."""
    from transformers import MambaConfig

    skip_without_hybrid_state()  # (older transformers' Mamba is refused for its cache interface first)
    gpt2_config().save_pretrained(tmp_path / "gpt2")
    main(["plan", "--model-name-or-path", str(tmp_path / "gpt2"), "--use-peft", "--gpu-memory", "8GiB"])
    out = capsys.readouterr().out
    assert "fits in 8.0 GiB" in out and "train: backward" in out
    MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=128, state_size=8).save_pretrained(tmp_path / "mamba")
    with pytest.raises(SystemExit) as done:
        main(["plan", "--model-name-or-path", str(tmp_path / "mamba")])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fastgrpo plan: error: MambaForCausalLM has recurrent layers only: the paged engine samples models "
                   "with attention layers (a hybrid's recurrent state it keeps beside their pages)"]


def test_plan_refuses_a_kv_pool_below_the_least_it_names(capsys):
    """Issue 41 item 14: `fastgrpo plan --kv-cache-blocks` below the least pool is refused with train's own line
    (it said "fits"); the least pool itself is planned."""
    args = ["plan", *GRPO_7B, "--load-in-4bit", "--gpu-memory", "24GiB"]
    with pytest.raises(SystemExit) as done:
        main([*args, "--kv-cache-blocks", "50"])
    assert done.value.code == 2
    said = capsys.readouterr().err.strip()
    needed = 256 // 16 + 1024 // 16  # the prompt's pages and one completion's
    assert said == ("fastgrpo plan: error: --kv-cache-blocks 50 is too few: sampling needs a prompt's pages and one "
                    "completion's (of up to --max-completion-length 1024 tokens; the --num-generations 8 completions "
                    f"can run one after another), {needed} pages of 16 tokens; give at least {needed}, or leave it "
                    "unset to size the pool from --sampling-memory-fraction")
    main([*args, "--kv-cache-blocks", str(needed)])
    assert f"kv_blocks {needed}," in capsys.readouterr().out


def test_plan_advice_is_at_the_configured_micro_batch(capsys):
    """Issue 41 item 15: the options `fastgrpo plan` suggests are planned at the configured micro-batch, which the
    line names: each figure is what adding that option alone to the command gives."""
    with pytest.raises(SystemExit) as done:
        main(["plan", *GRPO_7B[:-3], "--gpu-memory", "24GiB"])  # full fine-tuning, micro-batch 8
    assert done.value.code == 1
    said = capsys.readouterr().err.strip()
    assert said.startswith("fastgrpo plan: does not fit; at --per-device-train-batch-size 8, with --use-peft: ")
    first = float(said.split("with --use-peft: ")[1].split(" GiB")[0])
    peft = plan_memory(make_config_for(QWEN_7B, use_peft=True, bf16=True), shapes=model_shapes(
        model_config(make_config_for(QWEN_7B))))
    assert first == round(peft.peak() / GiB, 1)
    main(["plan", *GRPO_7B[:-3], "--use-peft", "--gpu-memory", "24GiB"])  # that option alone: the same figure
    peak = float(capsys.readouterr().out.split("; peak ")[1].split(" GiB")[0])
    assert round(peak, 1) == first


def test_plan_refuses_fp8_kv_where_the_engine_does(tmp_path, capsys):
    """Issue 41 (minor): `--kv-cache-dtype fp8` for a model whose keys and values the engine cannot bound (OLMo 2: its
    norm follows the projections) is refused by `fastgrpo plan` with the engine's own line (it printed a plan)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from fastgrpo.sampling import Engine
    from fastgrpo.train.cli import flagged

    config = Olmo2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    config.save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["plan", "--model-name-or-path", str(tmp_path), "--kv-cache-dtype", "fp8"])
    assert done.value.code == 2
    said = capsys.readouterr().err.strip()
    with pytest.raises(ValueError) as engine:  # what `fastgrpo train` meets, as it builds its engine
        Engine(Olmo2ForCausalLM(config), kv_cache_dtype="fp8")
    assert said == f"fastgrpo plan: error: {flagged(engine.value)}"
    assert "Olmo2ForCausalLM is not one of" in said
    main(["plan", "--model-name-or-path", str(tmp_path)])  # its bf16 pages are planned


def test_a_plan_leaves_the_global_generator_as_it_was(assets, tmp_path):
    """peft draws a LoRA build's initial values from the global generator even on the meta device: the plan's LoRA
    shapes must not move it, or a run's seeded adapters would depend on whether (and how often) it was planned (it
    moved them, and test_distributed's LoRA case then ended 3.8e-5 apart on 2 processes and 1 instead of 3e-7)."""
    config = make_config(assets, tmp_path, use_peft=True, lora_r=4, lora_dropout=0.0)
    shapes = model_shapes(model_config(config))
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    plan_memory(config, shapes=shapes, device_type="cpu", micro_batch=4, prompt_length=8)
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("recipe, model, picks", [
    ("gpt-oss-20b-gsm8k", "gpt-oss-20b", "--per-device-train-batch-size 4 --gradient-accumulation-steps 2"),
    ("gemma3-12b-gsm8k", "gemma-3-12b", "--per-device-train-batch-size 8 --gradient-accumulation-steps 1"),
])  # fmt: skip
def test_the_gpu_recipes_fit_their_cards_as_they_say(recipe, model, picks, capsys):
    """recipes/gpt-oss-20b-gsm8k.yaml (80 GiB) and recipes/gemma3-12b-gsm8k.yaml (24 GiB), planned from the published
    configs: they fit, with the micro-batch their comments name."""
    path = Path(__file__).parents[1] / "recipes" / f"{recipe}.yaml"
    assert main(["plan", "--config", str(path), "--model-name-or-path", str(MODELS / model)]) in (0, None)
    out = capsys.readouterr().out
    assert "fits in" in out and picks in out, out[-600:]
