"""Sequences and prompt groups: a prompt is prefilled once (the group's `prompt` sequence), and its n completions
(the group's children) share its pages."""

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Sequence:
    """A prompt, or one completion of it.

    A completion's sampled tokens live in the engine's output buffers (row `seq_id`), not here: while it decodes,
    its state is a row of the decode batch (`row`), and only when it leaves the batch (preempted, or resumed after
    its turn ended) are its tokens copied back into `token_ids` for the recompute or the continuation. It holds
    pages (`block_table`) from when it starts until it finishes or is preempted.
    `num_cached` and `num_generated` are current whenever the sequence is not in the decode batch (the batch keeps
    them while it is).

    Multi-turn: a completion whose turn ended is `parked` (out of the batch, its pages kept) until the caller appends
    tokens to it (`appended` records where) or finishes it; its completion is everything after the prompt, sampled
    and appended tokens alike.
    """

    token_ids: list[int]  # the prompt, then (on the host path only) the completion so far
    prompt_len: int
    seq_id: int = -1  # row of the output buffers; -1 for a group's prompt
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    num_computed: int = 0  # the most tokens it ever had cached: positions below it are recomputes
    num_generated: int = 0  # completion tokens so far (sampled and appended)
    row: int | None = None  # place in the decode batch, while decoding
    finish_reason: str | None = None
    parked: bool = False  # its turn ended: it waits for the caller's tokens
    appended: list[tuple[int, int]] = field(default_factory=list)  # (column, count) of each continuation's tokens
    window_from: list[int] = field(default_factory=list)  # per window pool, its first live page (pages.PagePool)
    state_slot: int = -1  # its recurrent state's slot while it holds pages (state.py; -1: none)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_generated

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False, slots=True)
class Group:
    """One prompt and its n completions (output rows index * n .. index * n + n - 1).

    Until `forked`, only `prompt` computes. When its last token is cached, the group forks: the n first tokens are
    sampled from its logits and the children are created. The prompt keeps its pages; each child, when it starts,
    shares their full pages and copies the partial last one (the child of a group of one takes them over).
    After the prompt's pages are freed (a preemption), the group starts over from the prompt, and its unfinished
    children start again from its new pages.
    """

    prompt: Sequence
    n: int
    index: int = 0  # the prompt's place in the call
    children: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the prompt is cached: its pages are the prompt's (or, at n = 1, its child's)
    prompt_tokens_computed: int = 0  # prompt positions that went through the model
    num_finished: int = 0
    # Sequences with host work, in seq_id order (the prompt first): the prompt while it is prefilled, children that
    # start (their first token, a recompute, a continuation after a turn) or that recompute or continue.
    pending: list[Sequence] = field(default_factory=list)
    admitted: bool = False  # it has run (admission budgets count a group once, preempted or not)

    def __post_init__(self):
        if not self.pending and not self.children:
            self.pending = [self.prompt]

    @property
    def num_parked(self) -> int:
        return sum(seq.parked for seq in self.children)

    @property
    def width(self) -> int:
        """Its unfinished completions."""
        return self.n - self.num_finished

    @property
    def done(self) -> bool:
        return self.num_finished == self.n
