"""Dynamic sampling (--dynamic-sampling, DAPO's): flat prompt groups (rewards that do not differ) are dropped and more
prompts drawn in data order until prompts_per_step informative groups are in the round, or max_num_gen_batches
rounds' worth of prompts were drawn.

Each round is checked against a plain sampling of the same candidate prompts with the same random streams (group d of
the draw samples with stream d): the kept groups are the first P informative ones in draw order, with the same tokens
and rewards, and the data order advances by the groups drawn; no group is sampled past the last kept one. One process
streams groups through the engine; several processes (or tools, or a rollout_func) draw waves: both give the same
rounds and the same training. Resume is exact; 1 vs 2 processes is in test_distributed.py.

The tiny model and dataset come from conftest's `assets`; its completions are random, so the length reward (-1 for
5 tokens, else 0) leaves about a third of the groups of 4 flat.
"""

from types import SimpleNamespace

import pytest
import torch
from train_helpers import assert_same_metrics, killed_then_resumed, make_config
from transformers import AutoModelForCausalLM

from fastgrpo.cli import main
from fastgrpo.train import TrainConfig, Trainer
from fastgrpo.train.logs import read_metrics
from fastgrpo.train.rollout import group_advantages
from fastgrpo.train.tools import ToolCounts

DYNAMIC_ROUND = Trainer._dynamic_round  # (Rounds wraps it)

# Flat whenever the answer is not a multiple of 4 (most prompts); otherwise the completion's length in characters.
MOSTLY_FLAT = """
def mostly_flat(completions, answer, **columns):
    return [float(len(c)) if int(a) % 4 == 0 else 0.0 for c, a in zip(completions, answer)]
"""


def flat(rewards: torch.Tensor) -> bool:
    """No two scorable rewards of the group differ (its advantages are zero)."""
    return bool(group_advantages(rewards, len(rewards), "none")[2][0])


class Rounds:
    """Records every dynamic round a Trainer samples, with a plain (non-dynamic) sampling of the same candidates and
    random streams, made just before it from the same weights; `waves` makes the trainer draw waves, as with several
    processes (an agent stand-in that samples as the trainer does without one)."""

    def __init__(self, monkeypatch, waves: bool = False):
        self.rows = []

        def recorded(trainer, params):
            config = trainer.config
            candidates = trainer.order.peek(config.prompts_per_step * config.max_num_gen_batches)
            (plain,) = trainer._round(candidates, params)  # group d: random stream d
            before = trainer.order.state_dict()
            if waves:
                trainer.agent = PlainWaves(trainer.tokenizer)
            try:
                picked, parts, metrics = DYNAMIC_ROUND(trainer, params)
            finally:
                trainer.agent = None
            self.rows.append(SimpleNamespace(candidates=candidates, plain=plain, picked=picked, round=parts[0],
                                             metrics=metrics, before=before, after=trainer.order.state_dict(),
                                             num_prompts=len(trainer.train_prompts.rows)))
            return picked, parts, metrics

        monkeypatch.setattr(Trainer, "_dynamic_round", recorded)


class PlainWaves:
    """Stands in for the trainer's agent: with one, dynamic rounds are drawn in waves; each wave is sampled as without
    one (the engine, each group's random stream, the completions as text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, engine, rows, prompts, prompt_ids, group_ids, n, params):
        groups = engine.generate(prompt_ids, n=n, params=params, group_ids=group_ids)
        texts = self.tokenizer.batch_decode([c.token_ids for g in groups for c in g], skip_special_tokens=True)
        return SimpleNamespace(groups=groups, prompt_ids=[ids for ids in prompt_ids for _ in range(n)],
                               prompts=[p for p in prompts for _ in range(n)], messages=texts, environments=None,
                               counts=ToolCounts())


def tokens(groups) -> list:
    return [[c.token_ids for c in group] for group in groups]


def expected(row, P: int) -> tuple[list[int], int]:
    """(draw indices of the groups the round should hold, groups drawn) from the plain sampling of its candidates."""
    G = len(row.plain.rewards) // len(row.candidates)
    flags = [flat(row.plain.rewards[d * G : (d + 1) * G]) for d in range(len(row.candidates))]
    informative = [d for d, f in enumerate(flags) if not f][:P]
    drawn = informative[-1] + 1 if len(informative) == P else len(row.candidates)
    dropped = [d for d in range(drawn) if flags[d]]
    return sorted(informative + dropped[: P - len(informative)]), drawn


def advanced(row) -> int:
    """Prompts the round took from the data order."""
    return (row.after["epoch"] - row.before["epoch"]) * row.num_prompts + row.after["index"] - row.before["index"]


def check_round(row, P: int) -> None:
    """The round holds the first P informative groups in draw order (or, at the cap, every informative group and
    the first dropped ones), exactly as the plain sampling made them; its metrics and the data order say so."""
    chosen, drawn = expected(row, P)
    G = len(row.plain.rewards) // len(row.candidates)
    samples = [d * G + j for d in chosen for j in range(G)]
    assert row.picked == [row.candidates[d] for d in chosen]
    assert tokens(row.round.groups) == [tokens(row.plain.groups)[d] for d in chosen]
    assert torch.equal(row.round.rewards, row.plain.rewards[samples])
    assert torch.equal(row.round.per_func, row.plain.per_func[samples])
    assert row.round.prompt_ids == [row.plain.prompt_ids[k] for k in samples]
    kept = sum(not flat(row.plain.rewards[d * G : (d + 1) * G]) for d in chosen)
    m = row.metrics
    assert (m["dynamic/kept_groups"], m["dynamic/drawn_groups"]) == (kept, drawn)
    assert m["frac_reward_zero_std"] == (drawn - kept) / drawn  # before filtering: the drawn groups' share
    # Nothing is sampled past the last kept group: a group starts only when a flat one has finished (streamed), or
    # as one of the groups still missing (waves).
    assert m["dynamic/sampled_groups"] == drawn
    assert m["dynamic/sampled_tokens"] == sum(len(c.token_ids) for group in row.plain.groups[:drawn] for c in group)
    assert advanced(row) == drawn


def test_rounds_keep_the_first_informative_groups_in_draw_order(assets, tmp_path, monkeypatch):
    """Streamed through the engine (one process): every round holds prompts_per_step informative groups, the first
    ones of the draw, sampled as a plain round over the candidates would; the data order advances by the groups
    drawn (the ones sampled past the last kept group go back)."""
    rounds = Rounds(monkeypatch)
    trainer = Trainer(make_config(assets, tmp_path, dynamic_sampling=True, max_steps=4, save_steps=0))
    trainer.train()
    P = trainer.config.prompts_per_step
    for row in rounds.rows:
        check_round(row, P)
        assert row.metrics["dynamic/kept_groups"] == P
    assert sum(row.metrics["dynamic/drawn_groups"] for row in rounds.rows) > 4 * P, "no round dropped a group"
    logged = read_metrics(trainer.output_dir)[1:]
    assert [r["dynamic/kept_groups"] for r in logged] == [P] * 4
    assert [r["frac_reward_zero_std"] for r in logged] == [row.metrics["frac_reward_zero_std"] for row in rounds.rows]


@pytest.mark.parametrize("preempting", [False, True], ids=["roomy", "preempting"])
def test_streaming_and_waves_make_the_same_rounds(assets, tmp_path, monkeypatch, preempting):
    """The waves several processes draw (each as many groups as are still missing) make the rounds the engine's
    streaming makes in one process: the same groups, tokens and rewards, the same metrics (but the preemptions,
    which depend on the schedule), the same weights after training.
    `preempting`: most groups flat, longer completions and a KV pool of 30 pages of 4 tokens (a group of 4
    completions of 16 tokens needs up to 21), so groups are preempted and finish out of order."""
    steps = 2 if preempting else 4
    settings = dict(dynamic_sampling=True, max_steps=steps, save_steps=steps)
    if preempting:
        (tmp_path / "mostly_flat.py").write_text(MOSTLY_FLAT)
        settings |= dict(reward_funcs=[f"{tmp_path / 'mostly_flat.py'}:mostly_flat"], max_num_gen_batches=10,
                         max_completion_length=16, block_size=4, kv_cache_blocks=30)
    streamed = Rounds(monkeypatch)
    Trainer(make_config(assets, tmp_path / "streamed", **settings)).train()
    waves = Rounds(monkeypatch, waves=True)
    Trainer(make_config(assets, tmp_path / "waves", **settings)).train()
    P = make_config(assets, tmp_path).prompts_per_step
    for a, b in zip(streamed.rows, waves.rows, strict=True):
        check_round(b, P)
        assert a.picked == b.picked and tokens(a.round.groups) == tokens(b.round.groups)
        assert torch.equal(a.round.rewards, b.round.rewards)
    runs = [read_metrics(tmp_path / run / "run") for run in ("streamed", "waves")]
    assert_same_metrics(*[[{k: v for k, v in r.items() if k != "sampling/preemptions"} for r in rows] for rows in runs],
                        tol=0)
    if preempting:  # counted on either path
        assert all(sum(r["sampling/preemptions"] for r in rows[1:]) > 0 for rows in runs)
        assert sum(r["dynamic/drawn_groups"] for r in runs[0][1:]) > steps * 2 * P  # several waves a round
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / run / "run" / f"checkpoint-{steps}").state_dict()
            for run in ("streamed", "waves"))
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("waves", [False, True], ids=["streamed", "waves"])
def test_a_round_at_the_cap_trains_with_what_it_has(assets, tmp_path, monkeypatch, waves):
    """max_num_gen_batches 1 and a reward that leaves most groups flat: each round draws prompts_per_step groups,
    keeps the informative ones and fills up with flat ones in draw order; dynamic/kept_groups < prompts_per_step
    says it was cut short."""
    (tmp_path / "mostly_flat.py").write_text(MOSTLY_FLAT)
    rounds = Rounds(monkeypatch, waves)
    config = make_config(assets, tmp_path, dynamic_sampling=True, max_num_gen_batches=1, max_steps=4, save_steps=0,
                         reward_funcs=[f"{tmp_path / 'mostly_flat.py'}:mostly_flat"])
    Trainer(config).train()
    P = config.prompts_per_step
    for row in rounds.rows:
        check_round(row, P)
        assert row.picked == row.candidates  # the whole draw, flat groups included
        assert row.metrics["dynamic/drawn_groups"] == row.metrics["dynamic/sampled_groups"] == P
    assert min(row.metrics["dynamic/kept_groups"] for row in rounds.rows) < P


def test_wider_cap_fills_the_round_where_the_cap_of_one_cannot(assets, tmp_path, monkeypatch):
    """The same mostly-flat reward with max_num_gen_batches 30: every round is full of informative groups."""
    (tmp_path / "mostly_flat.py").write_text(MOSTLY_FLAT)
    rounds = Rounds(monkeypatch)
    config = make_config(assets, tmp_path, dynamic_sampling=True, max_num_gen_batches=30, max_steps=3, save_steps=0,
                         reward_funcs=[f"{tmp_path / 'mostly_flat.py'}:mostly_flat"])
    Trainer(config).train()
    for row in rounds.rows:
        check_round(row, config.prompts_per_step)
        assert row.metrics["dynamic/kept_groups"] == config.prompts_per_step
        assert row.metrics["dynamic/drawn_groups"] > config.prompts_per_step


def test_resume_with_dynamic_sampling_equals_uninterrupted(assets, tmp_path, monkeypatch):
    """Killed after its step-2 checkpoint and resumed: the same draws (the data position is the groups drawn, not
    the groups trained on), metrics and weights as an unbroken run."""
    resumed = killed_then_resumed(assets, tmp_path, monkeypatch, dynamic_sampling=True)
    a, b = read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "b" / "run")
    assert_same_metrics(a, b)
    assert sum(r["dynamic/drawn_groups"] for r in a[1:]) > sum(r["dynamic/kept_groups"] for r in a[1:])
    assert resumed.order.state_dict() == {"epoch": 0, "index": sum(r["dynamic/drawn_groups"] for r in a[1:])}
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / run / "run" / "checkpoint-4").state_dict()
            for run in ("a", "b"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_off_by_default(assets, tmp_path):
    """Without --dynamic-sampling a round is the next prompts_per_step prompts, flat groups and all."""
    trainer = Trainer(make_config(assets, tmp_path, max_steps=2, save_steps=0))
    trainer.train()
    rows = read_metrics(trainer.output_dir)[1:]
    assert not any(k.startswith("dynamic/") for r in rows for k in r)
    assert trainer.order.state_dict()["index"] == 2 * trainer.config.prompts_per_step


def test_max_num_gen_batches_below_one_is_refused(assets, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^max_num_gen_batches must be >= 1, got 0$"):
        TrainConfig(**{**make_config(assets, tmp_path).to_dict(), "dynamic_sampling": True, "max_num_gen_batches": 0})
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model-name-or-path", assets["model"], "--dataset-name", assets["data"], "--output-dir",
              str(tmp_path / "run"), "--num-generations", "2", "--dynamic-sampling", "--max-num-gen-batches", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == "fastgrpo train: error: --max-num-gen-batches must be >= 1, got 0\n", err
    assert not (tmp_path / "run").exists()


def test_max_num_gen_batches_past_its_cap_is_refused(assets, tmp_path, capsys):
    """1e9 rounds' worth once made P x 1e9 candidate indices up front (a MemoryError, or the machine's memory)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model-name-or-path", assets["model"], "--dataset-name", assets["data"], "--output-dir",
              str(tmp_path / "run"), "--num-generations", "2", "--dynamic-sampling", "--max-num-gen-batches",
              "1000000000"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "fastgrpo train: error: --max-num-gen-batches must be at most 1000, got 1000000000: a round that needs more "
        "rounds' worth of prompts than that has a reward that scores nearly every group flat (verl's default is 10)\n")
    assert not (tmp_path / "run").exists()


def test_candidates_are_drawn_as_the_round_needs_them(assets, tmp_path, monkeypatch):
    """--max-num-gen-batches 1000: the engine never gets more than DRAW_ROUNDS rounds' worth of prompts in one call
    (before: all P x 1000 of them, and its output buffers for each); with chunks of one round's worth the rounds keep
    the same groups and train the same as with the default chunks."""
    from fastgrpo.sampling import Engine
    from fastgrpo.train import rounds
    from fastgrpo.train import trainer as trainer_module

    calls = []

    class Recorded(Engine):
        def generate(self, prompt_token_ids, *args, **kwargs):
            calls.append(len(prompt_token_ids))
            return super().generate(prompt_token_ids, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "Engine", Recorded)
    (tmp_path / "mostly_flat.py").write_text(MOSTLY_FLAT)
    argv = lambda run, cap: ["train", "--model-name-or-path", assets["model"], "--dataset-name", assets["data"],
                             "--output-dir", str(tmp_path / run), "-G", "4", "--per-device-train-batch-size", "8",
                             "--max-completion-length", "5", "--max-steps", "3", "--save-steps", "0",
                             "--eval-num-samples", "2", "--report-to", "none", "--disable-tqdm", "--seed", "7",
                             "--dynamic-sampling", "--max-num-gen-batches", str(cap), "--reward-funcs",
                             f"{tmp_path / 'mostly_flat.py'}:mostly_flat"]
    main(argv("wide", 1000))
    P = 2  # 8 completions / G 4
    assert max(calls) <= rounds.DRAW_ROUNDS * P, calls
    monkeypatch.setattr(rounds, "DRAW_ROUNDS", 1)
    main(argv("chunked", 30))  # a call per P candidates, as many as the round needs
    monkeypatch.setattr(rounds, "DRAW_ROUNDS", 10)
    main(argv("one_call", 30))
    schedule = ("dynamic/sampled_", "sampling/preemptions")  # how much ran, which chunking changes
    same = lambda run: [{k: v for k, v in r.items() if not k.startswith(schedule)}
                        for r in read_metrics(tmp_path / run)]
    assert_same_metrics(same("chunked"), same("one_call"))
    assert any(r["dynamic/drawn_groups"] > P for r in read_metrics(tmp_path / "chunked")[1:])  # more than one chunk
