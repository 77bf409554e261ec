"""The experts each position of a generate call went through (mixture-of-experts models, `generate(...,
record_routes=True)`): what the trainer replays (fastgrpo/routing.py).

Per MoE layer, one row of k expert ids per prompt position of each group (its children share the prompt's) and per
completion column of each output row, on the device: layers x k bytes a position (48 x 8 = 384 B for Qwen3-30B-A3B,
about 0.8% of its 48 KiB of bf16 KV a token). Every forward writes its tokens' rows (RouteStep.dest); a position
computed again after a preemption is routed through the experts it was first routed through, so the keys and values
every later token read and the routes handed to the trainer are one set. A completion's last token, which nothing
reads, is never computed: its rows stay UNROUTED.
"""

from itertools import accumulate

import torch

from fastgrpo.routing import RouteStep, Routing
from fastgrpo.sampling.batch import DecodeBatch
from fastgrpo.sampling.scheduler import Step
from fastgrpo.sampling.sequence import Group, Sequence


class RouteRecords:
    def __init__(self, routing: Routing, groups: list[Group], n: int, max_new_tokens: int, device: torch.device):
        lengths = [group.prompt.prompt_len for group in groups]
        self.prompt_start = list(accumulate(lengths, initial=0))  # [groups + 1]
        self.base, self.width = self.prompt_start[-1], max_new_tokens
        rows = self.base + len(groups) * n * max_new_tokens
        self.records = torch.full((routing.num_layers, rows, routing.top_k), routing.sentinel, dtype=routing.dtype,
                                  device=device)  # [layers, rows, k]
        self.device = device

    def _row(self, group: Group, seq: Sequence, position: int) -> int:
        if position < seq.prompt_len:
            return self.prompt_start[group.index] + position
        return self.base + seq.seq_id * self.width + position - seq.prompt_len

    def step(self, step: Step, batch: DecodeBatch) -> RouteStep:
        """Where a step's tokens go, in the forward's order: the decode rows (each its last sampled token, column
        generated - 1 of its output row), then each host sequence's new positions."""
        parts, forced = [], False
        if step.num_rows:
            size = step.num_rows
            parts.append(self.base + batch.seq_ids[:size] * self.width + batch.generated[:size] - 1)
        if step.seqs:
            host = []
            for group, seq, chunk in zip(step.groups, step.seqs, step.chunks, strict=True):
                host += [self._row(group, seq, p) for p in range(seq.num_cached, seq.num_cached + chunk)]
                forced |= seq.num_cached < seq.num_computed
            parts.append(torch.tensor(host, dtype=torch.long).to(self.device, non_blocking=True))
        return RouteStep(self.records, torch.cat(parts) if len(parts) > 1 else parts[0], forced)

    def of(self, group: Group) -> list[torch.Tensor]:
        """Each child's routes [prompt + completion positions, layers, k] on the host (one read for the group)."""
        prompt = torch.arange(self.prompt_start[group.index], self.prompt_start[group.index + 1])
        rows = [torch.cat([prompt, self.base + seq.seq_id * self.width + torch.arange(seq.num_generated)])
                for seq in group.children]
        routes = self.records[:, torch.cat(rows).to(self.device)].transpose(0, 1).cpu()  # [sum L, layers, k]
        return list(routes.split([len(r) for r in rows]))
