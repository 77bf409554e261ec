"""Helpers of the command-line tests: a check that a command leaves every file outside its run as it was."""

from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import constants as hub_constants


def snapshot(*roots: Path) -> dict:
    """Every file and folder under `roots` with its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns)
            for root in roots if root.exists() for p in [root, *root.rglob("*")]}


@contextmanager
def untouched(*roots: Path):
    """Asserts that nothing under `roots`, nor in the Hugging Face caches, was created, changed or deleted."""
    roots = (*roots, Path(hub_constants.HF_HOME))
    before = snapshot(*roots)
    yield
    after = snapshot(*roots)
    assert after == before, sorted(str(p) for p in before.keys() ^ after.keys()) or "files changed"
