"""fastgrpo/train/tiling.py: tiled MLPs, LoRA adapters that keep their input as it comes, attention without a
[b, 1, T, T] mask, recomputed RMSNorms. Their gradients against the untiled, peft, masked and transformers' layers';
what one decoder layer keeps for its backward (saved_tensors_hooks) and its backward's peak (LiveBytes); a one-step
run with the options; the CPU time they cost (`python tests/test_tiled_layers.py` prints it)."""

import copy
import statistics
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model
from train_helpers import assert_same_metrics, make_config
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fastgrpo.bench.memory_trace import LiveBytes
from fastgrpo.train import TrainConfig, Trainer, tiling
from fastgrpo.train.config import BUILTIN
from fastgrpo.train.logs import read_metrics

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}  # (Qwen3: RMSNorms over each head's q and k too)
# Small, and every width distinct from the others and from the sequence lengths, so a saved tensor's shape says
# what it is: hidden 64, intermediate (FFN) 176, 4 query heads and 2 key/value heads of 16.
H, FFN, HEADS, KV_HEADS, HEAD_DIM, R = 64, 176, 4, 2, 16, 4
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


def tiny(arch: str = "qwen2", *, lora: float | None = None, dtype=torch.float32, layers: int = 2,
         hidden: int = H, intermediate: int = FFN) -> torch.nn.Module:
    """A random model of `arch` in train mode; with `lora` (its dropout) peft LoRA r 4 on every linear layer, its B
    made nonzero (peft starts it at 0, where lora_A's gradient is 0 and would compare trivially)."""
    torch.manual_seed(0)
    config_class, model_class = ARCHITECTURES[arch]
    model = model_class(config_class(
        vocab_size=50, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096,
        attn_implementation="sdpa"))  # fmt: skip
    model = model.to(dtype)
    if lora is not None:
        model = get_peft_model(model, LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=lora, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    return model.train()


def hf(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def batch(b: int = 3, T: int = 40, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and a right-padded attention mask [b, T]: rows of T, T - 9 and T - 23 tokens."""
    torch.manual_seed(seed)
    mask = torch.ones(b, T, dtype=torch.long)
    for row, pads in zip(range(b), (0, 9, 23), strict=False):
        mask[row, T - pads:] = 0
    return torch.randint(0, 50, (b, T)), mask


def gradients(model, ids, mask, seed: int = 2) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient and the input's ("inputs_embeds"), of a loss over the real tokens."""
    model.zero_grad(set_to_none=True)
    embeds = hf(model).get_input_embeddings()(ids).detach().requires_grad_()
    torch.manual_seed(seed)  # the same dropout draws in every model
    logits = model(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits
    weights = torch.linspace(-1, 1, ids.shape[1]) * mask  # [b, T]
    ((logits.float().log_softmax(-1)[..., :7].sum(-1) * weights).sum() / mask.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert len(grads) > 10  # every weight but the embeddings (the input is the embedded tokens)
    return {**grads, "inputs_embeds": embeds.grad}


def assert_same_gradients(got: dict, want: dict, atol: float, rtol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


def checkpointed(model, on: bool):
    """As load_policy checkpoints the decoder layers (non-reentrant)."""
    if on:  # (transformers < 5.23 names it gradient_checkpointing_enable)
        net = hf(model)
        if hasattr(net, "activation_checkpointing_enable"):
            net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


# -- gradients -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
@pytest.mark.parametrize("lora", [None, 0.0], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiled_mlp_gradients_equal_untiled(arch, lora, checkpointing):
    """Tiles of 7 tokens over 3 x 40 (the last tile short): every parameter's gradient and the input's equal the
    untiled model's. Tolerance: a weight's gradient is now a sum of per-tile matmuls in fp32, a reordering of the same
    sum, off by n u sum|terms| at most (Higham eq. 4.4). Gradients are below 1 here; measured at most 2.4e-7 apart
    (4 ulp): 1e-6, as test_memory_constrained's offload check, and 1e-6 relative."""
    untiled = checkpointed(tiny(arch, lora=lora), checkpointing)
    tiled = copy.deepcopy(untiled)
    assert tiling.tile_mlps(tiled, 7) == 2
    ids, mask = batch()
    assert_same_gradients(gradients(tiled, ids, mask), gradients(untiled, ids, mask), atol=1e-6, rtol=1e-6)


def test_a_checkpointed_layer_does_not_recompute_the_tiled_mlp():
    """Checkpointed, the layer's recompute stops once the tiled MLP's input is kept: the MLP runs its 8 tiles (3 x 40
    tokens by 16) once in the forward, without autograd, and once in the backward, with it; no third pass."""
    model = checkpointed(tiny(layers=1), True)
    tiling.tile_mlps(model, 16)
    calls = []
    hf(model).model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, out: calls.append((torch.is_grad_enabled(), args[0].shape[0])))
    gradients(model, *batch())
    assert calls == [(False, 16)] * 7 + [(False, 8)] + [(True, 16)] * 7 + [(True, 8)]


def test_tiled_mlp_replays_the_forwards_dropout_in_its_backward():
    """With LoRA dropout each tile draws its own masks (tiling changes the draws, not their distribution); the backward
    recomputes the tiles with the forward's draws: its gradients equal those of the same tiles run by plain autograd
    (no recompute) from the same seed. And one tile of every token is the untiled MLP, draws included."""
    untiled = tiny(lora=0.3)
    one_tile, tiled, by_hand = copy.deepcopy(untiled), copy.deepcopy(untiled), copy.deepcopy(untiled)
    tiling.tile_mlps(one_tile, 10_000)
    tiling.tile_mlps(tiled, 16)
    for mlp in (m for m in by_hand.modules() if hasattr(m, "gate_proj")):
        def forward(x, mlp=mlp):  # [b, T, H]
            parts = [type(mlp).forward(mlp, part) for part in x.reshape(-1, x.shape[-1]).split(16)]
            return torch.cat(parts).view(*x.shape[:-1], -1)
        mlp.forward = forward
    ids, mask = batch()
    assert_same_gradients(gradients(tiled, ids, mask), gradients(by_hand, ids, mask), atol=1e-6, rtol=1e-6)
    assert_same_gradients(gradients(one_tile, ids, mask), gradients(untiled, ids, mask), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_inputs_give_peft_gradients_bit_for_bit(arch, dropout, dtype):
    """LoRAInput computes peft's expression with peft's draws, and its backward redoes the same ops: the gradients are
    torch.equal to peft's, in bf16 (where peft's fp32 copies are what LoRAInput does not keep) and with dropout."""
    peft_model = checkpointed(tiny(arch, lora=dropout, dtype=dtype), True)
    ours = copy.deepcopy(peft_model)
    assert tiling.recompute_lora_inputs(ours) == 2 * 7
    ids, mask = batch()
    assert_same_gradients(gradients(ours, ids, mask), gradients(peft_model, ids, mask), atol=0, rtol=0)
    state = ours.state_dict()
    assert state.keys() == peft_model.state_dict().keys()  # the adapter saves as peft's


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lora", [None, 0.0], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_recomputed_norms_give_the_norms_gradients(arch, lora, dtype, checkpointing, monkeypatch):
    """Every RMSNorm recomputed in tiles of 7 tokens (3 x 40 tokens: the last tile short; Qwen3's q and k norms in
    tiles of 28 head rows): the input's and every parameter's gradient equal transformers' norms'. With LoRA in bf16
    bit for bit; in fp32 the input's gradient sums its two paths (the residual and the norm) in another order
    (measured <= 2.4e-7: 1e-6 as the tiled MLP); trained norm weights sum their gradient over tiles in their dtype
    (bf16: measured <= 1.6e-4, a bf16 rounding per tile as gradient accumulation rounds per micro-batch)."""
    monkeypatch.setattr(tiling, "NORM_TILE_VALUES", 7 * H)
    plain = checkpointed(tiny(arch, lora=lora, dtype=dtype), checkpointing)
    recomputed = copy.deepcopy(plain)
    assert tiling.recompute_norms(recomputed) == (9 if arch == "qwen3" else 5)  # 2 a layer (+ q, k), the final one
    ids, mask = batch()
    got, want = gradients(recomputed, ids, mask), gradients(plain, ids, mask)
    if lora is not None and dtype == torch.bfloat16:
        assert all(torch.equal(got[name], want[name]) for name in want)
    elif dtype == torch.float32:
        assert_same_gradients(got, want, atol=1e-6, rtol=1e-6)
    else:
        assert_same_gradients(got, want, atol=1e-3, rtol=1.6e-2)  # bf16's own tolerance


def test_lora_inputs_follow_disable_dropout_and_eval():
    model = tiny(lora=0.5)
    tiling.recompute_lora_inputs(model)
    lora_a = hf(model).model.layers[0].mlp.down_proj.lora_A["default"]
    x = torch.randn(5, FFN)
    assert isinstance(lora_a, tiling.LoRAInput) and lora_a.dropout.p == 0.5
    assert not torch.equal(lora_a(x), torch.nn.functional.linear(x, lora_a.weight))
    model.eval()
    torch.testing.assert_close(lora_a(x), torch.nn.functional.linear(x, lora_a.weight), atol=0, rtol=0)
    model.train()
    for module in model.modules():  # the trainer's disable_dropout
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    torch.testing.assert_close(lora_a(x), torch.nn.functional.linear(x, lora_a.weight), atol=0, rtol=0)


def test_lora_inputs_leave_dora_to_peft():
    """A variant (DoRA) reads the cast input itself: its layers keep peft's path, casting included."""
    torch.manual_seed(0)
    model = get_peft_model(Qwen2ForCausalLM(Qwen2Config(
        vocab_size=50, hidden_size=H, intermediate_size=FFN, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS)).to(torch.bfloat16), LoraConfig(r=R, use_dora=True, target_modules="all-linear"))
    assert tiling.recompute_lora_inputs(model) == 0
    assert not any(isinstance(m, tiling.LoRAInput) for m in model.modules())
    ids, mask = batch()
    assert gradients(model, ids, mask)


@pytest.mark.parametrize("lora", [None, 0.0], ids=["full", "lora"])
def test_mask_free_attention_equals_the_masked_one_on_real_tokens(lora):
    """Right padding: logits and gradients of the real tokens as with transformers' mask (the loss reads no pad),
    SDPA called without a mask, is_causal and GQA in the kernel. Left padding falls back to the mask."""
    masked = checkpointed(tiny(lora=lora), True)
    free = copy.deepcopy(masked)
    assert tiling.use_mask_free_sdpa(hf(free)) and hf(free).config._attn_implementation == tiling.MASK_FREE_SDPA
    ids, mask = batch()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((attn_mask is None, kwargs.get("is_causal"), key.shape[1]))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        real = mask.bool()
        with torch.no_grad():
            want = masked(input_ids=ids, attention_mask=mask).logits
            got = free(input_ids=ids, attention_mask=mask).logits
        assert calls[2:] == [(True, True, KV_HEADS)] * 2 and calls[:2] == [(False, False, HEADS)] * 2
        torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=1e-6)
        calls.clear()
        with torch.no_grad():
            left = mask.flip(1)
            got = free(input_ids=ids, attention_mask=left).logits
            want = masked(input_ids=ids, attention_mask=left).logits
        assert calls == [(False, False, HEADS)] * 4
        torch.testing.assert_close(got[left.bool()], want[left.bool()], atol=0, rtol=0)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    # Kernel choice aside (SDPA with is_causal against a boolean mask), the same arithmetic: fp32 rounding.
    assert_same_gradients(gradients(free, ids, mask), gradients(masked, ids, mask), atol=1e-6, rtol=1e-6)


# -- what a layer keeps ----------------------------------------------------------------------------------------------


def layer_saved(model, T: int, b: int = 2) -> dict[int, tuple[int, tuple, torch.dtype]]:
    """What decoder layer 0 saves for its backward (not checkpointed), one entry per storage: {key: (bytes, shape,
    dtype)}; parameters left out. Row 1 of the micro-batch is right-padded by 5."""
    layer = hf(model).model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape), t.dtype)
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    enter = layer.register_forward_pre_hook(lambda *_: hooks.__enter__())
    leave = layer.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    ids, mask = torch.randint(0, 50, (b, T)), torch.ones(b, T, dtype=torch.long)
    mask[1, T - 5:] = 0
    embeds = hf(model).get_input_embeddings()(ids).detach().requires_grad_()
    try:
        model(inputs_embeds=embeds, attention_mask=mask, use_cache=False)
    finally:
        enter.remove()
        leave.remove()
    return saved


def per_token(model, b: int = 2) -> float:
    """Bytes layer 0 keeps per token, from two lengths (what does not grow with T left out); with a mask, its
    T^2 term counts too."""
    return (sum(n for n, _, _ in layer_saved(model, 128, b).values())
            - sum(n for n, _, _ in layer_saved(model, 64, b).values())) / (b * 64)


def configured(*, lora, tile=None, lora_inputs=False, mask_free=False, norms=False) -> torch.nn.Module:
    model = tiny(lora=lora, dtype=torch.bfloat16, layers=1)
    if mask_free:
        tiling.use_mask_free_sdpa(hf(model))
    tiling.apply_layer_memory_options(model, tile, lora_inputs, norms)
    return model


def test_saved_bytes_per_layer_lose_their_intermediate_and_fp32_terms():
    """bf16, LoRA r 4 (peft's default dropout 0 here; TrainConfig's 0.05 adds its masks), per token of one layer:
    * mask-free: the additive [b, 1, T, T] mask (b T^2 x 2 bytes) and K/V repeated to every query head are gone;
    * LoRA inputs: peft's fp32 input copies, 4 bytes per input value of q, k, v, o, gate, up and down, give way to the
      inputs in bf16: q/k/v's (one tensor), gate/up's (one) and down's; o's is the attention output, kept anyway;
    * tiled MLP: no saved tensor is [T, FFN] (the four SwiGLU ones, and down's input): only the MLP's input is kept."""
    b = 2
    plain = per_token(configured(lora=0.0), b)
    free = per_token(configured(lora=0.0, mask_free=True), b)
    inputs = per_token(configured(lora=0.0, lora_inputs=True, mask_free=True), b)
    tiled_model = configured(lora=0.0, tile=16, lora_inputs=True, mask_free=True)
    tiled = per_token(tiled_model, b)
    mask_bytes = (128**2 - 64**2) * 2 / 64  # the bf16 additive mask's growth per token of row (b cancels)
    repeated = 2 * (Q - KV) * 2  # K and V repeated from 2 to 4 heads, bf16
    assert plain - free == mask_bytes + repeated
    assert free - inputs == 4 * (3 * H + Q + 2 * H + FFN) - 2 * (H + H + FFN)
    assert inputs - tiled == 3 * 2 * FFN + 2 * FFN + 3 * 4 * R  # gate, SiLU(gate), up, down's input; lora_A's outputs
    shapes = [shape for _, shape, _ in layer_saved(tiled_model, 128, b).values()]
    assert not any(FFN in shape for shape in shapes), shapes
    assert not any(shape[-2:] == (128, 128) for shape in shapes), shapes
    assert tiled <= 12 * 2 * H, tiled  # O(H): the layer's [T, H] tensors (transformers' RMSNorm keeps 2 in fp32)
    assert plain >= 2 * tiled + 4 * 2 * FFN
    # recomputed norms: each of the two drops its fp32 input copy and its fp32 rsqrt, and keeps its input in bf16
    normed_model = configured(lora=0.0, tile=16, lora_inputs=True, mask_free=True, norms=True)
    assert tiled - per_token(normed_model, b) == 2 * (4 * H + 4) - 2 * 2 * H
    kept = layer_saved(normed_model, 128, b).values()
    assert not any(dtype == torch.float32 and shape[-1] in (H, 1) for _, shape, dtype in kept), kept


def backward_peak(model, T: int, b: int = 2) -> int:
    """Bytes live at the backward's peak, the parameters left out: what the forward kept and the backward's own
    tensors (one micro-batch, no checkpointing: the layer's backward as a checkpointed layer's recompute runs it)."""
    ids = torch.randint(0, 50, (b, T))
    with LiveBytes(model.parameters()) as live:
        logits = model(input_ids=ids, use_cache=False).logits
        loss = logits.float().logsumexp(-1).mean()
        del logits
        with live.phase("backward"):
            loss.backward()
    return live.peaks["backward"] - live.base


@pytest.mark.parametrize("lora", [None, 0.0], ids=["full", "lora"])
def test_tiled_backward_peak_grows_with_hidden_not_intermediate(lora):
    """One layer, FFN = 8 H, fp32: from 256 to 512 tokens a row, the untiled backward's peak grows by more than the four
    [T, FFN] SwiGLU tensors (4 FFN x 4 bytes per token); tiled by 16, by less than 16 H x 4 bytes per token (the
    layer's [T, H] tensors, the [T, 50] logits and their gradients), the [tile, FFN] ones a constant. Measured:
    untiled 14936 (full) / 14260 (LoRA) bytes per token, tiled 2904 / 3220."""
    untiled = tiny(lora=lora, layers=1, intermediate=8 * H)
    tiled = copy.deepcopy(untiled)
    tiling.tile_mlps(tiled, 16)
    b = 2
    grow_untiled = (backward_peak(untiled, 512, b) - backward_peak(untiled, 256, b)) / (b * 256)
    grow_tiled = (backward_peak(tiled, 512, b) - backward_peak(tiled, 256, b)) / (b * 256)
    assert grow_untiled > 4 * 8 * H * 4, grow_untiled
    assert grow_tiled < 16 * H * 4, grow_tiled


def test_options_are_checked():
    with pytest.raises(ValueError, match="mlp_tile_tokens must be at least 1"):
        TrainConfig(model_name_or_path=BUILTIN, dataset_name=BUILTIN, mlp_tile_tokens=0)
    with pytest.raises(ValueError, match="mlp_tile_tokens: Linear has no MLP"):
        tiling.tile_mlps(torch.nn.Linear(2, 2), 4)


# -- fastgrpo train --------------------------------------------------------------------------------------------------

OFF = dict(mlp_tile_tokens=None, recompute_lora_inputs=False, mask_free_attention=False, recompute_norms=False)


@pytest.mark.parametrize("settings", [dict(), dict(offload_activations=True), dict(use_peft=True, lora_dropout=0.0),
                                      dict(use_peft=True, lora_dropout=0.0, load_in_4bit=True)],
                         ids=["full", "full-offload", "lora", "qlora"])
def test_one_step_with_the_options_gives_the_metrics_without(assets, tmp_path, settings):
    """One training step (and its evaluations) with all three options, tiles of 16 tokens (a micro-batch of 8
    sequences of up to ~25 tokens: a dozen tiles), against none: the same loss, grad_norm and every other metric.
    lora_dropout 0: tiles draw their own dropout masks, which would change the step."""
    if settings.get("load_in_4bit"):
        pytest.importorskip("bitsandbytes")
    common = dict(max_steps=1, save_steps=0, **settings)
    Trainer(make_config(assets, tmp_path / "a", **OFF, **common)).train()
    trainer = Trainer(make_config(assets, tmp_path / "b", mlp_tile_tokens=16, **common))
    net = hf(trainer.model)
    assert net.config._attn_implementation == tiling.MASK_FREE_SDPA
    assert net.model.layers[0].mlp.forward.func is tiling._tiled_forward
    assert net.model.layers[0].input_layernorm.forward.func is tiling._recomputed_norm
    if settings.get("use_peft"):
        assert isinstance(net.model.layers[0].self_attn.q_proj.lora_A["default"], tiling.LoRAInput)
    trainer.train()
    a, b = read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "b" / "run")
    assert [r.get("loss") for r in a] == pytest.approx([r.get("loss") for r in b])
    assert_same_metrics(a, b)


# -- CPU time --------------------------------------------------------------------------------------------------------


def step_seconds(model, ids, mask) -> tuple[float, float]:
    """(wall, this thread's CPU) seconds of one forward + backward."""
    wall, cpu = time.perf_counter(), time.thread_time()
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    logits.float().logsumexp(-1).mean().backward()
    return time.perf_counter() - wall, time.thread_time() - cpu


def time_ratios(repeats: int = 9, tokens: int = 1024, tile: int = 256, dropout: float = 0.05) -> dict[str, tuple]:
    """Medians over interleaved repeats of a checkpointed forward + backward, one thread (the ratio is the work's: a
    shared machine's other loads reach one thread least), fp32 as fastgrpo trains on a CPU; LoRA r 16 with
    `dropout` (TrainConfig's 0.05) on a Qwen2 of hidden 256, intermediate 1024 (4 H), 2 layers; 2 rows of tokens / 2,
    the second right-padded by 50. Each option alone and all four, over the same model with none:
    {variant: (wall-time ratio, CPU-time ratio)}, and "none (s)": the plain step's (wall, CPU) seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=tokens, attn_implementation="sdpa"))  # fmt: skip
    base = checkpointed(get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout,
                                                        target_modules="all-linear")), True).train()
    options = {"tiled MLP": (tile, False, False, False), "LoRA inputs": (None, True, False, False),
               "mask-free attention": (None, False, True, False), "recomputed norms": (None, False, False, True),
               "all four": (tile, True, True, True)}
    variants = {"none": base}
    for name, (tile_tokens, lora_inputs, mask_free, norms) in options.items():
        variants[name] = copy.deepcopy(base)
        if mask_free:
            tiling.use_mask_free_sdpa(hf(variants[name]))
        tiling.apply_layer_memory_options(variants[name], tile_tokens, lora_inputs, norms)
    ids = torch.randint(0, 256, (2, tokens // 2))
    mask = torch.ones_like(ids)
    mask[1, -50:] = 0
    times = {name: [] for name in variants}
    try:
        for repeat in range(repeats + 1):
            for name, model in variants.items():
                seconds = step_seconds(model, ids, mask)
                if repeat:  # the first round warms up
                    times[name].append(seconds)
    finally:
        torch.set_num_threads(threads)
    medians = {name: tuple(statistics.median(column) for column in zip(*t, strict=True)) for name, t in times.items()}
    none = medians.pop("none")
    return {name: (wall / none[0], cpu / none[1]) for name, (wall, cpu) in medians.items()} | {"none (s)": none}


@pytest.mark.slow
def test_tiling_costs_no_more_mlp_forwards():
    """Checkpointed, the tiled MLP runs as many forwards as the untiled one (the recompute skips it, the backward's
    tiles take its place): measured 1.05x the step's CPU time; 1.3x leaves room for a shared CPU's noise."""
    ratios = time_ratios(repeats=5)
    print(ratios)
    assert ratios["tiled MLP"][1] < 1.3


if __name__ == "__main__":
    for dropout in (0.05, 0.0):
        ratios = time_ratios(dropout=dropout)
        print(f"lora_dropout {dropout}:", {name: tuple(round(v, 3) for v in values) for name, values in ratios.items()})
