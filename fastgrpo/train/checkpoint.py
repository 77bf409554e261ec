"""Checkpoints: HF-format weights (safetensors) plus everything an exact resume needs, written atomically.

    output_dir/checkpoint-<step>/
        model.safetensors, config.json, ...   `from_pretrained` loads it (with LoRA: the adapter, for PeftModel)
        tokenizer files
        optimizer.pt, scheduler.pt, rng_state.pt   tensors and plain containers only: torch.load(weights_only=True)
        trainer_state.json                   step, data position, the evaluation before training

A checkpoint is written to a hidden temporary folder and renamed into place once complete (a rename is atomic on
POSIX), so a write that is killed midway leaves the previous checkpoints as they were.
"""

import json
import os
import re
import shutil
from pathlib import Path

import torch

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(output_dir: Path, step: int, model, tokenizer, optimizer, scheduler, state: dict,
         total_limit: int | None) -> Path:
    final = output_dir / f"checkpoint-{step}"
    partial = output_dir / f".checkpoint-{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a killed write
    partial.mkdir(parents=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    torch.save(optimizer.state_dict(), partial / "optimizer.pt")
    torch.save(scheduler.state_dict(), partial / "scheduler.pt")
    torch.save(rng_state(), partial / "rng_state.pt")
    (partial / TRAINER_STATE).write_text(json.dumps({"step": step, **state}, indent=2))
    for path in [*partial.iterdir(), partial]:
        _fsync(path)
    if final.exists():
        shutil.rmtree(final)  # the same step saved again (only by a resumed run that had not moved on)
    os.replace(partial, final)
    _fsync(output_dir)  # the rename itself
    if total_limit is not None:
        for old in checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old)
    return final


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).iterdir()
             if (m := _CHECKPOINT.fullmatch(p.name)) and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def latest(output_dir: Path) -> Path | None:
    found = checkpoints(output_dir) if Path(output_dir).is_dir() else []
    return found[-1] if found else None


def load_state(checkpoint: Path, optimizer, scheduler) -> dict:
    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=True))
    set_rng_state(torch.load(checkpoint / "rng_state.pt", weights_only=True))
    return json.loads((checkpoint / TRAINER_STATE).read_text())
