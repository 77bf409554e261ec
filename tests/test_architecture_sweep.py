"""The architecture sweep (fastgrpo.bench.architectures): every causal-LM type in transformers, tiny and random, is
sampled exactly by the engine or refused in one line. KNOWN_FAILING lists the types the engine samples wrong today;
the sweep fails on any other mismatch or crash, and on a listed type that no longer fails (remove it then)."""

import pytest
from helpers import skip_below_transformers

from fastgrpo.bench.architectures import (
    MAX_LAYERS,
    MIN_LAYERS,
    NOT_BUILDABLE,
    OVERRIDES,
    STATUSES,
    WINDOW,
    Row,
    causal_lm_types,
    sweep,
    sweep_one,
    sweep_table,
    tiny_config,
)

# model type -> why the engine's samples differ from the model's own (baseline 2026-11-28, transformers 5.24).
KNOWN_FAILING = {
    "moshi": "model.generate is not the argmax of Moshi's own full forward; the engine follows the forward",
}  # fmt: skip

FAST_FAMILIES = ["llama", "mistral", "gemma2", "gemma3_text", "gpt_oss", "qwen3_moe", "deepseek_v3", "gemma4_text"]


@pytest.mark.parametrize("model_type", FAST_FAMILIES)
def test_tiny_config_and_sweep_one(model_type):
    config, reason = tiny_config(model_type)
    assert config is not None, reason
    text = config.get_text_config()
    assert MIN_LAYERS <= text.num_hidden_layers <= MAX_LAYERS and text.hidden_size == 64 and text.vocab_size == 256
    if getattr(text, "sliding_window", None) is not None:
        assert text.sliding_window == WINDOW
    if getattr(text, "layer_types", None) is not None:  # every kind of layer the full-size model mixes
        assert len(text.layer_types) == text.num_hidden_layers
        assert set(text.layer_types) == set(type(text)().layer_types), text.layer_types
    row = sweep_one(model_type)
    assert row.status in ("match", "refused"), row


def test_tiny_configs_keep_the_layer_kinds_and_experts():
    gemma3 = tiny_config("gemma3_text")[0]
    assert gemma3.layer_types == ["sliding_attention", "full_attention"]
    gpt_oss = tiny_config("gpt_oss")[0]
    assert gpt_oss.num_local_experts == 4 and gpt_oss.num_experts_per_tok == 2
    assert set(gpt_oss.layer_types) == {"sliding_attention", "full_attention"} and gpt_oss.sliding_window == WINDOW
    deepseek = tiny_config("deepseek_v3")[0]  # one dense layer, then MoE; MLA heads of rope 8 + nope 16, values 16
    assert deepseek.num_hidden_layers >= 2 and deepseek.first_k_dense_replace == 1 and deepseek.n_routed_experts == 4
    assert (deepseek.qk_rope_head_dim, deepseek.qk_nope_head_dim, deepseek.v_head_dim) == (8, 16, 16)
    gemma4 = tiny_config("gemma4_text")[0]  # Gemma 4 E2B's shared K/V: the last 2 layers read the first 2's
    assert gemma4.layer_types == ["sliding_attention", "full_attention"] * 2 and gemma4.num_kv_shared_layers == 2
    assert tiny_config("musicgen") == (None, NOT_BUILDABLE["musicgen"])


def test_sweep_table_counts_each_status():
    rows = [Row("a", "match", "max logprob error 1e-06"), Row("b", "refused", "B has x | y"),
            Row("c", "match"), Row("d", "crash", "RuntimeError: boom")]  # fmt: skip
    table = sweep_table(rows)
    assert table.splitlines()[0] == "4 architectures: 2 match, 1 refused, 0 mismatch, 1 crash, 0 not buildable"
    assert "| b | refused | B has x / y |" in table  # a pipe in a detail would split the markdown cell
    assert len(table.splitlines()) == 4 + 4


def test_tables_name_transformers_types():
    skip_below_transformers("5.24", "the tables' model types (the sweep's transformers)")
    types = set(causal_lm_types())
    assert {"llama", "gemma3_text", "gpt_oss", "deepseek_v3"} <= types
    for table in (KNOWN_FAILING, NOT_BUILDABLE, OVERRIDES):
        assert set(table) <= types, set(table) - types
    assert all(reason for _, reason in OVERRIDES.values())


@pytest.mark.slow  # every causal-LM type: ~90 s on one core
def test_every_architecture_is_sampled_exactly_or_refused():
    rows = sweep()
    print(sweep_table(rows))
    print("known failing:\n" + "\n".join(f"  {name}: {reason}" for name, reason in KNOWN_FAILING.items()))
    by_type = {r.model_type: r for r in rows}
    assert set(by_type) == set(causal_lm_types()) and all(r.status in STATUSES for r in rows)
    new = [r for r in rows if r.status in ("mismatch", "crash") and r.model_type not in KNOWN_FAILING]
    assert not new, "new mismatches or crashes:\n" + "\n".join(f"{r.model_type}: {r.status}: {r.detail}" for r in new)
    fixed = [f"{name}: now {by_type[name].status}" for name in KNOWN_FAILING
             if by_type[name].status not in ("mismatch", "crash")]  # fmt: skip
    assert not fixed, "no longer failing, remove them from KNOWN_FAILING: " + "; ".join(fixed)
    unbuilt = [r for r in rows if r.status == "not buildable" and r.model_type not in NOT_BUILDABLE]
    assert not unbuilt, "the sweep could not build these (fix tiny_config's OVERRIDES): " + "; ".join(
        f"{r.model_type}: {r.detail}" for r in unbuilt)
    assert all("\n" not in r.detail for r in rows if r.status == "refused")
