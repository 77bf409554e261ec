"""A stand-in for the engine in agent tests: `ScriptedEngine.generate` follows Engine.generate's multi-turn protocol
(turns.py: a turn ends on a stop token and goes to turn_end; an answer is appended with tool_mask 0; None finishes
"stop"; max_new_tokens counts everything after the prompt, an answer that does not fit is dropped and finishes
"length") with each turn's tokens taken from a script instead of a model, so that tests choose what the policy
"writes" (tool calls that succeed, fail, time out, overflow) and compare the rest with TRL."""

from fastgrpo.sampling import Completion, GenerateStats
from fastgrpo.sampling.turns import Turn


class ScriptedEngine:
    """script(prompt_ids, turn, completion_so_far) -> the turn's token ids (a stop token last to end the turn)."""

    def __init__(self, script, stop_token_ids):
        self.script, self.stop_token_ids = script, set(stop_token_ids)
        self.stats = GenerateStats()
        self.calls = []  # (prompt_token_ids, n) per generate call

    def generate(self, prompt_token_ids, n=1, params=None, group_ids=None, *, first_columns=None, turn_end=None,
                 turn_batch=1):
        self.calls.append((prompt_token_ids, n))
        limit = params.max_new_tokens
        groups = []
        for i, prompt in enumerate(prompt_token_ids):
            group = []
            for j in range(n):
                ids, mask, turn, finish = [], [], 0, None
                while finish is None:
                    tokens = list(self.script(prompt, turn, ids))[: limit - len(ids)]
                    ids += tokens
                    mask += [1] * len(tokens)
                    if not tokens or tokens[-1] not in self.stop_token_ids:
                        finish = "length"
                    elif turn_end is None:
                        finish = "stop" if len(ids) <= limit else "length"
                    else:
                        (answer,) = turn_end([Turn(i, j, turn, tokens, limit - len(ids))])
                        if answer is None:
                            finish = "stop"
                        elif len(ids) + len(answer) > limit:
                            finish = "length"
                        else:
                            ids += answer
                            mask += [0] * len(answer)
                            finish = "length" if len(ids) == limit else None
                    turn += 1
                group.append(Completion(ids, [0.0] * len(ids), finish, mask))
            groups.append(group)
        return groups
