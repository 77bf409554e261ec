"""The agent-rollout benchmark (fastgrpo/bench/agent_rollout.py) at test size: 2 rollouts of 3 turns, a system turn
that names the tools (90-token prompts), the trained reciter itself as the model, one round. Both sides must give
the script's completion ids, tool masks and tool messages (the suite checks it); the engine computes every prompt
and turn token once, while TRL's loop computes the prompt and every earlier turn again in each turn. The reciter
is trained once (~10 s on 2 cores) and cached with the benchmark's in the temp folder."""

import itertools

import pytest
import torch

pytest.importorskip("trl")

from fastgrpo.bench.agent_rollout import (  # noqa: E402
    RECITER,
    SHAPES,
    Side,
    Workload,
    byte_tokenizer,
    check_equal,
    embed,
    measure,
    model_config,
    script,
)
from fastgrpo.train.tools import ToolChat  # noqa: E402

WORKLOAD = Workload(prompts=2, schemas=False, shape="reciter", repeats=1, warmup=0)


@pytest.fixture(scope="module")
def rollouts():
    tokenizer = byte_tokenizer(WORKLOAD.schemas)
    return script(tokenizer, ToolChat.for_tokenizer(tokenizer), WORKLOAD)


@pytest.fixture(scope="module")
def record():
    return measure(WORKLOAD, log=lambda line: None)


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """(value, length) of each run of equal values: the turns (1) and tool turns (0) of a completion, in order."""
    return [(value, len(list(group))) for value, group in itertools.groupby(mask)]


def test_the_engine_computes_each_token_once_and_trl_recomputes_earlier_turns(record, rollouts):
    trl, engine = record["rows"]
    stats = engine["engine_stats"]
    # Every prompt token once, every completion token once but the last sampled one, which nothing reads.
    once = sum(len(r.prompt_ids) + len(r.completion_ids) - 1 for r in rollouts)
    assert engine["tokens_computed"] == engine["forward_positions"] == once
    assert stats["num_recomputed_tokens"] == 0 and stats["num_preemptions"] == 0
    assert stats["num_turns"] == engine["turns"] == trl["turns"] == 3 * len(rollouts)
    assert stats["num_generated_tokens"] == sum(sum(r.tool_mask) for r in rollouts)
    assert stats["num_appended_tokens"] == sum(len(r.tool_mask) - sum(r.tool_mask) for r in rollouts)
    # TRL's call k feeds the prompt, turns 1..k-1 and their tool turns, then turn k's tokens but its last.
    expected = [0, 0, 0]
    for r in rollouts:
        pieces = runs(r.tool_mask)
        assert [value for value, _ in pieces] == [1, 0, 1, 0, 1], "call, tool, call, tool, answer"
        for k, turn in enumerate((0, 2, 4)):
            expected[k] += len(r.prompt_ids) + sum(n for _, n in pieces[:turn]) + pieces[turn][1] - 1
    assert trl["generate_calls"] == 3 and trl["tokens_per_call"] == expected
    assert trl["tokens_computed"] == sum(expected) > engine["tokens_computed"]
    assert expected[-1] == once, "TRL's last call computes each position once: the engine's whole count"
    assert trl["forward_positions"] >= trl["tokens_computed"], "padding and finished rows come on top"
    assert record["tokens_ratio"] == trl["tokens_computed"] / engine["tokens_computed"]
    assert all(row["seconds"] > 0 for row in record["rows"])


def script_side(rollouts) -> Side:
    return Side([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], [r.tool_mask for r in rollouts],
                [r.tool_messages for r in rollouts], [3] * len(rollouts), 1, 0, [0], 0)  # fmt: skip


def test_check_equal_refuses_any_difference(rollouts):
    check_equal(script_side(rollouts), script_side(rollouts), rollouts)
    changes = {"prompt_ids": lambda ids: ids[1:], "completion_ids": lambda ids: ids[:-1],
               "tool_masks": lambda mask: [1] * len(mask), "tool_messages": lambda messages: messages[:1],
               "turns": lambda turns: 2}
    for field, change in changes.items():
        other = script_side(rollouts)
        values = getattr(other, field)
        values[1] = change(values[1])
        with pytest.raises(AssertionError, match="^TRL's rollout 1 is not the script's"):
            check_equal(other, script_side(rollouts), rollouts)
        with pytest.raises(AssertionError, match="^engine's rollout 1 is not the script's"):
            check_equal(script_side(rollouts), other, rollouts)


def test_embed_computes_what_the_small_model_computes():
    from transformers import Qwen2ForCausalLM

    tokenizer = byte_tokenizer(False)
    torch.manual_seed(1)
    small = Qwen2ForCausalLM(model_config(RECITER, tokenizer)).eval()
    with torch.no_grad():  # norms and biases away from their init (1, 0), so that their mapping is checked
        for name, parameter in small.named_parameters():
            if "norm" in name or "bias" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
    large = embed(small, model_config(SHAPES["tiny"], tokenizer), seed=0)
    assert sum(p.numel() for p in large.parameters()) > 10 * sum(p.numel() for p in small.parameters())
    ids = torch.randint(0, len(tokenizer), (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = small(input_ids=ids).logits, large(input_ids=ids).logits
    # fp32, the same sums plus exact zeros; GEMMs over longer rows may block them differently: 0 or ~1 ulp here
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_cli_refuses_bad_arguments(tmp_path):
    from fastgrpo.cli import main

    for option in ("--prompts", "--repeats", "--threads"):
        with pytest.raises(SystemExit, match=f"^{option} must be >= 1, got 0$"):
            main(["bench", "agent", option, "0", "--out-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())
