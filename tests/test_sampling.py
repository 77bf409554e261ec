"""The paged sampling engine on tiny random Qwen2 / Qwen3 / Llama models (CPU, fp32), against HF `generate` and
full forward passes."""

import copy
import os

import pytest
import torch
from helpers import assert_close, word_tokenizer
from sampling_helpers import (
    FAMILIES,
    NO_STOP,
    NUM_WORDS,
    expected_logprobs,
    full_forward_logits,
    hf_greedy,
    prompts_for,
    tiny,
)

from fastgrpo.sampling import Engine, EngineConfig, SamplingParams
from fastgrpo.sampling.sampler import processed_logits


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny(request.param)


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_hf_generate(model, block_size):
    prompts = prompts_for(block_size)
    engine = Engine(model, block_size=block_size)
    outputs = engine.generate(prompts, n=2, params=SamplingParams(temperature=0, max_new_tokens=24, **NO_STOP))
    for prompt, completions in zip(prompts, outputs, strict=True):
        want = hf_greedy(model, prompt, 24)
        for c in completions:
            assert c.token_ids == want, (len(prompt), c.token_ids, want)
            assert c.finish_reason == "length" and len(c.logprobs) == 24
    assert engine.stats.leaked_blocks == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run of the Triton backend")
@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.slow  # the Triton interpreter: ~13 s for qwen2 alone
def test_triton_backend_greedy_matches_hf_generate(family):
    model = tiny(family)
    prompts = prompts_for(4)
    engine = Engine(model, block_size=4, attention="triton", max_num_batched_tokens=24)  # chunked, mixed batches
    outputs = engine.generate(prompts, n=2, params=SamplingParams(temperature=0, max_new_tokens=10, **NO_STOP))
    for prompt, completions in zip(prompts, outputs, strict=True):
        want = hf_greedy(model, prompt, 10)
        assert all(c.token_ids == want for c in completions), (len(prompt), want)
    assert engine.stats.leaked_blocks == 0


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 7, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 20, 0.9)])
def test_sampled_logprobs_match_full_forward(model, temperature, top_k, top_p):
    prompts = prompts_for(4)[:4]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=1, **NO_STOP)
    outputs = Engine(model, block_size=4).generate(prompts, n=3, params=params)
    for prompt, completions in zip(prompts, outputs, strict=True):
        for c in completions:
            logits = full_forward_logits(model, prompt, c.token_ids)
            want = expected_logprobs(logits, c.token_ids, temperature, top_k, top_p)
            assert torch.isfinite(want).all(), "sampled a token outside the top-k / top-p set"
            assert_close("logprobs", torch.tensor(c.logprobs), want, atol=1e-4)


def test_greedy_logprobs_are_the_raw_log_softmax(model):
    prompts = prompts_for(16)[:3]
    outputs = Engine(model).generate(prompts, n=1, params=SamplingParams(temperature=0, max_new_tokens=8, **NO_STOP))
    for prompt, (c,) in zip(prompts, outputs, strict=True):
        logp = full_forward_logits(model, prompt, c.token_ids).log_softmax(-1)
        assert c.token_ids == logp.argmax(-1).tolist()
        assert_close("logprobs", torch.tensor(c.logprobs), logp.max(-1).values, atol=1e-4)


def test_prompt_is_prefilled_once_per_group(model):
    """Count every token that enters the model: each prompt once, then each completion's tokens but its last."""
    prompts, n = prompts_for(4), 8
    fed = []
    engine = Engine(model, block_size=4)  # (its probe of the layers feeds two tokens, before any sampling)
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    try:
        outputs = engine.generate(prompts, n=n, params=SamplingParams(max_new_tokens=6, seed=0, **NO_STOP))
    finally:
        hook.remove()
    assert engine.stats.prompt_tokens_computed == tuple(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) - 1 for group in outputs for c in group)
    assert sum(fed) == sum(len(p) for p in prompts) + completion_tokens
    assert sum(fed) < n * sum(len(p) for p in prompts)
    assert engine.stats.num_preemptions == 0 and engine.stats.leaked_blocks == 0


def test_preemption_recomputes_and_frees_everything(model):
    prompts = prompts_for(4)
    params = SamplingParams(temperature=0, max_new_tokens=12, **NO_STOP)
    want = Engine(model, block_size=4).generate(prompts, n=3, params=params)
    engine = Engine(model, block_size=4, num_blocks=22, max_num_batched_tokens=7)  # one group needs <= 21 pages
    got = engine.generate(prompts, n=3, params=params)
    assert engine.stats.num_preemptions > 0
    assert engine.stats.leaked_blocks == 0
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    assert engine.stats.num_blocks == 22


def test_max_num_seqs_and_token_budget_do_not_change_results(model):
    prompts = prompts_for(4)
    params = SamplingParams(temperature=0, max_new_tokens=8, **NO_STOP)
    want = Engine(model, block_size=4).generate(prompts, n=2, params=params)
    engine = Engine(model, block_size=4, max_num_seqs=3, max_num_batched_tokens=5)
    got = engine.generate(prompts, n=2, params=params)
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    assert engine.stats.leaked_blocks == 0


def test_stop_token_ids(model):
    prompts = prompts_for(4)
    free = Engine(model, block_size=4).generate(prompts, n=1, params=SamplingParams(temperature=0, max_new_tokens=16,
                                                                                    **NO_STOP))
    stop = {free[0][0].token_ids[5], free[1][0].token_ids[9]}
    engine = Engine(model, block_size=4)
    outputs = engine.generate(prompts, n=2, params=SamplingParams(temperature=0, max_new_tokens=16,
                                                                 stop_token_ids=sorted(stop)))
    for full, completions in zip(free, outputs, strict=True):
        tokens = full[0].token_ids
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
        for c in completions:
            assert c.token_ids == tokens[:cut], "stops at the first stop token, and keeps it"
            assert c.finish_reason == ("stop" if cut < len(tokens) or tokens[-1] in stop else "length")
    assert outputs[0][0].finish_reason == "stop"
    assert engine.stats.leaked_blocks == 0


def test_default_stop_is_the_models_eos(model):
    prompts = prompts_for(4)
    free = Engine(model).generate(prompts, n=1, params=SamplingParams(temperature=0, max_new_tokens=12, **NO_STOP))
    eos = free[0][0].token_ids[3]
    model.generation_config.eos_token_id = [eos, 0]
    try:
        outputs = Engine(model).generate(prompts, n=1, params=SamplingParams(temperature=0, max_new_tokens=12))
    finally:
        model.generation_config.eos_token_id = 1
    assert outputs[0][0].token_ids == free[0][0].token_ids[: free[0][0].token_ids.index(eos) + 1]
    assert outputs[0][0].finish_reason == "stop"


def test_stop_strings(model):
    tokenizer = word_tokenizer(NUM_WORDS)
    prompts = prompts_for(4)
    free = Engine(model).generate(prompts, n=1, params=SamplingParams(temperature=0, max_new_tokens=16, **NO_STOP))
    target = free[2][0].token_ids[6]
    stop = " ".join(tokenizer.convert_ids_to_tokens([target]))  # e.g. "w42"; also matches inside "w420"...
    engine = Engine(model, tokenizer=tokenizer, block_size=4)
    outputs = engine.generate(prompts, n=2, params=SamplingParams(temperature=0, max_new_tokens=16, stop=[stop],
                                                                 **NO_STOP))
    for full, completions in zip(free, outputs, strict=True):
        tokens = full[0].token_ids
        cut = next((j + 1 for j in range(len(tokens)) if stop in tokenizer.decode(tokens[: j + 1])), len(tokens))
        for c in completions:
            assert c.token_ids == tokens[:cut]
    assert outputs[2][0].finish_reason == "stop" and len(outputs[2][0].token_ids) <= 7
    assert engine.stats.leaked_blocks == 0


def test_same_seed_same_completions(model):
    prompts = prompts_for(4)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=123, **NO_STOP)
    runs = [Engine(model, block_size=4).generate(prompts, n=4, params=params) for _ in range(2)]
    assert runs[0] == runs[1]
    other = Engine(model, block_size=4).generate(prompts, n=4, params=SamplingParams(
        temperature=1.0, top_p=0.95, max_new_tokens=12, seed=124, **NO_STOP))
    assert other != runs[0]
    # The G completions of one prompt are distinct draws, not copies.
    assert len({tuple(c.token_ids) for c in runs[0][-1]}) > 1


def test_state_is_restored_and_gradients_flow():
    model = tiny("qwen2")
    model.gradient_checkpointing_enable()
    model.train()
    model.model.layers[1].mlp.eval()
    model.model.embed_tokens.weight.requires_grad_(False)
    before = copy.deepcopy(model)
    attn = model.config._attn_implementation
    modes = {name: m.training for name, m in model.named_modules()}
    Engine(model).generate(prompts_for(4), n=2, params=SamplingParams(max_new_tokens=5, seed=0))

    assert model.config._attn_implementation == attn
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert not model.model.embed_tokens.weight.requires_grad
    assert model.is_gradient_checkpointing

    ids = torch.tensor([prompts_for(4)[-1]])
    for m in (model, before):
        m(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), before.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} changed"
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert torch.equal(p.grad, q.grad), f"{name}: gradient differs from a model that never sampled"


def test_kv_pool_is_released():
    """No tensor shaped like the pool [layers, 2, pages, block_size, kv_heads, head_dim] outlives the call."""
    import gc

    model = tiny("llama")
    engine = Engine(model, block_size=4)
    engine.generate(prompts_for(4), n=4, params=SamplingParams(max_new_tokens=8, seed=0))
    gc.collect()
    from torch._subclasses.fake_tensor import FakeTensor  # dynamo's caches may keep fakes of other tests' pools

    pools = [obj for obj in gc.get_objects()
             if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.dim() == 6]
    assert not pools and engine.stats.num_blocks > 0


def test_state_is_restored_after_an_error():
    model = tiny("llama")
    attn = model.config._attn_implementation
    model.train()

    def boom(*args):
        raise RuntimeError("boom")

    hook = model.model.layers[0].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        Engine(model).generate([[5, 6, 7]], n=2, params=SamplingParams(max_new_tokens=8))
    hook.remove()
    assert model.config._attn_implementation == attn and model.training


def test_failed_cuda_graph_capture_falls_back_to_eager(monkeypatch):
    """If the forward cannot be captured, decoding goes on eagerly with the same results, after one warning."""
    from fastgrpo.sampling.cuda_graphs import DecodeGraphs

    model = tiny("qwen2")
    prompts, params = prompts_for(4), SamplingParams(temperature=0, max_new_tokens=8, **NO_STOP)
    want = Engine(model, block_size=4).generate(prompts, n=2, params=params)
    calls = []

    def capture(self, size):
        calls.append(size)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    monkeypatch.setattr(Engine, "_decode_graphs", lambda self, kv_cache, width: DecodeGraphs(
        self._forward, kv_cache, self.config.max_num_seqs, width, self.backend, None))
    with pytest.warns(UserWarning, match="decoding without CUDA graphs"):
        got = Engine(model, block_size=4).generate(prompts, n=2, params=params)
    assert got == want and len(calls) == 1


def test_paged_batch_is_built_complete():
    """An eager step's batch from host lists (a long prefill chunk, a decode, a short prefill): cumulative starts,
    and for triton the tiles planned at construction; the batch cannot be changed afterwards."""
    import dataclasses

    from fastgrpo.kernels.paged_attention import tiles_for
    from fastgrpo.sampling.attention import build_paged_batch

    kv_cache = torch.zeros(1, 2, 6, 4, 2, 8)  # [layers, 2, blocks, block_size, Hkv, D]
    host = (list(range(15)), [[0, 1, 2], [3, 4, 0], [5, 0, 0]], [9, 1, 5], [9, 6, 7])  # slots, tables, q, context
    batch = build_paged_batch(kv_cache, *host, "triton", group=2)
    assert batch.query_starts.tolist() == [0, 9, 10, 15] and batch.context_starts.tolist() == [0, 9, 15, 22]
    assert (batch.max_query_len, batch.max_context_len) == (9, 9)
    assert batch.tiles == tiles_for(2, 9, torch.float32) and batch.tiles.block_m // 2 == 8  # 8 tokens a tile
    assert batch.tile_seqs.tolist() == [0, 0, 1, 2] and batch.tile_starts.tolist() == [0, 8, 0, 0]
    assert batch.tile_seqs.dtype == batch.tile_starts.dtype == batch.block_tables.dtype == torch.int32
    plain = build_paged_batch(kv_cache, *host, "torch", group=2)
    assert plain.tiles is plain.tile_seqs is plain.tile_starts is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.tiles = None


def test_lora_model_samples_with_its_adapters():
    peft = pytest.importorskip("peft")
    base = tiny("qwen2")
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
    prompts = prompts_for(4)[:3]
    params = SamplingParams(temperature=0, max_new_tokens=10, **NO_STOP)
    outputs = Engine(lora).generate(prompts, n=1, params=params)
    for prompt, (c,) in zip(prompts, outputs, strict=True):
        assert c.token_ids == hf_greedy(lora, prompt, 10)
    with lora.disable_adapter():
        plain = Engine(lora).generate(prompts, n=1, params=params)
    assert [g[0].token_ids for g in plain] == [hf_greedy(tiny("qwen2"), p, 10) for p in prompts]
    assert plain != outputs


def test_seeded_sampling_does_not_depend_on_the_schedule(model):
    """Each token's random number is a function of (seed, completion, column): preemptions, smaller batches and
    chunked prefill change when a sequence decodes, not what it samples."""
    prompts = prompts_for(4)
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12, seed=5, **NO_STOP)
    want = Engine(model, block_size=4).generate(prompts, n=3, params=params)
    for config in (dict(num_blocks=22, max_num_batched_tokens=7), dict(max_num_seqs=3, max_num_batched_tokens=5)):
        engine = Engine(model, block_size=4, **config)
        got = engine.generate(prompts, n=3, params=params)
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want], config
        for g, w in zip(got, want, strict=True):
            for c, d in zip(g, w, strict=True):
                assert_close("logprobs", torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-5)
        assert engine.stats.leaked_blocks == 0
    assert engine.stats.num_preemptions == 0
    preempting = Engine(model, block_size=4, num_blocks=22, max_num_batched_tokens=7)
    preempting.generate(prompts, n=3, params=params)
    assert preempting.stats.num_preemptions > 0
    # The first prompt's completions are the same when it is sampled alone, and any slice of the prompts given its
    # place in the batch (group_ids: another process's share) samples what the whole call did.
    alone = Engine(model, block_size=4).generate(prompts[:1], n=3, params=params)
    assert [c.token_ids for c in alone[0]] == [c.token_ids for c in want[0]]
    share = Engine(model, block_size=4).generate(prompts[3:5], n=3, params=params, group_ids=[3, 4])
    assert [[c.token_ids for c in g] for g in share] == [[c.token_ids for c in g] for g in want[3:5]]
    unplaced = Engine(model, block_size=4).generate(prompts[3:5], n=3, params=params)
    assert [[c.token_ids for c in g] for g in unplaced] != [[c.token_ids for c in g] for g in want[3:5]]


@pytest.mark.slow
def test_random_schedules_sample_the_same():
    """Random prompts, group sizes, stop tokens, page sizes, pools, row limits and token budgets: the engine under
    any of them (preempting, chunking, admitting late) samples exactly what the default engine does, and frees every
    page: joins, leaves, page crossings and recomputes all land where a plain run puts them."""
    import random

    model, rng = tiny("qwen2"), random.Random(0)
    preemptions = 0
    for trial in range(12):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        prompts = [[rng.randrange(3, NUM_WORDS + 3) for _ in range(length)] for length in lengths]
        n, block_size = rng.randint(1, 5), rng.choice([1, 2, 4, 16])
        params = SamplingParams(temperature=rng.choice([0.0, 1.0, 0.7]), top_k=rng.choice([0, 10]), seed=trial,
                                max_new_tokens=rng.randint(1, 20),
                                stop_token_ids=tuple(rng.sample(range(3, NUM_WORDS + 3), rng.randint(0, 3))))
        want = Engine(model, block_size=block_size).generate(prompts, n=n, params=params)
        group_pages = max(len(p) // block_size + n * -(-(len(p) % block_size + params.max_new_tokens) // block_size)
                          for p in prompts)
        engine = Engine(model, block_size=block_size, num_blocks=group_pages + rng.randint(0, 10),
                        max_num_seqs=rng.randint(1, 12), max_num_batched_tokens=rng.randint(1, 30))
        got = engine.generate(prompts, n=n, params=params)
        assert [[(c.token_ids, c.finish_reason) for c in g] for g in got] == [
            [(c.token_ids, c.finish_reason) for c in g] for g in want], (trial, engine.config)
        for g, w in zip(got, want, strict=True):
            for c, d in zip(g, w, strict=True):
                assert_close("logprobs", torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-4)
        assert engine.stats.leaked_blocks == 0
        preemptions += engine.stats.num_preemptions
    assert preemptions > 0


def test_sampler_draws_from_the_processed_distribution():
    """Counter-based uniforms through the inverse CDF: frequencies over many (completion, column) keys match the
    probabilities (chi-square), tokens outside top-k are never drawn, and the uniforms are uniform."""
    from fastgrpo.sampling.sampler import sample, uniforms

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    draws, params = 40000, SamplingParams(temperature=0.9, top_k=5)
    u = uniforms(11, torch.arange(draws // 8)[:, None], torch.arange(8)).reshape(-1)  # 5000 streams x 8 columns
    tokens, logprobs = sample(logits.expand(draws, -1), params, u)
    probs = processed_logits(logits, params).softmax(-1)[0].double()
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[5] == 0, "drew a token outside the top-k"
    expected = probs[:5] * draws
    chi2 = ((counts[:5] - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, (counts, expected)  # 4 degrees of freedom: p = 4e-4
    assert_close("logprobs", logprobs, probs.log().float()[tokens], atol=1e-6)
    bins = torch.histc(uniforms(3, torch.arange(1000)[:, None], torch.arange(100)).float(), bins=10, min=0, max=1)
    assert ((bins - 1e4) ** 2 / 1e4).sum() < 27.9  # 9 degrees of freedom: p = 1e-3
    zero = torch.zeros(4, dtype=torch.long)
    assert not torch.equal(uniforms(3, torch.arange(4), zero), uniforms(4, torch.arange(4), zero))


def test_decode_batch_joins_leaves_and_crosses_pages():
    """The persistent rows: inputs computed on the device, pages added in bulk at a page boundary, rows leaving
    from the middle filled by the last ones, sequences getting their counters back when they leave."""
    from fastgrpo.sampling.batch import DecodeBatch
    from fastgrpo.sampling.sequence import Sequence

    batch = DecodeBatch(capacity=4, max_pages=3, block_size=4, device=torch.device("cpu"))
    seqs = [Sequence([7] * 3, 3, seq_id=i, block_table=[10 + i], num_cached=3, num_generated=1) for i in range(3)]
    seqs[2].num_cached, seqs[2].block_table = 4, [20, 21]  # one token further: its next token opens page 21
    batch.join(seqs, torch.tensor([5, 6, 8]))
    assert batch.page_needs().tolist() == []
    inputs = batch.inputs()
    assert inputs["input_ids"].tolist() == [5, 6, 8] and inputs["positions"].tolist() == [3, 3, 4]
    assert inputs["slots"][0].tolist() == [10 * 4 + 3, 11 * 4 + 3, 21 * 4 + 0]
    assert inputs["context_lens"].tolist() == [4, 4, 5]
    batch.advance(torch.tensor([1, 2, 3]))
    needs = batch.page_needs()
    assert needs.tolist() == [0, 1]  # positions 4: a new page each
    batch.add_pages(needs, [30, 31])
    assert seqs[0].block_table == [10, 30] and batch.block_tables[0, :3, :2].tolist() == [[10, 30], [11, 31], [20, 21]]
    assert batch.inputs()["slots"][0].tolist() == [30 * 4, 31 * 4, 21 * 4 + 1]
    batch.remove([0])
    assert batch.seqs == [seqs[2], seqs[1]] and [s.row for s in seqs] == [None, 1, 0]
    assert (seqs[0].num_cached, seqs[0].num_generated) == (4, 2)
    assert batch.inputs()["input_ids"].tolist() == [3, 2] and batch.block_tables[0, 0, :2].tolist() == [20, 21]
    batch.remove([0, 1])
    assert len(batch) == 0 and batch.max_context() == 0


def test_stop_string_spanning_tokens():
    """A stop string made of two words stops at the token that completes it, and only candidate tokens (whose
    text holds the string's last character) are checked on the host."""
    from fastgrpo.sampling.engine import stop_string_candidates

    model, tokenizer = tiny("qwen2"), word_tokenizer(NUM_WORDS)
    prompts = prompts_for(4)
    free = Engine(model).generate(prompts, n=1, params=SamplingParams(temperature=0, max_new_tokens=16, **NO_STOP))
    tokens = free[3][0].token_ids
    stop = tokenizer.decode(tokens[4:6])  # "wA wB": spans two tokens
    outputs = Engine(model, tokenizer=tokenizer, block_size=4).generate(
        prompts, n=2, params=SamplingParams(temperature=0, max_new_tokens=16, stop=[stop], **NO_STOP))
    for full, completions in zip(free, outputs, strict=True):
        ids = full[0].token_ids
        cut = next((j + 1 for j in range(len(ids)) if stop in tokenizer.decode(ids[: j + 1])), len(ids))
        assert all(c.token_ids == ids[:cut] for c in completions)
    assert len(outputs[3][0].token_ids) <= 6 and outputs[3][0].finish_reason == "stop"
    candidates = stop_string_candidates(tokenizer, (stop,), NUM_WORDS + 3)
    words = tokenizer.convert_ids_to_tokens(list(range(NUM_WORDS + 3)))
    assert candidates.tolist() == [stop[-1] in word for word in words]
    assert stop_string_candidates(tokenizer, ("w1 ",), 200).all()  # ends in a space: every token, past the vocab too


def test_host_work_per_decode_step_does_not_grow_with_the_batch():
    """Python function calls per decode step (no joins, leaves or page crossings) are the same at 8 and at 128
    sequences: the decode rows are handled by tensor ops, not per sequence."""
    import sys

    from fastgrpo.sampling.scheduler import Scheduler

    def calls_per_step(num_prompts):
        model = tiny("qwen2")
        prompts = [[5 + i, 6, 7, 8] for i in range(num_prompts)]
        engine = Engine(model, block_size=64, max_num_seqs=256)
        counts, calls = [], [0]
        schedule = Scheduler.schedule

        def counting_schedule(self):
            counts.append(calls[0])
            return schedule(self)

        def profile(frame, event, arg):
            if event == "call":
                calls[0] += 1

        Scheduler.schedule = counting_schedule
        sys.setprofile(profile)
        try:
            engine.generate(prompts, n=8, params=SamplingParams(max_new_tokens=10, seed=0, **NO_STOP))
        finally:
            sys.setprofile(None)
            Scheduler.schedule = schedule
        steps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
        return steps[2:-1]  # decode steps after the first fork, before the last (where all rows finish)

    small, large = calls_per_step(1), calls_per_step(16)
    assert small == large and len(set(small)) == 1, (small, large)


def test_processed_logits_keep_the_top_k_and_the_top_p_mass():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    kept = lambda **kw: torch.isfinite(processed_logits(logits, SamplingParams(**kw))).sum().item()
    assert kept(top_k=2) == 2 and kept(top_k=0) == 5 and kept(top_k=50) == 5
    probs = logits.softmax(-1)[0]  # 0.636, 0.234, 0.086, ...
    assert kept(top_p=0.5) == 1 and kept(top_p=float(probs[0]) + 0.01) == 2 and kept(top_p=0.95) == 3
    assert torch.equal(processed_logits(logits, SamplingParams(temperature=0)), logits)


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(seed=1.5), "seed"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size"), (dict(num_blocks=0), "num_blocks"), (dict(memory_fraction=0), "memory_frac"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(attention="xformers"), "attention"), (dict(attention="flash", block_size=16), "multiple of 256"),
    (dict(fused_layers="yes"), "fused_layers"), (dict(cuda_graphs=1), "cuda_graphs"),
])
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_bad_generate_inputs():
    model = tiny("qwen2")
    engine = Engine(model)
    for prompts, match in [([], "prompt_token_ids"), ([[]], r"prompt_token_ids\[0\]"),
                           ([[1, 2], [3, 999]], r"prompt_token_ids\[1\]"), ([[1, 2.0]], r"prompt_token_ids\[0\]")]:
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts)
    with pytest.raises(ValueError, match="^n must"):
        engine.generate([[1, 2]], n=0)
    with pytest.raises(TypeError, match="params"):
        engine.generate([[1, 2]], params=dict(temperature=0))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate([[1, 2]], params=SamplingParams(stop=["w3"]))
    for group_ids, match in [([0, 1], "group_ids must"), ([-1], r"group_ids\[i\]"), ([1.5], r"group_ids\[i\]")]:
        with pytest.raises(ValueError, match=match):
            engine.generate([[1, 2]], params=SamplingParams(max_new_tokens=4, seed=0), group_ids=group_ids)
    with pytest.raises(ValueError, match="num_blocks=3"):
        Engine(model, block_size=4, num_blocks=3).generate([[1] * 9], n=2, params=SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="attention='triton'"):
        if os.environ.get("TRITON_INTERPRET") == "1":
            os.environ["TRITON_INTERPRET"] = "0"
            try:
                Engine(model, attention="triton")
            finally:
                os.environ["TRITON_INTERPRET"] = "1"
        else:
            Engine(model, attention="triton")
    assert model.config._attn_implementation != "fastgrpo_paged"


def test_engine_takes_a_transformers_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        Engine(torch.nn.Linear(2, 2))
