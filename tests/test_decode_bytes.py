"""The decode step's bytes, counted op by op on fake tensors (fastgrpo.bench.memory_trace.count_decode_bytes): the
fused layers' kernels move what their formulas say, and far less than transformers' modules."""

import json

import pytest
from helpers import skip_without_hybrid_state
from transformers import AutoConfig

from fastgrpo.bench import MODELS
from fastgrpo.bench.memory_trace import count_decode_bytes

CONFIG = MODELS / "qwen2.5-1.5b"


@pytest.fixture(scope="module")
def counts():
    return {fused: count_decode_bytes(CONFIG, fused=fused, num_sequences=8, context_length=40)
            for fused in (False, True)}


def test_fused_layer_moves_what_its_kernels_read_and_write(counts):
    c = AutoConfig.from_pretrained(CONFIG)
    T, H, inner, D = 8, c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
    norm = 4 * T * H * 2 + H * 2  # x, residual in; normed, summed out; the weight
    rope = T * (q + 2 * kv) * 2 + 2 * T * D * 2 + T * q * 2 + T * 2 * kv * 2  # qkv, cos, sin in; q, K, V out
    silu = T * 2 * inner * 2 + T * inner * 2
    fused = counts[True]
    assert fused["layer"] == {"gemm": fused["layer"]["gemm"], "experts": 0, "fused": 2 * norm + rope + silu,
                              "elementwise": 0}
    assert fused["layer_ops"] == {"gemm": 4, "experts": 0, "fused": 4, "elementwise": 0}


def test_transformers_layer_moves_three_times_as_much(counts):
    plain, fused = counts[False], counts[True]
    assert plain["layer_ops"]["gemm"] == 7 and sum(plain["layer_ops"].values()) >= 35
    assert plain["layer"]["elementwise"] > 2.5 * fused["layer"]["fused"]
    # the same weights: the fused GEMMs read the activations once per group instead of once per projection
    assert 0 < plain["layer"]["gemm"] - fused["layer"]["gemm"] < 0.05 * plain["layer"]["gemm"]
    # the sampler: an fp32 copy, max, subtract, exp, fp64 cumsum against one read of the bf16 logits and a tile
    assert plain["head"]["elementwise"] > 10 * (fused["head"]["fused"] + fused["head"]["elementwise"])


def test_the_decode_bytes_suite_writes_its_counts(counts, tmp_path):
    from fastgrpo.cli import main

    main(["bench", "decode-bytes", "--models", "qwen2.5-1.5b", "--sequences", "8", "--context", "40", "--out-dir",
          str(tmp_path)])
    (md,), (record,) = tmp_path.glob("decode-bytes-*.md"), tmp_path.glob("decode-bytes-*.json")
    record = json.loads(record.read_text())["qwen2.5-1.5b"]
    assert record == {"num_hidden_layers": 28, "transformers": counts[False], "fused": counts[True]}
    assert "| qwen2.5-1.5b | fused | 8 (4) |" in md.read_text()


def test_a_recurrent_layer_steps_its_state_from_the_slots():
    """Qwen3.5-9B's Gated DeltaNet layer at decode: no K/V; each row's state (32 heads x 128 x 128 fp32, and the
    convolution's last 4 inputs of 8192 channels in bf16) read and written at least once, which the counted path
    does (it moves more: transformers' PyTorch recurrent step passes over the state several times)."""
    skip_without_hybrid_state()
    rows = 8
    c = count_decode_bytes(MODELS / "qwen3.5-9b", fused=False, num_sequences=rows, context_length=40,
                           layer_type="linear_attention")
    state = 32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 4 * 2
    assert c["state_bytes"] == 2 * rows * state and c["attention_kv_bytes"] == 0 and c["head"] is None
    assert c["layer"]["elementwise"] > c["state_bytes"]
    attention = count_decode_bytes(MODELS / "qwen3.5-9b", fused=False, num_sequences=rows, context_length=40,
                                   layer_type="full_attention")
    assert attention["state_bytes"] == 0 and attention["attention_kv_bytes"] > 0


def test_an_moe_layers_experts_are_counted_apart():
    """Qwen3-30B-A3B's widths, 512 rows: the experts' grouped GEMMs are handed every expert's weights (the most they
    read: 512 rows hit all 128 experts) and the rows' (token, expert) pairs; the least on paper is the experts the rows
    hit, E (1 - (1 - k/E)^R): k of them for one row, all of them for 512."""
    from test_memory_trace import qwen3_moe_30b_widths

    from fastgrpo.bench.decode_bytes import experts_hit

    counted = count_decode_bytes(qwen3_moe_30b_widths(), fused=False, num_sequences=512, context_length=64)
    weights = 128 * 3 * 2048 * 768 * 2  # gate, up and down of every expert, bf16
    pairs = 512 * 8 * (2048 + 2 * 768 + 768 + 2048) * 2  # each pair's input, gate/up output, down input and output
    assert counted["layer_ops"]["experts"] == 2
    offsets = 2 * 128 * 4  # each GEMM's int32 group ends
    assert counted["layer"]["experts"] == weights + pairs + offsets
    assert experts_hit(128, 8, 1) == pytest.approx(8) and experts_hit(128, 8, 512) == pytest.approx(128, rel=1e-9)
