"""Checkpoints: HF-format weights (safetensors) plus everything an exact resume needs, written atomically.

    output_dir/checkpoint-<step>/
        model.safetensors, config.json, ...   `from_pretrained` loads it (with LoRA: the adapter, for PeftModel)
        tokenizer files
        optimizer.pt, scheduler.pt, rng_state.pt   tensors and plain containers only: torch.load(weights_only=True)
        trainer_state.json                   step, data position, the evaluation before training

A checkpoint is written to a hidden temporary folder and renamed into place once complete (a rename is atomic on
POSIX), so a write that is killed midway leaves the previous checkpoints as they were. --resume starts from the
newest checkpoint whose files are whole (`verify`); a damaged newer one is skipped with a warning naming the file.
"""

import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import torch

TRAINER_STATE = "trainer_state.json"
STATE_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pt", TRAINER_STATE)
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or not what fastgrpo wrote; the message names it."""


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
    for stale in output_dir.glob(".checkpoint-*.partial"):  # left by killed writes
        shutil.rmtree(stale)
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
            if old != final:  # a newer, damaged checkpoint that a resume skipped never pushes out the one just saved
                shutil.rmtree(old)
    return final


def checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoint-<step> folders, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).iterdir()
             if (m := _CHECKPOINT.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest(output_dir: Path) -> Path | None:
    found = checkpoints(output_dir) if Path(output_dir).is_dir() else []
    return found[-1] if found else None


def resume_point(output_dir: Path) -> tuple[Path, int]:
    """The newest checkpoint that `verify` passes, and its step. A damaged newer one is skipped with a warning that
    names its bad file; when none is whole, the error names the newest one's."""
    found = checkpoints(output_dir) if Path(output_dir).is_dir() else []
    if not found:
        raise FileNotFoundError(f"resume: {output_dir} holds no checkpoint to resume from")
    skipped = []
    for path in reversed(found):
        try:
            step = verify(path)
        except CheckpointError as e:
            skipped.append(e)
            continue
        for error in skipped:
            warnings.warn(f"resume: {error}; resuming from {path} (step {step}) instead", stacklevel=2)
        return path, step
    raise CheckpointError(f"resume: {skipped[0]}, and {output_dir} holds no older whole checkpoint; restore the "
                          "file, or start afresh with --overwrite-output-dir instead of --resume")


def verify(checkpoint: Path) -> int:
    """The checkpoint's step, once its files are found whole: the state files and some safetensors weights are
    there, every .json parses, every .safetensors is as long as its header says, every .pt is a complete zip archive
    (torch.save's format; a cut write loses the archive's directory at its end). Reads headers, not the weights."""
    for name in STATE_FILES:
        if not (checkpoint / name).is_file():
            raise CheckpointError(f"{checkpoint / name} is missing")
    if not any(checkpoint.glob("*.safetensors")):
        raise CheckpointError(f"{checkpoint} holds no model weights (model.safetensors)")
    for path in sorted(checkpoint.iterdir()):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                _check_safetensors(path)
            elif path.suffix == ".pt":
                zipfile.ZipFile(path).close()
        except Exception as e:  # a damaged header fails in many ways: JSON, zip, or a field of the wrong type
            raise CheckpointError(f"{path} is truncated or corrupt ({e})") from e
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    step = int(_CHECKPOINT.fullmatch(checkpoint.name).group(1))
    keys = {"step", "num_tokens", "seconds", "initial_accuracy", "data"}
    if not isinstance(state, dict) or not keys <= set(state) or state["step"] != step:
        raise CheckpointError(f"{checkpoint / TRAINER_STATE} is not the state of step {step} that fastgrpo wrote")
    return step


def _check_safetensors(path: Path) -> None:
    """A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's byte range,
    then the bytes."""
    size = path.stat().st_size
    with path.open("rb") as f:
        header_length = int.from_bytes(f.read(8), "little")
        if size < 8 or header_length > size - 8:
            raise ValueError(f"{size} bytes, too short for its header")
        header = json.loads(f.read(header_length))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size != 8 + header_length + end:
        raise ValueError(f"{size} bytes where its header needs {8 + header_length + end}")


def load_state(checkpoint: Path, optimizer, scheduler) -> dict:
    loads = {"optimizer.pt": optimizer.load_state_dict, "scheduler.pt": scheduler.load_state_dict,
             "rng_state.pt": set_rng_state}
    for name, load in loads.items():
        try:
            load(torch.load(checkpoint / name, weights_only=True))  # tensors and plain containers: no pickled code
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"resume: {checkpoint / name} holds pickled objects, which fastgrpo never loads "
                                  f"({_reason(e)}); it is not a file fastgrpo wrote") from e
        except Exception as e:
            raise CheckpointError(f"resume: {checkpoint / name} cannot be loaded ({_reason(e)}); resume with "
                                  "the options the run was written with, or start afresh with --overwrite-output-dir"
                                  ) from e
    return json.loads((checkpoint / TRAINER_STATE).read_text())


def _reason(error: Exception) -> str:
    """The line of a loading error that says what is wrong (torch's weights_only refusal is a page of advice)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    named = [line for line in lines if "Unsupported global" in line]
    return (named or lines)[0].split(". Please")[0][:300]
