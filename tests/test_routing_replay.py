"""Routing replay (fastgrpo/routing.py, sampling/routes.py): the engine records the experts every position went
through, and the trainer's forwards route each token through them again, the weights from the current router.

Tiny random fp32 models of every MoE family the engine samples (4 experts, 2 a token), prompts of 1 to 19 tokens
over a vocabulary of 128 ids; G children, multi-turn rollouts with tool tokens, a pool small enough to preempt. Where
replay matters (the sampler's numerics differ from the trainer's) the engine samples from fp8 KV pages: its hidden
states differ by ~1e-2 and about 8% of the trainer's own routes differ from the sampler's."""

import pytest
import torch
from family_helpers import COMMON, FAMILIES, GEMMA4_MOE, HYBRIDS, save_tiny_model
from helpers import skip_without_hybrid_state
from sampling_helpers import NO_STOP, TURN_STOPS, never_fed, tool
from transformers import AutoConfig, AutoModelForCausalLM

from fastgrpo.cli import main
from fastgrpo.routing import RULES, routing_of
from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.train import TrainConfig, Trainer
from fastgrpo.train.policy_loss import PolicyLoss, aligned_routes
from fastgrpo.train.rollout import Rollout, micro_batch

VOCAB = 128
# family -> (model_type, options over family_helpers.FAMILIES'): the MoE families whose routers replay
REPLAYED = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
    "olmoe": ("olmoe", {}),
    "gpt_oss": ("gpt_oss", {}),  # sliding windows and sinks
    "qwen3_5_moe": ("qwen3_5_moe_text", {}),  # Gated DeltaNet state beside the pages
    "nemotron_h": ("nemotron_h", {}),  # DeepSeek-V3's sigmoid router
    "gemma4_moe": ("gemma4_text", GEMMA4_MOE),
}
PROMPTS = [[3 + (5 * i + 2 * j) % 120 for i in range(length)] for j, length in enumerate((1, 6, 19))]


def build(family: str, seed: int = 0, **options):
    model_type, extra = REPLAYED[family]
    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type], **extra, **options},
                                  vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(REPLAYED))
def family(request):
    if REPLAYED[request.param][0] in HYBRIDS:
        skip_without_hybrid_state()
    return request.param, build(request.param)


def rollout_of(prompts, groups) -> Rollout:
    completions = [c for group in groups for c in group]
    prompt_ids = [p for p, group in zip(prompts, groups, strict=True) for _ in group]
    return Rollout(prompt_ids=prompt_ids, completion_ids=[c.token_ids for c in completions],
                   truncated=torch.zeros(len(completions), dtype=torch.bool), advantages=torch.zeros(len(completions)),
                   loss_mask=[c.tool_mask for c in completions], routes=[c.routes for c in completions])


def trainer_logprobs(model, rollout: Rollout, packed: bool, replay: bool = True) -> list[torch.Tensor]:
    """What the trainer's no-grad pass computes: PolicyLoss.logprobs over micro-batches of 4 (padded or packed)."""
    policy = PolicyLoss(model, packed, {"logit_scale": 1.0, "logit_softcap": None}, routing_replay=replay)
    out = []
    for start in range(0, len(rollout), 4):
        mb = micro_batch(rollout, list(range(start, min(start + 4, len(rollout)))), torch.device("cpu"))
        with torch.no_grad():
            logps = policy.logprobs(mb)
        out += [row[: len(rollout.completion_ids[i])] for row, i in zip(logps, mb.index, strict=True)]
    policy.routing.stop()
    return out


def assert_routes_shape(prompts, groups, routing) -> None:
    """Every position the engine computed has a route; the ones it never fed (the last sampled token and tool tokens
    after it) have none."""
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            assert c.routes.shape == (len(prompt) + len(c.token_ids), routing.num_layers, routing.top_k)
            assert c.routes.dtype == torch.uint8
            fed = len(prompt) + len(c.token_ids) - never_fed(c)
            assert (c.routes[:fed] != routing.sentinel).all() and (c.routes[:fed] < 4).all()
            assert (c.routes[fed:] == routing.sentinel).all()


# -- the engine records, the trainer replays --------------------------------------------------------------------------


def test_each_router_has_a_rule(family):
    name, model = family
    routing = routing_of(model)
    assert routing is not None and routing.can_record and routing.unsupported is None
    assert routing.top_k == 2 and all(router.rule is not None for router in routing.routers)
    assert routing_of(model) is routing  # one set of hooks per model


def test_replayed_logprobs_equal_the_engines(family):
    """G = 3 children per prompt, sampled at T 1: the trainer's logprobs of every sampled token (padded micro-batches
    of 4) equal the engine's. The routes are the model's own choices (compared, none differs)."""
    name, model = family
    check_replay(model, packed=False)


def test_packed_rows_replay_in_order():
    """One packed row per micro-batch (the trainer's layout with flash-attn's varlen kernels; on a CPU transformers
    masks Qwen3-MoE's packed sequences block-diagonally): the routes are laid out in the row's order."""
    check_replay(build("qwen3_moe"), packed=True)


def check_replay(model, packed: bool) -> None:
    engine = Engine(model, record_routes=True)
    groups = engine.generate(PROMPTS, n=3, params=SamplingParams(temperature=1.0, max_new_tokens=24, seed=3,
                                                                 **NO_STOP))
    routing = routing_of(model)
    assert_routes_shape(PROMPTS, groups, routing)
    for group in groups:  # the children share their prompt's routes
        assert all(torch.equal(c.routes[: len(group[0].routes) - 24], group[0].routes[:-24]) for c in group)
    rollout = rollout_of(PROMPTS, groups)
    routing.take_counts()
    got = trainer_logprobs(model, rollout, packed)
    differ, compared = routing.take_counts()
    assert differ == 0 and compared > 0
    for logps, c in zip(got, [c for group in groups for c in group], strict=True):
        torch.testing.assert_close(logps, torch.tensor(c.logprobs), atol=2e-5, rtol=1e-4)


def test_multi_turn_tool_tokens_are_routed_as_the_engine_routed_them(family):
    """Tool tokens appended between turns are fed by the engine as a continuation: they have routes, and the trainer's
    logprobs of every sampled token after them equal the engine's."""
    name, model = family
    engine = Engine(model, record_routes=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=2, stop_token_ids=TURN_STOPS)
    groups = engine.generate(PROMPTS, n=2, params=params, turn_end=tool)
    assert engine.stats.num_turns >= 3 and engine.stats.num_appended_tokens > 0
    assert_routes_shape(PROMPTS, groups, routing_of(model))
    rollout = rollout_of(PROMPTS, groups)
    for logps, c in zip(trainer_logprobs(model, rollout, packed=False), [c for g in groups for c in g], strict=True):
        sampled = torch.tensor(c.tool_mask, dtype=torch.bool)
        torch.testing.assert_close(logps[sampled], torch.tensor(c.logprobs)[sampled], atol=2e-5, rtol=1e-4)


def test_a_recompute_is_routed_as_first_computed(monkeypatch):
    """A preempted sequence's positions computed again go through the experts they were first routed through (every
    recorded position a recompute reaches is forced): the routes and tokens equal a large pool's."""
    model = build("qwen3_moe")
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=5, **NO_STOP)
    want = Engine(model, record_routes=True, block_size=4).generate(PROMPTS, n=3, params=params)
    routing = routing_of(model)
    forced = []
    record = type(routing)._record

    def spy(self, router, output):
        step = self._step
        if step.forced:
            forced.append(int((step.records[router.layer][step.dest][:, 0] != self.sentinel).sum()))
        return record(self, router, output)

    monkeypatch.setattr(type(routing), "_record", spy)
    small = Engine(model, record_routes=True, block_size=4, num_blocks=24, max_num_seqs=8)
    got = small.generate(PROMPTS, n=3, params=params)
    assert small.stats.num_preemptions > 0 and small.stats.num_recomputed_tokens > 0 and sum(forced) > 0
    for group, wanted in zip(got, want, strict=True):
        for c, w in zip(group, wanted, strict=True):
            assert c.token_ids == w.token_ids and torch.equal(c.routes, w.routes)


def test_replay_routes_through_the_samplers_experts():
    """The engine samples from fp8 KV pages (its states off by ~1e-2): some of the trainer's own routes differ from
    the sampler's. Without replay the experts get the trainer's choices; with it exactly the recorded ones, on every
    position the engine computed, and the logprobs come closer to the sampler's."""
    model = build("qwen3_moe", num_experts=16, num_experts_per_tok=4, num_hidden_layers=3)
    engine = Engine(model, record_routes=True, kv_cache_dtype="fp8")
    prompts = [[3 + (7 * i + j) % 120 for i in range(12)] for j in range(6)]
    groups = engine.generate(prompts, n=4, params=SamplingParams(temperature=1.0, max_new_tokens=32, seed=1,
                                                                 **NO_STOP))
    rollout = rollout_of(prompts, groups)
    routing = routing_of(model)
    given = []  # the experts each experts module was handed, per call
    hooks = [layer.mlp.experts.register_forward_hook(lambda m, args, out: given.append(args[1]))
             for layer in model.model.layers]
    errors = {}
    for replay in (False, True):
        given.clear()
        routing.take_counts()
        got = trainer_logprobs(model, rollout, packed=False, replay=replay)
        differ, compared = routing.take_counts()
        assert 0.02 < differ / compared < 0.3, (differ, compared)  # the mismatch the metric reports, either way
        layers = len(model.model.layers)
        used = torch.cat([torch.stack(given[m : m + layers], 1) for m in range(0, len(given), layers)])  # [N, L, k]
        sequences = [p + c for p, c in zip(rollout.prompt_ids, rollout.completion_ids, strict=True)]
        routes = torch.cat([aligned_routes(rollout.routes[s : s + 4], sequences[s : s + 4], False, routing.sentinel)
                            for s in range(0, len(rollout), 4)])  # [N, L, k], as the micro-batches padded them
        routed = routes[:, 0, 0] != routing.sentinel
        same = (used[routed].sort(-1).values == routes[routed].long().sort(-1).values).all(-1)  # [tokens, L]
        assert same.all() if replay else not same.all()
        errors[replay] = torch.cat([(g - torch.tensor(c.logprobs)).abs() for g, c in
                                    zip(got, [c for group in groups for c in group], strict=True)]).mean()
    for hook in hooks:
        hook.remove()
    assert errors[True] < errors[False]


# -- the router still learns: its gradient at the recorded experts ---------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_router_gradient_equals_a_hand_written_reference(name):
    """One MoE layer's output with replayed experts (each token's *least* likely two, never the router's own) and the
    gradient of a random projection of it: the router's weight (and gpt-oss's bias) and the states get the gradient
    of the hand-written routing weights at those experts: Qwen3-MoE's softmax over the experts then the picked ones
    (renormalised with norm_topk_prob), gpt-oss's softmax over the picked logits."""
    model = build(name, seed=1, **({"norm_topk_prob": True} if name == "qwen3_moe" else {}))
    mlp = model.model.layers[0].mlp
    router = mlp.gate if name == "qwen3_moe" else mlp.router
    routing = routing_of(model)
    x = torch.randn(10, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0), requires_grad=True)
    g = torch.randn(10, COMMON["hidden_size"], generator=torch.Generator().manual_seed(1))
    logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))  # [10, 4]
    least = logits.argsort(-1)[:, :2]  # [10, 2]
    routes = torch.full((10, routing.num_layers, 2), routing.sentinel, dtype=routing.dtype)
    routes[:, 0] = least.to(routing.dtype)

    routing.replay(routes, force=True)
    out = mlp(x[None])
    out = out[0] if isinstance(out, tuple) else out
    params = [router.weight, *([router.bias] if name == "gpt_oss" else [])]
    got = torch.autograd.grad((out[0] * g).sum(), [*params, x])
    routing.stop()

    if name == "qwen3_moe":
        weights = logits.float().softmax(-1).gather(-1, least)
        weights = weights / weights.sum(-1, keepdim=True)
    else:
        weights = logits.gather(-1, least).softmax(-1)
    want = torch.autograd.grad((mlp.experts(x, least, weights) * g).sum(), [*params, x])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    free = mlp(x[None])
    free = free[0] if isinstance(free, tuple) else free
    assert not torch.allclose(free[0], out[0], atol=1e-4)  # the replayed experts are other experts


def test_rules_are_told_apart():
    """The probe picks a rule only when it reproduces the router's weights: each rule gives other weights than the
    others on the same logits (so a router whose weights none gives is refused, not replayed with the wrong ones)."""
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    experts = logits.topk(2).indices

    class Router(torch.nn.Module):
        norm_topk_prob, routed_scaling_factor, per_expert_scale = True, 2.5, torch.linspace(0.5, 1.5, 8)

    found = [rule(Router(), logits, experts) for _, rule in RULES]
    for i in range(len(found)):
        for j in range(i + 1, len(found)):
            if RULES[i][0].startswith("softmax, top k renormalised") and RULES[j][0].startswith("softmax of the top"):
                torch.testing.assert_close(found[i], found[j])  # the same weights, rounded in another dtype
                continue
            assert not torch.allclose(found[i], found[j], atol=1e-3), (RULES[i][0], RULES[j][0])


# -- fastgrpo train --routing-replay -----------------------------------------------------------------------------------


def replayed_run(tmp_path, **options):
    """A tiny Qwen3-MoE trained 2 rounds on the built-in task (16 completions a round, micro-batches of 4, gradient
    checkpointing), with a spy on every replay the policy's routing is given: (trainer, [(force, routes given)])."""
    model = save_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    config = TrainConfig(model_name_or_path=model, dataset_name="builtin", output_dir=str(tmp_path / "run"),
                         num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_completion_length=8, max_steps=2, save_steps=0, eval_num_samples=2, report_to=["none"],
                         disable_tqdm=True, reward_funcs=["accuracy", "length"], learning_rate=1e-2,
                         gradient_checkpointing=True, **options)  # fmt: skip
    trainer = Trainer(config)
    calls, replay = [], trainer.policy.routing.replay
    trainer.policy.routing.replay = lambda routes, force: calls.append((force, routes is not None)) or replay(
        routes, force)
    trainer.train()
    return trainer, calls


@pytest.mark.parametrize("options", [
    dict(routing_replay=True, num_iterations=2, beta=0.04, use_peft=True, lora_dropout=0.0, lora_r=4),
    dict(routing_replay=True, dynamic_sampling=True),
    dict(routing_replay=False, num_iterations=2),
], ids=["lora-reference-2-iterations", "dynamic-sampling", "off"])  # fmt: skip
def test_training_forwards_replay_the_routes(tmp_path, options):
    """Every training forward (old and reference logprobs, each iteration's loss and its checkpointed recompute) gets
    the rollout's routes, forced with routing_replay; the metrics compare the trainer's own routes with the sampler's
    (fp32: none differs, logprobs within 1e-5) with it on or off."""
    trainer, calls = replayed_run(tmp_path, **options)
    force = options["routing_replay"]
    iterations = options.get("num_iterations", 1)
    # per round, each micro-batch of 4: old logprobs, the reference's (beta), the loss (each iteration)
    batches = trainer.config.prompts_per_step * 4 // 4
    per_round = batches * (1 + (options.get("beta", 0) > 0) + iterations)
    assert calls == [(force, True)] * per_round * 2, calls
    for row in trainer.log.history[1:]:
        assert row["routing/mismatch"] == 0.0
        assert row["sampling/sampling_logp_difference/max"] < 1e-5
    assert trainer.policy.routing._routes is None  # nothing left to replay in the next sampling call


def test_routing_replay_is_refused_in_one_line(assets, tmp_path, capsys):
    """A dense model has no routes to replay; rollout_func's rollouts carry none."""
    with pytest.raises(SystemExit) as stop:
        main(["train", "--model-name-or-path", assets["model"], "--dataset-name", "builtin", "--output-dir",
              str(tmp_path / "run"), "--max-completion-length", "4", "--routing-replay"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("fastgrpo train: error: --routing-replay: Qwen2ForCausalLM is not a mixture-of-experts "
                          "model"), err
    with pytest.raises(SystemExit) as stop:
        main(["train", "--model-name-or-path", assets["model"], "--dataset-name", "builtin", "--routing-replay",
              "--rollout-func", "tests.agent_helpers:rollout"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "rollout_func's rollouts carry none" in err, err
