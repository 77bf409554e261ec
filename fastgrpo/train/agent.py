"""Agent rollouts of `fastgrpo train`: tools and environments over several turns on the paged engine, with TRL 1.16's
tool-loop semantics and without its re-prefill.

A round with tools (or an environment_factory):
  1. each sample gets its environment instance (drawn from a pool, reset with its row: a returned string is appended
     to the prompt's last message) and its prompt is rendered with its tools through the chat template;
  2. Engine.generate(..., turn_end=...) samples; a turn ends on a stop token and parks the sequence, pages kept. The
     callback parses every parked turn (ToolChat.parse), runs the calls of all of them together (ToolRunner: async
     tools concurrently, each call with its timeout) and answers each with its tool turn's tokens (ToolChat.suffix_ids,
     TRL's suffix ids), which the engine prefills as a continuation of the sequence; decoding resumes. A turn without
     calls, one past max_tool_calling_iterations, or one whose results would take the completion past
     max_completion_length (TRL rolls them back) ends the rollout;
  3. the turn that ended by length is parsed too. A sample's completion is its messages (assistant turns and tool
     results, what reward functions get), its tokens everything after the prompt, and its tool_mask 0 on the tool
     turns' tokens (they stay out of the loss).

Where TRL parses a turn that ran out of room with a complete call in it, it runs the call and then drops the result
(no room): so does this, so environments see the same calls and the failure counts agree.
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.sampling.block_pool import least_pages
from fastgrpo.sampling.turns import Turn
from fastgrpo.train.config import TrainConfig
from fastgrpo.train.data import prompt_token_ids
from fastgrpo.train.tools import (
    Environments,
    RolloutError,
    ToolChat,
    ToolCounts,
    ToolRunner,
    load_tools,
    tool_calls,
    toolbox,
)


@dataclass(slots=True)
class Conversation:
    """One sample's rollout as it goes."""

    prompt_ids: list[int]
    tools: list[Callable]  # the functions its prompt shows (parse types the calls' arguments from them)
    box: dict[str, Callable]  # what its calls are looked up in
    messages: list[dict] = field(default_factory=list)  # the completion: assistant turns and tool results
    token_ids: list[int] = field(default_factory=list)  # the completion's tokens handed over so far
    iterations: int = 0  # tool-calling turns whose results were appended


@dataclass(slots=True)
class AgentRound:
    """What one generate call of an agent gave, per sample (groups of n, prompt-major)."""

    groups: list  # [groups][n] Completions
    prompts: list  # per sample: its prompt after reset (what reward functions get as `prompts`)
    prompt_ids: list[list[int]]  # per sample
    messages: list[list[dict]]  # per sample: its completion as messages
    environments: list | None  # per sample: its environment instance (None without environment_factory)
    counts: ToolCounts


class Agent:
    """The tools, environments and chat template of a run, and the rounds it samples."""

    def __init__(self, config: TrainConfig, tokenizer, context_window: int | None = None):
        self.config, self.tokenizer, self.context_window = config, tokenizer, context_window
        self.tools = load_tools(config.tools)
        self.environments = None
        if config.environment_factory is not None:
            self.environments = Environments(config.environment_factory, self.tools)
        self.chat = ToolChat.for_tokenizer(tokenizer, None, config.chat_template_kwargs, config.chat_template_path)
        self._runner = None
        limit = config.max_tool_calling_iterations
        self.max_iterations = math.inf if limit is None else limit

    @property
    def reward_functions(self) -> list[Callable]:
        """The environments' get_reward, one reward function per class (TRL's extra reward sources)."""
        return [] if self.environments is None else self.environments.reward_functions

    def tools_for(self, row: dict) -> list[Callable]:
        """The tools the prompt of `row` shows the model: the standalone ones, and its environment's methods."""
        if self.environments is None:
            return self.tools
        (name,) = self.environments.names([row])
        return self.environments.tools[name]

    @property
    def runner(self) -> ToolRunner:
        """The tool runner (its event loop thread), started on first use and again after close()."""
        if self._runner is None:
            self._runner = ToolRunner(self.config.tool_timeout)
        return self._runner

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def generate(self, engine: Engine, rows: list[dict], prompts: list, prompt_ids: list[list[int]],
                 group_ids: list[int], n: int, params: SamplingParams) -> AgentRound:
        """n rollouts of each prompt (rows, prompts and prompt_ids per prompt; group_ids its place in the round, for
        the random streams as Engine.generate). Samples whose environment rewrote the prompt are generated one by
        one (the same random stream as in their group: group_id * n + j), otherwise each group shares its prompt."""
        rows = [row for row in rows for _ in range(n)]
        prompts = [prompt for prompt in prompts for _ in range(n)]
        prompt_ids = [ids for ids in prompt_ids for _ in range(n)]
        tools = [self.tools_for(row) for row in rows]
        instances = None
        if self.environments is not None:
            instances = self.environments.draw(rows)
            prompts = self.environments.reset(instances, rows, prompts)
            prompt_ids = [self._reset_prompt_ids(p, t, n, type(e).__name__, row)
                          for p, t, e, row in zip(prompts, tools, instances, rows, strict=True)]
        conversations = [Conversation(ids, t, toolbox(self.tools, None if instances is None else instances[s]))
                         for s, (ids, t) in enumerate(zip(prompt_ids, tools, strict=True))]
        counts = ToolCounts()

        def turn_end(turns: list[Turn]) -> list[list[int] | None]:
            nonlocal counts
            # completion j of prompt i: sample i * n + j of a shared call; sample i of a call per sample
            sample = (lambda t: t.prompt_index * n + t.completion_index) if shared else (lambda t: t.prompt_index)
            answers, counted = self._answer(turns, [conversations[sample(t)] for t in turns])
            counts += counted
            return answers

        shared = all(prompt_ids[g * n : (g + 1) * n].count(prompt_ids[g * n]) == n for g in range(len(group_ids)))
        if shared:
            groups = engine.generate(prompt_ids[::n], n=n, params=params, group_ids=group_ids, turn_end=turn_end)
        else:
            streams = [g * n + j for g in group_ids for j in range(n)]
            ones = engine.generate(prompt_ids, n=1, params=params, group_ids=streams, turn_end=turn_end)
            groups = [[one[0] for one in ones[g * n : (g + 1) * n]] for g in range(len(group_ids))]
        completions = [c for group in groups for c in group]
        counts += self._last_turns(completions, conversations)
        return AgentRound(groups, prompts, prompt_ids, [c.messages for c in conversations], instances, counts)

    def _reset_prompt_ids(self, prompt, tools: list[Callable], n: int, environment: str, row: dict) -> list[int]:
        """A prompt as its environment's reset() left it, tokenized with its tools, checked as data.prepare checks
        the data's prompts: never cut (max_prompt_length would cut the tools' descriptions away), within the context
        window with max_completion_length, within kv_cache_blocks' pool."""
        config = self.config
        ids = prompt_token_ids(self.tokenizer, prompt, dataclasses.replace(config, max_prompt_length=None), tools)
        where = (f"environment_factory: {environment}.reset(**row) made the prompt of the row {row!r:.100} "
                 f"{len(ids)} tokens long")
        if config.max_prompt_length is not None and len(ids) > config.max_prompt_length:
            raise RolloutError(f"{where} with its tools, more than max_prompt_length={config.max_prompt_length}; "
                               "prompts with tools are not cut (the tool schemas come first): raise max_prompt_length "
                               "or set it to None")
        window, m = self.context_window, config.max_completion_length
        if window is not None and len(ids) + m > window:
            raise RolloutError(f"{where}, which with max_completion_length={m} exceeds the model's context window of "
                               f"{window} positions; lower max_completion_length or return a shorter text from "
                               "reset()")
        blocks = config.kv_cache_blocks
        needed = least_pages(len(ids), n, m, config.block_size)
        if blocks is not None and needed > blocks:
            raise RolloutError(f"{where}: sampling it needs {needed} pages of {config.block_size} tokens with "
                               f"max_completion_length={m}, more than kv_cache_blocks {blocks}; raise kv_cache_blocks "
                               "or leave it unset")
        return ids

    def _answer(self, turns: list[Turn], conversations: list[Conversation]
                ) -> tuple[list[list[int] | None], ToolCounts]:
        """turn_end's work: per parked turn (conversations[k] is turns[k]'s), the tool turn's tokens to append, or
        None to end the rollout; and the calls run."""
        answers = [None] * len(turns)
        waiting = []  # (turn index, conversation) whose calls run now
        for k, (turn, c) in enumerate(zip(turns, conversations, strict=True)):
            message = self.chat.parse(turn.token_ids, c.prompt_ids + c.token_ids, c.tools)
            c.token_ids += turn.token_ids
            c.messages.append(message)
            if tool_calls(message) and c.iterations < self.max_iterations:
                waiting.append((k, c))
        if not waiting:
            return answers, ToolCounts()
        results, counts = self.runner.run([tool_calls(c.messages[-1]) for _, c in waiting], [c.box for _, c in waiting])
        for (k, c), tool_messages in zip(waiting, results, strict=True):
            suffix = self._suffix_ids(tool_messages)
            total = len(c.prompt_ids) + len(c.token_ids) + len(suffix)
            if len(suffix) > turns[k].room or (self.context_window is not None and total >= self.context_window):
                continue  # no room for the results: TRL rolls them back and the rollout ends here
            c.messages += tool_messages
            c.token_ids += suffix
            c.iterations += 1
            answers[k] = suffix
        return answers, counts

    def _suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tool turn's tokens; a result the chat template cannot render is one line naming the tool."""
        from jinja2 import TemplateError

        try:
            return self.chat.suffix_ids(tool_messages)
        except (TemplateError, TypeError, ValueError) as e:
            names = sorted({m["name"] for m in tool_messages})
            raise RolloutError(f"tools: the chat template cannot render the results of {names} "
                               f"({[m['content'] for m in tool_messages]!r:.200}): {type(e).__name__}: {e}") from e

    def _last_turns(self, completions: list, conversations: list[Conversation]) -> ToolCounts:
        """The turns that ended by length (never handed to turn_end) parsed into their rollouts; the calls they make
        run and their results are dropped, as TRL's loop does (it finds no room for them)."""
        pending = []
        for completion, c in zip(completions, conversations, strict=True):
            rest = completion.token_ids[len(c.token_ids):]
            if not rest:
                continue
            message = self.chat.parse(rest, c.prompt_ids + c.token_ids, c.tools)
            c.token_ids += rest
            c.messages.append(message)
            if tool_calls(message) and c.iterations < self.max_iterations:
                pending.append(c)
        if not pending:
            return ToolCounts()
        _, counts = self.runner.run([tool_calls(c.messages[-1]) for c in pending], [c.box for c in pending])
        return counts
