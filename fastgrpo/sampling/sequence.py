"""Sequences and prompt groups: a prompt is prefilled once (the group's `prompt` sequence), then forked n times."""

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Sequence:
    token_ids: list[int]  # prompt + completion
    prompt_len: int
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_uncached(self) -> int:
        return len(self.token_ids) - self.num_cached

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False, slots=True)
class Group:
    """One prompt and its n completions.

    Until `forked`, only `prompt` computes; when its last prompt token is cached the group forks: `children` share
    its full pages. After a preemption the group starts over from the prompt, and the fork hands the prompt pages to
    the unfinished children, which then recompute their own tokens.
    """

    prompt: Sequence
    n: int
    children: list[Sequence] = field(default_factory=list)
    forked: bool = False
    fork_spare: list[int] = field(default_factory=list)  # pages reserved for copies of the partial prompt page
    prompt_tokens_computed: int = 0  # prompt positions that went through the model, all sequences together

    def active(self) -> list[Sequence]:
        """Sequences with tokens to compute."""
        return self.active_children() if self.forked else [self.prompt]

    def active_children(self) -> list[Sequence]:
        return [seq for seq in self.children if not seq.finished]

    @property
    def width(self) -> int:
        """Sequences this group decodes at once."""
        return len(self.active_children()) if self.children else self.n

    @property
    def done(self) -> bool:
        return bool(self.children) and all(seq.finished for seq in self.children)
