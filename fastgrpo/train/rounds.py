"""What a round's sampling gives (Sampled, one process's; RankRound, scored and gathered), and DAPO's dynamic sampling:
the round's informative groups, drawn from the data as the round needs them.

A dynamic round (Trainer._dynamic_round):

    draw = Draw(order, P * max_num_gen_batches)     # candidate prompts, taken from the data order as they are reached
    one process, the engine:   chunks of DRAW_ROUNDS rounds' worth of candidates, each one streamed call: P groups
                               start, each flat group that finishes lets one more start, the call stops once the first
                               P informative groups are known
    otherwise (several processes, tools, rollout_func):   waves, each as many groups as are still missing
    kept = the first P informative groups in draw order; the data order advances past the last of them

What is kept does not depend on the schedule, the chunks or the process count: group d of the draw samples with random
stream d.
"""

from collections import defaultdict
from typing import NamedTuple

import torch

from fastgrpo.sampling import Completion, SamplingParams
from fastgrpo.train import distributed
from fastgrpo.train.rollout import group_advantages
from fastgrpo.train.tools import ToolCounts

# Candidates per streamed engine call, in rounds' worth: the engine takes a call's prompts (and makes its output
# buffers, [groups x G, max_completion_length]) up front, so a round never hands it more than this many at once.
DRAW_ROUNDS = 10


class Sampled(NamedTuple):
    """One process's samples of a round, before scoring."""

    groups: list  # [groups][G] Completions
    prompt_ids: list  # [n] per sample
    prompts: list  # [n] per sample, as reward functions get them (after an environment's reset)
    completions: list  # [n] per sample, as reward functions get them: text or messages
    columns: dict  # more reward-function keywords, one value per sample (environments, rollout_func's fields)
    tool_counts: ToolCounts


class RankRound(NamedTuple):
    """What one process sampled and scored of a round, gathered to every process in group order."""

    groups: list  # [groups of this rank][G] Completions
    prompt_ids: list  # [n] per sample: its prompt's tokens (an environment's reset or a rollout_func may change them)
    prompts: list  # [n] per sample: its prompt as the reward functions got it (completions.jsonl logs it)
    tool_counts: ToolCounts  # tool calls made and failed (none without tools)
    per_func: torch.Tensor  # [n, F] rewards per function
    rewards: torch.Tensor  # [n] weighted sums
    preemptions: int
    logged_metrics: dict  # the reward functions' log_metric values
    logged_columns: dict  # the reward functions' log_extra columns


def merged(parts: list[RankRound], preemptions: int, scored) -> RankRound:
    """Groups (RankRounds of one group each, in round order) as one RankRound; tool counts and the reward functions'
    logged metrics summed over every group `scored` (the dropped ones made their calls too)."""
    columns = {}
    for k, part in enumerate(parts):
        for column, values in part.logged_columns.items():
            columns.setdefault(column, [None] * (len(parts[0].rewards) * k)).extend(values)
        for values in columns.values():
            values.extend([None] * (len(part.rewards) * (k + 1) - len(values)))
    metrics = defaultdict(list)
    for part in scored:
        for name, values in part.logged_metrics.items():
            metrics[name] += values
    return RankRound([g for part in parts for g in part.groups], [ids for part in parts for ids in part.prompt_ids],
                     [p for part in parts for p in part.prompts], sum((part.tool_counts for part in scored),
                                                                      ToolCounts()),
                     torch.cat([p.per_func for p in parts]), torch.cat([p.rewards for p in parts]), preemptions,
                     dict(metrics), columns)


def groups_of(parts: list[RankRound], G: int) -> list[tuple[list[Completion], RankRound]]:
    """Each group of gathered parts as a RankRound of its own (a part's tool counts, preemptions and logged metrics go
    with its first group)."""
    out = []
    for part in parts:
        for g, group in enumerate(part.groups):
            rows = slice(g * G, (g + 1) * G)
            columns = {k: v[rows] for k, v in part.logged_columns.items()}
            first = g == 0
            out.append((group, RankRound([group], part.prompt_ids[rows], part.prompts[rows],
                                         part.tool_counts if first else ToolCounts(), part.per_func[rows],
                                         part.rewards[rows], part.preemptions if first else 0,
                                         part.logged_metrics if first else {}, columns)))
    return out


def is_flat(rewards: torch.Tensor) -> bool:
    """Whether a group's scorable rewards are all equal (or it has fewer than two): zero advantage."""
    return bool(group_advantages(rewards, len(rewards), "none")[2][0])


class Draw:
    """A dynamic round's candidate prompts: draw index d is the d-th prompt from the data order's position, taken
    (from a copy of the order, which the round does not move) only when the round reaches it, at most `limit`."""

    def __init__(self, order, limit: int):
        self.cursor, self.limit = order.cursor(), limit
        self.prompts: list[int] = []

    def upto(self, k: int) -> int:
        """Makes the first min(k, limit) candidates available; returns how many are."""
        k = min(k, self.limit)
        if k > len(self.prompts):
            self.prompts += self.cursor.next(k - len(self.prompts))
        return len(self.prompts)


def dynamic_round(trainer, params: SamplingParams) -> tuple[list[int], list[RankRound], dict]:
    """DAPO's dynamic sampling for `trainer`: the round's groups whose rewards differ, prompts_per_step (x processes)
    of them, drawn in data order from at most max_num_gen_batches rounds' worth of prompts. -> (the kept groups'
    prompts, the round as one RankRound, metrics)."""
    config, world, G = trainer.config, trainer.world, trainer.config.num_generations
    P = config.prompts_per_step * world.size
    draw = Draw(trainer.order, P * config.max_num_gen_batches)
    records: dict[int, RankRound] = {}  # draw index -> its group, scored
    kept: list[int] = []  # draw indices of the informative groups, in draw order, found so far
    scanned = 0  # draw indices below this are in `records` and counted in `kept`
    started = preemptions = generated = 0  # groups sampled (in part or whole); their preemptions and tokens

    def scan() -> None:
        nonlocal scanned
        while scanned in records and len(kept) < P:
            if not is_flat(records[scanned].rewards):
                kept.append(scanned)
            scanned += 1

    if world.size == 1 and trainer.agent is None and trainer.rollout_func is None:
        data, engine = trainer.train_prompts, trainer.engine
        while len(kept) < P and started < draw.limit:
            first = started
            last = draw.upto(first + P * DRAW_ROUNDS)

            def group_done(d: int, completions: list[Completion], first=first) -> int | None:
                d += first
                sampled = trainer._plain_sampled(data, [draw.prompts[d]], [completions])
                per_func, rewards = trainer._score([draw.prompts[d]] * G, sampled)
                records[d] = RankRound(sampled.groups, sampled.prompt_ids, sampled.prompts, ToolCounts(), per_func,
                                       rewards, 0, trainer.rewards.logged_metrics, trainer.rewards.logged_columns)
                scan()
                if len(kept) == P:
                    return None
                return 1 if is_flat(rewards) else 0

            with world.together("sampling and rewards"), distributed.unsharded(trainer.policy):
                # (the finished groups are in `records`: group_done scored them as they came)
                engine.generate([data.token_ids[i] for i in draw.prompts[first:last]], n=G, params=params,
                                group_ids=list(range(first, last)), admit=P - len(kept), group_done=group_done)
            started += engine.stats.num_groups_started
            preemptions += engine.stats.num_preemptions
            generated += engine.stats.num_generated_tokens
    else:
        while len(kept) < P and started < draw.limit:
            wave = draw.prompts[started : draw.upto(started + P - len(kept))]
            for k, (group, part) in enumerate(groups_of(trainer._round(wave, params, started), G)):
                records[started + k] = part
                preemptions += part.preemptions
                generated += sum(sum(c.tool_mask) for c in group)
            started += len(wave)
            scan()
    consumed = scanned if len(kept) == P else len(draw.prompts)
    trainer.order.next(consumed)
    chosen_kept = set(kept)
    flat = [d for d in range(consumed) if d not in chosen_kept]
    chosen = sorted(kept + flat[: P - len(kept)])  # a round cut short is filled with flat groups
    parts = [records[d] for d in chosen]
    metrics = {
        "dynamic/kept_groups": len(kept),
        "dynamic/drawn_groups": consumed,  # taken from the data: kept, and dropped before the last kept one
        # = drawn_groups: no group starts past the last kept one (streamed, one starts per flat one finished;
        # waves draw the groups still missing), so the stream's stop never drops a running group
        "dynamic/sampled_groups": started,
        "dynamic/sampled_tokens": generated,
        "frac_reward_zero_std": len(flat) / max(consumed, 1),  # before filtering
    }
    return [draw.prompts[d] for d in chosen], [merged(parts, preemptions, records.values())], metrics
