"""The engine on hybrid models (tiny random fp32 models from transformers' own configs): Qwen3.5 (dense and MoE) and
Qwen3-Next's Gated DeltaNet, Nemotron-H and Granite-4.0-H's Mamba-2, LFM2's short convolutions, each beside
attention layers. Their recurrent state lives in slots beside the pages (fastgrpo/sampling/state.py).

Each family samples what its own forward computes: greedy tokens equal `model.generate`'s (prompts of 1 to 70 tokens,
64 new tokens: across Gated DeltaNet's chunks of 64 and Mamba-2's of 8), sampled logprobs equal a full forward's,
with G children starting from their prompt's state (the prompt computed once), preemption in a small pool, 3-turn
rollouts whose parked sequences keep their state, and steps that mix decode rows with chunked prefills."""

import pytest
import torch
from family_helpers import HYBRIDS
from helpers import skip_without_hybrid_state
from sampling_helpers import (
    NO_STOP,
    TURN_STOPS,
    assert_each_position_once,
    full_forward_logits,
    hf_greedy,
    reprefill,
    tokens_of,
    tool,
)
from transformers import AutoConfig, AutoModelForCausalLM

from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.sampling import engine as engine_module
from fastgrpo.sampling.layers import Refused

BLOCK = 4
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
PROMPT_LENGTHS = (1, 5, 19, 70)
# Decode runs a recurrent layer's one-token form, the full forward its chunked form: they sum in other orders, and
# fp32 logprobs of magnitude ~3 differ by up to 1.5e-4 (tiny Qwen3.5-MoE, 2026-11-28).
LOGPROB_RTOL = 1e-4  # 70: past a Gated DeltaNet chunk (64) and many Mamba-2 chunks (8)


@pytest.fixture(autouse=True)
def _hybrid_state():
    skip_without_hybrid_state()  # (older transformers' hybrids are refused, recurrent_gemma and rwkv otherwise)


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **{**COMMON, **HYBRIDS[family]})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # every layer weighs in the residual stream (transformers' std 0.02 leaves LFM2 repeating
        for module in model.modules():  # one token); peaked outputs: greedy never hinges on the last ulp
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
        model.get_output_embeddings().weight.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=list(HYBRIDS))
def family(request):
    return request.param, build(request.param)


def prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def engine_for(model, **config):
    return Engine(model, block_size=BLOCK, **{"attention": "torch", **config})


def test_the_probe_reads_each_recurrent_layer(family):
    """Every recurrent layer is found, with the state transformers' own cache keeps per sequence (shapes from the
    config, dtypes as the model computes them: fp32 here), and the engine counts its bytes."""
    name, model = family
    engine = engine_for(model)
    config = model.config.get_text_config()
    states = engine.layer_model.states
    if name == "lfm2":  # conv state only: the hidden size x the kernel (conv_L_cache)
        want = [((64, config.conv_L_cache), None)] * 2
    elif name.startswith("qwen3"):  # q, k, v channels x the kernel; Hv x Dk x Dv
        channels = 2 * 2 * 16 + 4 * 16
        want = [((channels, config.linear_conv_kernel_dim), (4, 16, 16))] * 3
    else:  # Mamba-2: x, B, C channels x the kernel; heads x head dim x state size
        heads, head_dim, groups, size, kernel = ((8, 16, 2, 16, config.conv_kernel) if name == "nemotron_h" else
                                                 (8, 16, 1, 16, config.mamba_d_conv))  # fmt: skip
        want = [((heads * head_dim + 2 * groups * size, kernel), (heads, head_dim, size))] * (
            2 if name == "nemotron_h" else 3)
    assert [(layer.conv[0], layer.recurrent and layer.recurrent[0]) for layer in states] == want
    assert all(layer.conv[1] == torch.float32 and layer.recurrent in (None,) or layer.recurrent[1] == torch.float32
               for layer in states)  # fmt: skip
    per_seq = sum(4 * (torch.Size(c).numel() + (torch.Size(r).numel() if r else 0)) for c, r in want)
    assert engine.layer_model.state_bytes == per_seq
    engine.generate(prompts()[:2], n=2, params=SamplingParams(max_new_tokens=4, **NO_STOP))
    assert engine.stats.state_bytes == per_seq and engine.stats.state_slots > 0 and engine.stats.leaked_blocks == 0


def test_greedy_and_sampled_match_the_model(family):
    """Greedy: 64 tokens equal model.generate's. Sampled (T=1, G=3 children of each prompt): each token's logprob
    equals a full forward's log-softmax; each prompt is computed once (the children copy its final state), and no
    position twice."""
    name, model = family
    engine = engine_for(model)
    greedy = engine.generate(prompts(), n=1, params=SamplingParams(temperature=0, max_new_tokens=64, **NO_STOP))
    for prompt, (c,) in zip(prompts(), greedy, strict=True):
        assert c.token_ids == hf_greedy(model, prompt, 64), (name, len(prompt))
    sampled = engine.generate(prompts(), n=3, params=SamplingParams(temperature=1.0, max_new_tokens=24, seed=3,
                                                                    **NO_STOP))  # fmt: skip
    assert engine.stats.prompt_tokens_computed == PROMPT_LENGTHS
    assert_each_position_once(engine, prompts(), sampled)
    assert any(len({tuple(c.token_ids) for c in group}) > 1 for group in sampled)  # children diverge
    for prompt, group in zip(prompts(), sampled, strict=True):
        for c in group:
            logp = full_forward_logits(model, prompt, c.token_ids).log_softmax(-1)
            want = logp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=LOGPROB_RTOL)


def test_preemption_in_a_small_pool_changes_nothing(family):
    """Preempted children start again from their prompt's state, a preempted prompt from nothing: the same tokens."""
    name, model = family
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5, **NO_STOP)
    want = engine_for(model).generate(prompts(), n=3, params=params)
    small = engine_for(model, num_blocks=30, max_num_seqs=4)
    got = small.generate(prompts(), n=3, params=params)
    assert small.stats.num_preemptions > 0 and small.stats.num_recomputed_tokens > 0
    assert small.stats.leaked_blocks == 0
    assert tokens_of(got) == tokens_of(want)


def test_multi_turn_rollouts_keep_their_state(family):
    """Parked sequences keep their state slot while the tool runs; its tokens continue it (no position computed
    twice). Sampled: every sampled token's logprob equals a full forward's over prompt, turns and tool tokens (a lost
    or stale state would show after the first tool answer). Greedy: the rollouts equal TRL's re-prefill loop, which
    computes every turn from the start. (Sampled rollouts are not compared with that loop: the two compute the same
    logprobs in different chunkings, 2e-6 apart here, and a draw that lands that close to a boundary of the inverse
    CDF picks the neighbouring token.)"""
    name, model = family
    engine = engine_for(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=2, stop_token_ids=TURN_STOPS)
    got = engine.generate(prompts(), n=2, params=params, turn_end=tool)
    assert engine.stats.num_turns >= 3 and engine.stats.num_continuation_tokens > 0
    assert_each_position_once(engine, prompts(), got)
    for prompt, group in zip(prompts(), got, strict=True):
        for c in group:
            logp = full_forward_logits(model, prompt, c.token_ids).log_softmax(-1)
            want = logp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            sampled = torch.tensor(c.tool_mask, dtype=torch.bool)
            torch.testing.assert_close(torch.tensor(c.logprobs)[sampled], want[sampled], atol=1e-4, rtol=LOGPROB_RTOL)
    plain = engine.generate(prompts(), n=1, params=SamplingParams(temperature=0, max_new_tokens=8, **NO_STOP))
    stops = tuple(sorted({c.token_ids[5] for (c,) in plain}))  # tokens greedy decoding does sample: turns end
    greedy = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=stops)
    got = engine.generate(prompts(), n=1, params=greedy, turn_end=tool)
    assert engine.stats.num_turns >= len(prompts())
    assert tokens_of(got) == tokens_of(reprefill(engine_for(model), prompts(), 1, greedy, tool))


def test_steps_mix_decode_rows_and_chunked_prefills(family, monkeypatch):
    """With 16 tokens a step, the 70-token prompt prefills in chunks (each continuing the state the last one left)
    while the short prompts' completions decode in the same forwards: greedy tokens still equal model.generate's."""
    name, model = family
    mixed = []
    step_of = engine_module.state_step

    def record(step):
        if step is not None and step.rows is not None and step.lengths:
            mixed.append((step.rows.numel(), list(step.lengths), list(step.fresh)))
        return step_of(step)

    monkeypatch.setattr(engine_module, "state_step", record)
    chosen = prompts((3, 70, 6))
    engine = engine_for(model, max_num_batched_tokens=16)
    got = engine.generate(chosen, n=1, params=SamplingParams(temperature=0, max_new_tokens=40, **NO_STOP))
    for prompt, (c,) in zip(chosen, got, strict=True):
        assert c.token_ids == hf_greedy(model, prompt, 40), (name, len(prompt))
    assert any(not all(fresh) for _, _, fresh in mixed), mixed  # a chunk continuing its state beside decode rows


def test_seeded_streams_do_not_depend_on_the_batch(family):
    """A group sampled alone, with its place in the batch (group_ids), samples what it samples in the batch."""
    name, model = family
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=9, **NO_STOP)
    batch = engine_for(model).generate(prompts(), n=2, params=params)
    alone = engine_for(model).generate([prompts()[2]], n=2, params=params, group_ids=[2])
    assert tokens_of(alone) == tokens_of([batch[2]])


def test_the_recurrent_state_is_needed():
    """Without the state (each recurrent layer run on its new tokens alone) the engine samples other tokens: the
    tests above see it."""
    model = build("qwen3_5_text")
    engine = engine_for(model)
    engine.state_modules = []  # the layers run unwrapped: one token at a time, from no state
    got = engine.generate(prompts(), n=1, params=SamplingParams(temperature=0, max_new_tokens=16, **NO_STOP))
    assert any(g[0].token_ids != hf_greedy(model, p, 16) for p, g in zip(prompts(), got, strict=True))


@pytest.mark.parametrize("family, kind", [("recurrent_gemma", "linear_attention layers"),
                                          ("rwkv", "recurrent state")])
def test_other_recurrent_layers_are_refused_in_one_line(family, kind):
    """Recurrent layers that do not keep their state in transformers' cache protocol are refused before sampling."""
    from fastgrpo.bench.architectures import build_model, tiny_config

    config, _ = tiny_config(family)
    with pytest.raises(Refused, match=kind) as error:
        Engine(build_model(family, config, 0))
    assert "\n" not in str(error.value)


def test_streamed_groups_and_stop_tokens(family):
    """Dynamic sampling's streamed admission: two groups at a time, each finished group granting one more start, the
    call stopped when the third finishes (the group still running is dropped, its pages and state slots freed);
    each finished group samples what it samples in a plain call. Stop tokens end completions early."""
    name, model = family
    stops = SamplingParams(temperature=1.0, max_new_tokens=20, seed=4, stop_token_ids=(5, 6, 7, 8, 9))
    want = engine_for(model).generate(prompts(), n=2, params=stops)
    assert any(c.finish_reason == "stop" for group in want for c in group)
    finished = []

    def group_done(index, completions):
        finished.append(index)
        return 1 if len(finished) < 3 else None

    engine = engine_for(model)
    got = engine.generate(prompts(), n=2, params=stops, admit=2, group_done=group_done)
    assert len(finished) == 3 and engine.stats.num_groups_started == 4 and engine.stats.leaked_blocks == 0
    for index in finished:
        assert tokens_of([got[index]]) == tokens_of([want[index]])
