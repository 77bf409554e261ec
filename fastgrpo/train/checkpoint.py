"""Checkpoints: HF-format weights (safetensors) plus everything an exact resume needs, written atomically.

    output_dir/checkpoint-<step>/
        model.safetensors, config.json, ...   `from_pretrained` loads it (with LoRA: the adapter, for PeftModel)
        tokenizer files
        optimizer.pt, scheduler.pt, rng_state.pt   tensors and plain containers only: torch.load(weights_only=True)
        trainer_state.json                   step, data position, the evaluation before training

Several processes write a sharded checkpoint instead: torch.distributed.checkpoint (DCP) in dcp/, each rank its own
shards of the model (trainable parameters) and AdamW states, which load into any number of processes and either
parallelism (DCP reshards on load); config.json, tokenizer, scheduler, RNG and trainer state beside it, from rank 0;
and at the run's last step also the whole model exported by rank 0 with save_pretrained.

    output_dir/checkpoint-<step>/
        dcp/.metadata, dcp/__<rank>_0.distcp    sharded model and optimizer
        config.json, tokenizer files, scheduler.pt, rng_state.pt, trainer_state.json
        model.safetensors (or adapter_model.safetensors)   the last step's export

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
SHARDED = "dcp"  # the folder of a sharded checkpoint's model and optimizer
SHARDED_STATE_FILES = (f"{SHARDED}/.metadata", "scheduler.pt", "rng_state.pt", TRAINER_STATE)
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


def _partial(output_dir: Path, step: int) -> Path:
    partial = output_dir / f".checkpoint-{step}.partial"
    for stale in output_dir.glob(".checkpoint-*.partial"):  # left by killed writes
        shutil.rmtree(stale)
    partial.mkdir(parents=True)
    return partial


def _write_state(partial: Path, step: int, tokenizer, scheduler, state: dict, tensors: dict | None = None) -> None:
    """The tokenizer, schedule, RNG and trainer state; `tensors` {file name: state dict}, more weights an exact
    resume needs (a reference model that sync_ref_model moves), as safetensors files."""
    tokenizer.save_pretrained(partial)
    if tensors:
        from safetensors.torch import save_file

        for name, weights in tensors.items():
            save_file({k: v.contiguous() for k, v in weights.items()}, partial / name)
    torch.save(scheduler.state_dict(), partial / "scheduler.pt")
    torch.save(rng_state(), partial / "rng_state.pt")
    (partial / TRAINER_STATE).write_text(json.dumps({"step": step, **state}, indent=2))


def save(output_dir: Path, step: int, model, tokenizer, optimizer, scheduler, state: dict,
         total_limit: int | None, tensors: dict | None = None) -> Path:
    partial = _partial(output_dir, step)
    model.save_pretrained(partial, safe_serialization=True)
    torch.save(optimizer.state_dict(), partial / "optimizer.pt")
    _write_state(partial, step, tokenizer, scheduler, state, tensors)
    return _publish(output_dir, step, partial, total_limit)


def _publish(output_dir: Path, step: int, partial: Path, total_limit: int | None) -> Path:
    """fsyncs the partial folder's files and renames it into place; then drops checkpoints past total_limit."""
    final = output_dir / f"checkpoint-{step}"
    for path in [*partial.rglob("*"), partial]:
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


def _dcp_options(model, full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())  # LoRA: the base comes from the model's files
    return StateDictOptions(full_state_dict=full, cpu_offload=full, ignore_frozen_params=frozen, strict=not frozen)


def _without_tied_copies(model, state: dict) -> dict:
    """A gathered full state dict without the second names of tied parameters (a tied lm_head.weight): gathered,
    the two names hold two tensors, which save_pretrained would write twice, where one process writes one."""
    first = {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    again = {name for name, p in model.named_parameters(remove_duplicate=False) if first[id(p)] != name}
    return {name: tensor for name, tensor in state.items() if name not in again}


def save_sharded(output_dir: Path, step: int, world, model, tokenizer, optimizer, scheduler, state: dict,
                 total_limit: int | None, export: bool, tensors: dict | None = None) -> Path:
    """A collective: every rank writes its shards; rank 0 the rest, then renames the folder into place once all
    ranks have written. With `export`, rank 0 also writes the whole model with save_pretrained (gathered from the
    shards, in CPU memory)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    from fastgrpo.models import find_hf_model

    partial = world.broadcast(_partial(output_dir, step) if world.is_main else None)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_dcp_options(model))
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=partial / SHARDED)
    full = get_model_state_dict(model, options=_dcp_options(model, full=True)) if export else None
    final = None
    if world.is_main:
        if export:
            model.save_pretrained(partial, state_dict=_without_tied_copies(model, full), safe_serialization=True)
        find_hf_model(model).config.save_pretrained(partial)
        _write_state(partial, step, tokenizer, scheduler, state, tensors)
    world.barrier()  # every rank's shards are on disk
    if world.is_main:
        final = _publish(output_dir, step, partial, total_limit)
    return world.broadcast(final)


def is_sharded(checkpoint: Path) -> bool:
    return (checkpoint / SHARDED).is_dir()


def load_sharded(checkpoint: Path, model, optimizer) -> None:
    """A sharded checkpoint's model and optimizer into `model` (plain, DDP's or FSDP2-sharded; any number of
    processes, one included) and `optimizer`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _dcp_options(model)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    try:
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint / SHARDED,
                 no_dist=not (torch.distributed.is_available() and torch.distributed.is_initialized()))
    except Exception as e:
        raise CheckpointError(f"resume: {checkpoint / SHARDED} cannot be loaded ({_reason(e)}); resume with the "
                              "options the run was written with, or start afresh with --overwrite-output-dir") from e
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options)


def full_state(model) -> dict:
    """A module's whole state dict on the CPU: gathered from FSDP2's shards (a collective) or as it is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _without_tied_copies(model, full)  # (safetensors refuses two names for one tensor)


def load_full_state(path: Path, model) -> None:
    """A safetensors state dict (full_state's) into `model`, plain or FSDP2-sharded."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    try:
        weights = load_file(path)
    except Exception as e:
        raise CheckpointError(f"resume: {path} cannot be read ({_reason(e)})") from e
    first = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):  # a tied parameter's second name
        first.setdefault(id(parameter), name)
        if name not in weights and first[id(parameter)] in weights:
            weights[name] = weights[first[id(parameter)]]
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer(checkpoint: Path, model, optimizer) -> None:
    """One process's optimizer.pt (its states by parameter position) into an optimizer over FSDP2-sharded
    parameters: the states keyed by parameter name, then sharded by set_optimizer_state_dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    saved = _load(checkpoint / "optimizer.pt")
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    by_name = lambda ids: [names[i] for i in ids]
    state = {"state": {names[i]: value for i, value in saved["state"].items()},
             "param_groups": [{**group, "params": by_name(group["params"])} for group in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


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
    sharded = is_sharded(checkpoint)
    for name in SHARDED_STATE_FILES if sharded else STATE_FILES:
        if not (checkpoint / name).is_file():
            raise CheckpointError(f"{checkpoint / name} is missing")
    if sharded and not any((checkpoint / SHARDED).glob("*.distcp")):
        raise CheckpointError(f"{checkpoint / SHARDED} holds no shards (*.distcp)")
    if not sharded and not any(checkpoint.glob("*.safetensors")):
        raise CheckpointError(f"{checkpoint} holds no model weights (model.safetensors)")
    if not any((checkpoint / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise CheckpointError(f"{checkpoint / 'config.json'} is missing")
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
    """The schedule, RNG and trainer state (and, given an optimizer, optimizer.pt) of a checkpoint."""
    loads = {"scheduler.pt": scheduler.load_state_dict, "rng_state.pt": set_rng_state}
    if optimizer is not None:
        loads["optimizer.pt"] = optimizer.load_state_dict
    for name, load in loads.items():
        saved = _load(checkpoint / name)
        try:
            load(saved)
        except Exception as e:
            raise _not_loadable(checkpoint / name, e) from e
    return json.loads((checkpoint / TRAINER_STATE).read_text())


def _load(path: Path):
    try:
        return torch.load(path, weights_only=True)  # tensors and plain containers: no pickled code
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"resume: {path} holds pickled objects, which fastgrpo never loads ({_reason(e)}); it "
                              "is not a file fastgrpo wrote") from e
    except Exception as e:
        raise _not_loadable(path, e) from e


def _not_loadable(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(f"resume: {path} cannot be loaded ({_reason(error)}); resume with the options the run was "
                           "written with, or start afresh with --overwrite-output-dir")


def _reason(error: Exception) -> str:
    """The line of a loading error that says what is wrong (torch's weights_only refusal is a page of advice)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    named = [line for line in lines if "Unsupported global" in line]
    return (named or lines)[0].split(". Please")[0][:300]
