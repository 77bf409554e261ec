"""A round's sampling and scoring (the Trainer's `Rounds` part): this process's share of the prompt groups sampled by
the engine (with the agent's tool loop, or by the user's rollout_func), scored by the reward functions and gathered to
every process (Sampled, one process's; RankRound, scored and gathered); and DAPO's dynamic sampling: the round's
informative groups, drawn from the data as the round needs them.

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

import copy
import math
import zlib
from collections import defaultdict
from typing import NamedTuple

import torch

from fastgrpo.sampling import Completion, SamplingParams
from fastgrpo.train import distributed
from fastgrpo.train.data import Prompts
from fastgrpo.train.rewards import RewardError
from fastgrpo.train.rollout import group_advantages
from fastgrpo.train.tools import RolloutError, ToolChat, ToolCounts, check_rollout

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


def seed_for(*key) -> int:
    """A 32-bit seed that depends on `key` only (its repr), the same in every process and run."""
    return zlib.crc32(repr(key).encode())


# Dataset columns that do not reach reward functions as keywords (TRL's, and the keywords the trainer passes).
RESERVED_REWARD_ARGS = ("prompt", "completion", "prompts", "completions", "completion_ids", "trainer_state",
                        "log_extra", "log_metric", "environments")


def completion_messages(tokenizer, completion_ids: list[list[int]], prompt_ids: list[list[int]],
                        conversational: bool) -> list:
    """Completions without tools as reward functions get them, as TRL 1.16's _generate makes them: the decoded text
    (special tokens dropped) for text prompts; for conversational ones one assistant message, parsed with the
    tokenizer's response_template when it ships one (reasoning_content apart, the EOS dropped), else the text."""
    if conversational and getattr(tokenizer, "response_template", None) is not None:
        chat = ToolChat(tokenizer, tokenizer.response_template)
        return [[chat.parse(ids, prompt, None)] for ids, prompt in zip(completion_ids, prompt_ids, strict=True)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


class Rounds:
    """The Trainer's sampling and scoring of a round (it reads the trainer's config, world, engine, agent,
    rollout_func, rewards, tokenizer, data and log)."""

    def _sample(self, data: Prompts, picked: list[int], n: int, params: SamplingParams,
                first_group: int = 0) -> Sampled | None:
        """This rank's slice of the prompt groups `picked` (indices into `data`), n completions each, sampled with
        each group's own random stream (first_group + its index in `picked`), so that the round is the same for any
        number of processes; None for a rank without a group. Through the engine, with the agent's tool loop when
        there are tools or environments, or through the user's rollout_func."""
        share = self.world.share(len(picked))
        with distributed.unsharded(self.policy):  # FSDP2's all-gathers: every rank joins, even one without a group
            if not share:  # more processes than prompts (a small held-out set)
                return None
            mine = [picked[i] for i in share]
            streams = [first_group + i for i in share]
            if self.rollout_func is not None:
                return self._call_rollout_func(data, mine, n)
            if self.agent is not None:
                # reset(**row) gets every column, None where the row has none (as rows of a `datasets` table)
                done = self.agent.generate(self.engine, [data.rows[i] for i in mine], [data.prompts[i] for i in mine],
                                           [data.token_ids[i] for i in mine], streams, n, params)
                columns = {} if done.environments is None else {"environments": done.environments}
                return Sampled(done.groups, done.prompt_ids, done.prompts, done.messages, columns, done.counts)
            groups = self.engine.generate([data.token_ids[i] for i in mine], n=n, params=params, group_ids=streams)
        return self._plain_sampled(data, mine, groups)

    def _plain_sampled(self, data: Prompts, mine: list[int], groups: list[list[Completion]]) -> Sampled:
        """Engine groups of the prompts `mine` as reward functions get them (text, or one assistant message)."""
        samples = [i for i in mine for _ in range(len(groups[0]))]
        prompt_ids = [data.token_ids[i] for i in samples]
        completions = completion_messages(self.tokenizer, [c.token_ids for group in groups for c in group], prompt_ids,
                                          data.conversational)
        return Sampled(groups, prompt_ids, [data.prompts[i] for i in samples], completions, {}, ToolCounts())

    def _round(self, picked: list[int], params: SamplingParams, first_group: int = 0) -> list[RankRound]:
        """The groups of train prompts `picked`, sampled (this rank's share) and scored, gathered to every rank in
        group order. A rank that fails while sampling or scoring ends every rank with its error (World.together),
        before any of them enters the gather."""
        mine = None
        with self.world.together("sampling and rewards"):
            sampled = self._sample(self.train_prompts, picked, self.config.num_generations, params, first_group)
            if sampled is not None:  # a process gets no group when a round has fewer groups than processes
                samples = [picked[i] for i in self.world.share(len(picked))
                           for _ in range(self.config.num_generations)]
                per_func, rewards = self._score(samples, sampled)
                mine = RankRound(sampled.groups, sampled.prompt_ids, sampled.prompts, sampled.tool_counts, per_func,
                                 rewards,
                                 self.engine.stats.num_preemptions if self.rollout_func is None else 0,
                                 self.rewards.logged_metrics, self.rewards.logged_columns)
        return [part for part in self.world.gather(mine) if part is not None]

    def _dynamic_round(self, params: SamplingParams) -> tuple[list[int], list[RankRound], dict]:
        """DAPO's dynamic sampling (rounds.dynamic_round). -> (the kept groups' prompts, the round as one RankRound,
        metrics)."""
        return dynamic_round(self, params)

    def _call_rollout_func(self, data: Prompts, mine: list[int], n: int) -> Sampled:
        """TRL's rollout_func(prompts, trainer) for the samples of prompts `mine` (n each, prompt-major); its
        output checked (tools.check_rollout). Its env_mask is the tool mask; a completion that does not end in a
        stop or pad token was cut ("length"), as TRL reads it; its other fields go to the reward functions."""
        samples = [i for i in mine for _ in range(n)]
        prompts = [copy.deepcopy(data.prompts[i]) for i in samples]
        try:
            output = self.rollout_func(prompts, self)
        except Exception as e:
            raise RewardError(f"rollout_func {self.config.rollout_func!r} raised {type(e).__name__}: {e}") from e
        output = check_rollout(output, len(samples), len(self.tokenizer), self.config.max_completion_length,
                               self.context_window)
        ids, logprobs = output["completion_ids"], output["logprobs"]
        if logprobs is None and self.config.importance_sampling_correction:
            raise RolloutError("rollout_func returned logprobs None, but importance_sampling_correction needs the "
                             "sampler's logprob of every completion token; return them, or turn the correction off")
        ends = {*self.stop_token_ids, self.tokenizer.pad_token_id}
        masks = output.get("env_mask") or [[1] * len(c) for c in ids]
        completions = [Completion(c, [math.nan] * len(c) if logprobs is None else logprobs[k],
                                  "stop" if c[-1] in ends else "length", masks[k]) for k, c in enumerate(ids)]
        columns = {key: value if isinstance(value, list) else [value] * len(samples) for key, value in output.items()
                   if key not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        return Sampled([completions[g * n : (g + 1) * n] for g in range(len(mine))], output["prompt_ids"], prompts,
                       completion_messages(self.tokenizer, ids, output["prompt_ids"], data.conversational), columns,
                       ToolCounts())

    def _sampling_params(self, seed: int, evaluation: bool = False) -> SamplingParams:
        """The sampler's options, generation_kwargs' overriding the config's (TRL's rule). Its temperature is the
        training samples' only: the loss still divides by `temperature` (as TRL's does), and evaluation samples at
        eval_temperature."""
        config = self.config
        options = dict(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
                       repetition_penalty=config.repetition_penalty)
        options |= config.generation_kwargs or {}
        if evaluation:
            options["temperature"] = config.eval_temperature
        options["min_p"] = options["min_p"] or 0.0  # TRL's None is off
        return SamplingParams(**options, max_new_tokens=config.max_completion_length,
                              stop_token_ids=self.stop_token_ids, seed=seed)

    def _score(self, samples: list[int], sampled: Sampled) -> tuple[torch.Tensor, torch.Tensor]:
        """The rewards of this rank's completions (`samples`: their train prompts' indices): (per function [n, F],
        weighted total [n]). Reward functions get TRL's arguments: the prompts (after an environment's reset),
        the completions (text, one assistant message, or with tools the assistant and tool messages), the dataset's
        columns, the completions' token ids, a TrainerState, and the environments (environments=) or a
        rollout_func's extra fields."""
        data = self.train_prompts
        completion_ids = [c.token_ids for group in sampled.groups for c in group]
        # Every column of the data, None in rows without it (as a `datasets` table holds rows of different keys).
        columns = {k: [data.rows[i][k] for i in samples] for k in data.rows[0]  # (prepare gave every row every key)
                   if k not in RESERVED_REWARD_ARGS and k != self.config.prompt_column}
        columns |= sampled.columns
        per_round = self.optimizer_steps_per_round  # TrainerState counts optimizer steps, as TRL's does
        state = None
        if self.rewards.user_functions:  # the built-in rewards read no trainer_state (and it imports peft)
            from transformers import TrainerState

            state = TrainerState(global_step=(self.step - 1) * per_round, max_steps=self.config.max_steps * per_round,
                                 epoch=self.order.epochs_done())
        return self.rewards(sampled.prompts, sampled.completions, completion_ids, columns, state)

    def _log_completions(self, completion_ids: list[list[int]], per_func: torch.Tensor, advantages: torch.Tensor,
                         parts: list[RankRound]) -> None:
        """completions.jsonl rows of this round (rank 0 writes): prompt, completion, each reward, the advantage, and
        the columns the reward functions logged with log_extra (null for a rank's samples that logged none)."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [prompt for part in parts for prompt in part.prompts]  # after an environment's reset
        columns = {column for part in parts for column in part.logged_columns}
        extra = {column: [] for column in columns}
        for part in parts:
            n = sum(len(group) for group in part.groups)
            for column in columns:
                extra[column].extend(part.logged_columns.get(column, [None] * n))
        names = self.rewards.metric_names
        self.log.log_completions(self.step, [
            {"prompt": prompts[k], "completion": texts[k],
             **{f"rewards/{name}": per_func[k, j].item() for j, name in enumerate(names)},
             "advantage": advantages[k].item(), **{column: values[k] for column, values in extra.items()}}
            for k in range(len(texts))])
