"""The run's output folder: checked before anything loads, locked while a run writes into it, and replaced (with
overwrite_output_dir) only when it is recognisably a fastgrpo run.

    output_dir/
        .fastgrpo.lock      flock'ed by the run writing here, which writes its pid into it. The kernel drops an
                            flock when its process dies, even by SIGKILL, so a killed run never blocks its --resume.
        config.yaml  config_history.yaml  metrics.jsonl  memory_plan.txt  completions.jsonl  training_curves.png
        tensorboard/  wandb/  checkpoint-<step>/  ...

Checks that may refuse the folder only read it: a refused run leaves no file behind, not even the lock file.
"""

import fcntl
import os
import re
import shutil
from pathlib import Path

LOCK_FILE = ".fastgrpo.lock"
# Everything fastgrpo writes into an output folder; overwrite_output_dir deletes nothing else.
RUN_FILES = {"config.yaml", "config_history.yaml", "metrics.jsonl", "metrics.partial", "training_curves.png",
             "memory_plan.txt", "completions.jsonl", "completions.partial"}
RUN_FOLDERS = re.compile(r"checkpoint-\d+|\.checkpoint-\d+\.partial|tensorboard|wandb")


def check_writable(path: Path) -> None:
    """Raises when `path` is a file, or when it (or, not existing yet, its nearest existing parent) is read-only."""
    existing = next(p for p in [path, *path.absolute().parents] if p.exists())
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        raise NotADirectoryError(f"output_dir {path} is a file, not a folder{where}; choose another --output-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"output_dir {path} is not writable ({existing} is read-only for this user); fix its "
                              "permissions or choose another --output-dir")


def contents(path: Path) -> list[Path]:
    """What the folder holds besides the lock file (nothing when it does not exist)."""
    return sorted(p for p in path.iterdir() if p.name != LOCK_FILE) if path.is_dir() else []


def check_free(path: Path) -> None:
    """Raises when another run holds the folder's lock (probed read-only: a free folder is left as it was)."""
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return  # no lock file: no run has written here since fastgrpo locks its folders
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(path) from None
    finally:
        os.close(fd)  # and with it the shared lock of the probe


def _in_use(path: Path) -> FileExistsError:
    pid = (path / LOCK_FILE).read_text().strip() or "unknown"
    return FileExistsError(f"output_dir {path} is in use by another fastgrpo run (pid {pid}); wait for it to end, "
                           "or choose another --output-dir")


def replaceable(path: Path) -> list[Path]:
    """What overwrite_output_dir may delete: the entries of a fastgrpo run. Refuses the working directory, its
    parents and the home folder, a folder without fastgrpo's config.yaml, and one holding anything fastgrpo does not
    write (named in the error)."""
    where, cwd = path.resolve(), Path.cwd().resolve()
    for name, refused in (("the working directory", cwd), ("your home folder", Path.home().resolve())):
        if where == refused:
            raise FileExistsError(f"overwrite_output_dir: output_dir {path} is {name}; fastgrpo replaces only a run's "
                                  "own folder: choose another --output-dir")
    if where in cwd.parents:
        raise FileExistsError(f"overwrite_output_dir: output_dir {path} is a parent of the working directory; "
                              "fastgrpo replaces only a run's own folder: choose another --output-dir")
    entries = contents(path)
    unknown = [p.name for p in entries if not _written_by_fastgrpo(p)]
    if unknown:
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise FileExistsError(f"overwrite_output_dir: output_dir {path} holds files fastgrpo did not write: "
                              f"{unknown[:10]}{more}; move them out, or choose another --output-dir")
    if not (path / "config.yaml").is_file():
        raise FileExistsError(f"overwrite_output_dir: output_dir {path} has no config.yaml, so it is not a fastgrpo "
                              "run; choose another --output-dir")
    return entries


def run_entries(path: Path) -> list[Path]:
    """The entries of `path` that fastgrpo writes (RUN_FILES, RUN_FOLDERS)."""
    return [p for p in contents(path) if _written_by_fastgrpo(p)]


def _written_by_fastgrpo(entry: Path) -> bool:
    if entry.is_symlink():
        return False
    if entry.name in RUN_FILES:
        return entry.is_file()
    return bool(RUN_FOLDERS.fullmatch(entry.name)) and entry.is_dir()


def delete(entries: list[Path]) -> None:
    for entry in entries:
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


class RunDir:
    """The lock on an output folder, held from `lock()` to `release()` (or until this object or its process dies)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = None
        self._created: list[Path] = []  # folders lock() made, deepest first

    def lock(self) -> None:
        """Creates the folder if needed and takes its lock; raises naming the holder's pid if another run has it."""
        path = self.path.absolute()
        self._created = [p for p in [path, *path.parents] if not p.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = (self.path / LOCK_FILE).open("a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise _in_use(self.path) from None
        self._lock.truncate(0)
        self._lock.write(f"{os.getpid()}\n")
        self._lock.flush()

    def release(self, remove_new: bool = False) -> None:
        """Drops the lock; with `remove_new`, also the folders lock() created, if the run wrote nothing into them."""
        if self._lock is None:
            return
        self._lock.close()
        self._lock = None
        if remove_new and self._created and not contents(self.path):
            (self.path / LOCK_FILE).unlink(missing_ok=True)
            for folder in self._created:
                if any(folder.iterdir()):
                    break
                folder.rmdir()
