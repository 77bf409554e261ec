"""`fastgrpo train` loses nothing and says what went wrong: the output folder (what --overwrite-output-dir may delete,
one run at a time), checkpoints that are damaged or were written by someone else, metrics.jsonl, and runs stopped by
Ctrl-C, SIGTERM or SIGKILL.

Every refusal is checked to name the thing to fix and to leave every file in the test's folder as it was. The tiny
model and dataset are conftest's `assets`.
"""

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import assert_same_metrics, make_config
from transformers import AutoModelForCausalLM

from fastgrpo.cli import main
from fastgrpo.train import Trainer, checkpoint
from fastgrpo.train import trainer as trainer_module
from fastgrpo.train.checkpoint import CheckpointError
from fastgrpo.train.logs import MetricsLog, read_metrics
from fastgrpo.train.run_dir import LOCK_FILE

SMALL = dict(save_steps=1, eval_num_samples=4)


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry below `folder` with its sha256 (folders and lock files by their presence: a run rewrites its pid)."""
    def digest(path: Path) -> str:
        if path.is_dir() or path.name == LOCK_FILE:
            return "present"
        return hashlib.sha256(path.read_bytes()).hexdigest()

    return {str(p.relative_to(folder)): digest(p) for p in sorted(folder.rglob("*"))}


def fake_run(folder: Path) -> None:
    """A folder holding what a fastgrpo run holds, so that only the rule under test can refuse to delete it."""
    (folder / "checkpoint-1").mkdir(parents=True)
    (folder / "config.yaml").write_text("seed: 7\n")
    (folder / "metrics.jsonl").write_text('{"step": 0}\n')


def strict_json(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def one_line_error(capsys, argv: list[str]) -> str:
    """`fastgrpo train` with argv exits 2 printing one line; that line."""
    with pytest.raises(SystemExit) as stop:
        main(["train", *argv])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastgrpo train: error: "), lines
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(assets, tmp_path_factory) -> Path:
    """A run of 2 steps with checkpoint-1 and checkpoint-2; tests copy it."""
    root = tmp_path_factory.mktemp("finished")
    Trainer(make_config(assets, root, max_steps=2, **SMALL)).train()
    return root / "run"


def copy_of(finished_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished_run, tmp_path / "run")
    (tmp_path / "sibling.txt").write_text("not the run's")
    return tmp_path / "run"


# -- --overwrite-output-dir deletes only a fastgrpo run, and only once the new one has loaded ----------------------


def test_overwrite_refuses_the_working_directory_its_parents_and_home(assets, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    fake_run(home / "work")
    fake_run(home)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home / "work")
    before = snapshot(tmp_path)
    for output_dir, rule in ((".", "the working directory"), ("..", "your home folder"),
                             (str(tmp_path), "a parent of the working directory")):
        with pytest.raises(FileExistsError, match=f"output_dir {output_dir} is {rule}"):
            Trainer(make_config(assets, tmp_path, output_dir=output_dir, overwrite_output_dir=True))
    line = one_line_error(capsys, ["--output-dir", ".", "--overwrite-output-dir", "--model-name-or-path",
                                   assets["model"], "--dataset-name", assets["data"]])
    assert "--output-dir . is the working directory" in line
    assert snapshot(tmp_path) == before


def test_overwrite_refuses_a_folder_that_is_not_a_fastgrpo_run(assets, tmp_path):
    run = tmp_path / "run"
    fake_run(run)
    (run / "notes.txt").write_text("mine")
    (run / "data").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "weights.bin").write_text("mine too")
    (run / "checkpoint-9").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "other" / "tensorboard").mkdir(parents=True)  # named like fastgrpo's, but no config.yaml
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=r"holds files fastgrpo did not write: \['checkpoint-9', 'data', "
                                              r"'notes.txt'\]; move them out"):
        Trainer(make_config(assets, tmp_path, overwrite_output_dir=True))
    with pytest.raises(FileExistsError, match="has no config.yaml, so it is not a fastgrpo run"):
        Trainer(make_config(assets, tmp_path, output_dir=str(tmp_path / "other"), overwrite_output_dir=True))
    assert snapshot(tmp_path) == before


def test_overwrite_deletes_the_old_run_only_once_the_new_one_has_loaded(assets, tmp_path, finished_run):
    run = copy_of(finished_run, tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        Trainer(make_config(assets, tmp_path, dataset_name=str(tmp_path / "missing.jsonl"), overwrite_output_dir=True))
    assert snapshot(tmp_path) == before  # a typo costs nothing: the old run is whole

    Trainer(make_config(assets, tmp_path, overwrite_output_dir=True, max_steps=1, **SMALL)).train()
    assert [p.name for p in checkpoint.checkpoints(run)] == ["checkpoint-1"]  # the old checkpoint-2 is gone
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
    outside = {k: v for k, v in before.items() if not k.startswith("run")}
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("run")} == outside


# -- one run per output folder ---------------------------------------------------------------------------------------


def test_a_second_run_into_a_locked_folder_is_refused(assets, tmp_path):
    run = tmp_path / "run"
    first = Trainer(make_config(assets, tmp_path, max_steps=1, **SMALL))
    before = snapshot(tmp_path)
    for overrides in ({}, {"overwrite_output_dir": True}, {"resume": True}):
        with pytest.raises(FileExistsError, match=rf"output_dir {run} is in use by another fastgrpo run "
                                                  rf"\(pid {os.getpid()}\)"):
            Trainer(make_config(assets, tmp_path, **overrides))
    assert snapshot(tmp_path) == before
    first.train()  # releases the folder when it ends
    assert Trainer(make_config(assets, tmp_path, resume=True, max_steps=2, **SMALL)).step == 1


# -- --resume -------------------------------------------------------------------------------------------------------


def test_resume_refuses_max_steps_not_past_the_checkpoint(assets, tmp_path, finished_run, capsys):
    run = copy_of(finished_run, tmp_path)
    before = snapshot(tmp_path)
    for max_steps in (1, 2):
        with pytest.raises(ValueError, match=rf"resume: max_steps {max_steps} is not past the step of "
                                             rf"{run / 'checkpoint-2'} \(2\); pass --max-steps greater than 2"):
            Trainer(make_config(assets, tmp_path, resume=True, max_steps=max_steps))
    line = one_line_error(capsys, ["--output-dir", str(run), "--resume", "--max-steps", "1"])
    assert "--max-steps 1 is not past" in line and "checkpoint-2" in line
    assert snapshot(tmp_path) == before  # config.yaml is not rewritten, no lock file appears


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path: Path) -> None:
    path.write_text('{"step": 2, "num_tok')


@pytest.mark.parametrize("name, damage", [("model.safetensors", truncate), ("optimizer.pt", truncate),
                                          ("trainer_state.json", garble)])
def test_damaged_checkpoint_file_falls_back_to_the_previous_checkpoint(assets, tmp_path, finished_run, capsys, name,
                                                                        damage):
    run = copy_of(finished_run, tmp_path)
    damage(run / "checkpoint-2" / name)
    with pytest.warns(UserWarning, match=rf"resume: {run / 'checkpoint-2' / name} is truncated or corrupt .*; "
                                         rf"resuming from {run / 'checkpoint-1'} \(step 1\) instead"):
        resumed = Trainer(make_config(assets, tmp_path, resume=True, max_steps=3, **SMALL))
    assert resumed.step == 1
    resumed.folder.release()
    assert "with changed options: --max-steps 2 -> 3" in capsys.readouterr().err  # (issue 41: a resume says so)

    damage(run / "checkpoint-1" / name)
    before = snapshot(tmp_path)
    line = one_line_error(capsys, ["--output-dir", str(run), "--resume", "--max-steps", "3"])
    assert f"{run / 'checkpoint-2' / name} is truncated or corrupt" in line
    assert f"{run} holds no older whole checkpoint" in line
    assert snapshot(tmp_path) == before


class RunsCode:
    """A pickle that calls `exec` when it is loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_checkpoint_pickles_are_never_run(assets, tmp_path, finished_run):
    run = copy_of(finished_run, tmp_path)
    marker = tmp_path / "code-ran"
    torch.save({"state": RunsCode(marker), "param_groups": []}, run / "checkpoint-2" / "optimizer.pt")
    with pytest.raises(CheckpointError, match=rf"{run / 'checkpoint-2' / 'optimizer.pt'} holds pickled objects, "
                                              r"which fastgrpo never loads \(.*exec"):
        Trainer(make_config(assets, tmp_path, resume=True, max_steps=3, **SMALL))
    assert not marker.exists()


# -- metrics.jsonl --------------------------------------------------------------------------------------------------


def test_metrics_jsonl_holds_only_strict_json(tmp_path):
    log = MetricsLog(tmp_path, ["none"], {}, None)
    huge_reward = torch.tensor(1e39, dtype=torch.float64).float()  # finite in float64, inf in float32
    log.log(1, {"reward": huge_reward, "kl": float("-inf"), "loss": float("nan"), "learning_rate": 1e-3})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "reward": Infinity}\n')  # as older versions wrote it
    MetricsLog(tmp_path, ["none"], {}, resume_step=2)  # a resume rewrites the file
    rows = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward": None, "kl": None, "loss": None, "learning_rate": 1e-3},
                    {"step": 2, "reward": None}]


def test_torn_last_metrics_line_is_dropped_and_does_not_block_resume(assets, tmp_path, finished_run):
    run = copy_of(finished_run, tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')  # a write killed midway
    with pytest.warns(UserWarning, match=r"metrics.jsonl: dropped its last line, cut short by a killed write"):
        Trainer(make_config(assets, tmp_path, resume=True, max_steps=3, **SMALL)).folder.release()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [strict_json(line)["step"] for line in lines] == [0, 1, 2]

    (run / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON row .*; delete or fix that line"):
        read_metrics(run)


# -- the output folder is checked before anything loads --------------------------------------------------------------


def test_output_dir_that_is_a_file_or_read_only_is_refused_before_the_model_loads(assets, tmp_path, monkeypatch,
                                                                                   capsys):
    def not_now(*args, **kwargs):
        raise AssertionError("loaded before the output folder was checked")

    monkeypatch.setattr(trainer_module, "load_tokenizer", not_now)
    monkeypatch.setattr(trainer_module, "load_policy", not_now)
    run = tmp_path / "run"
    run.write_text("a file")
    before = snapshot(tmp_path)
    with pytest.raises(NotADirectoryError, match=rf"output_dir {run} is a file, not a folder"):
        Trainer(make_config(assets, tmp_path))
    with pytest.raises(NotADirectoryError, match=rf"output_dir {run / 'sub'} is a file, not a folder \({run} is a"):
        Trainer(make_config(assets, tmp_path, output_dir=str(run / "sub")))
    line = one_line_error(capsys, ["--output-dir", str(run), "--model-name-or-path", assets["model"],
                                   "--dataset-name", assets["data"]])
    assert f"--output-dir {run} is a file" in line
    assert snapshot(tmp_path) == before

    run.unlink()
    run.mkdir()
    run.chmod(0o555)
    if os.geteuid() == 0:  # root writes past permission bits (not onto read-only mounts): report what a user sees
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != run and access(path, mode))
    try:
        for overrides in ({}, {"resume": True}):
            with pytest.raises(PermissionError, match=rf"output_dir {run} is not writable \({run} is read-only"):
                Trainer(make_config(assets, tmp_path, **overrides))
        with pytest.raises(PermissionError, match=rf"output_dir {run / 'new'} is not writable \({run} is read-only"):
            Trainer(make_config(assets, tmp_path, output_dir=str(run / "new")))
    finally:
        run.chmod(0o755)
    assert not any(run.iterdir())


# -- stopped runs: Ctrl-C, SIGTERM, SIGKILL ---------------------------------------------------------------------------


@pytest.fixture
def own_signals():
    """The dispositions of an interactive shell's foreground process, whatever this one inherited: Python's
    KeyboardInterrupt for SIGINT, the default for SIGTERM; the inherited ones again after the test. A background job
    of a non-interactive shell starts with SIGINT ignored (and nohup or a supervisor may set others), and a signal
    ignored there is ignored by the run too, as a shell user expects of a background job."""
    inherited = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        for signum, handler in inherited.items():
            signal.signal(signum, handler)


def signalled_in_step(step: int, signum: int):
    """A Trainer.train_step that sends `signum` to this process in `step` (real signals: Ctrl-C is SIGINT)."""
    original = Trainer.train_step

    def train_step(self):
        if self.step == step:
            assert signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN)  # else it would end pytest
            signal.raise_signal(signum)  # to this thread, whose handler then raises at once
            raise AssertionError(f"signal {signum} did not stop the run")
        return original(self)

    return train_step


def stop_message(err: str) -> list[str]:
    """fastgrpo's stop message and what follows it in stderr: the lines from the one that starts "fastgrpo train:
    stopped by" on. Other lines (a library's once-per-process warning, which lands in whichever test first meets it)
    are not the test's business."""
    lines = err.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("fastgrpo train: stopped by")]
    assert len(starts) == 1, err
    return lines[starts[0]:]


@pytest.mark.parametrize("signum, name", [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_stop_signals_print_the_last_checkpoint_and_the_command_to_resume(assets, tmp_path, monkeypatch, capsys,
                                                                           own_signals, signum, name):
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", signalled_in_step(2, signum))
    make_config(assets, tmp_path, max_steps=2, **SMALL).save_yaml(tmp_path / "run.yaml")
    with pytest.raises(SystemExit) as stop:
        main(["train", "--config", str(tmp_path / "run.yaml")])
    assert stop.value.code == 128 + signum  # 130 and 143, as the shell reports them
    run = tmp_path / "run"
    message, command = stop_message(capsys.readouterr().err)
    assert message == f"fastgrpo train: stopped by {name}; the last checkpoint is {run / 'checkpoint-1'}; resume with:"
    assert command.strip() == shlex.join(["fastgrpo", "train", "--output-dir", str(run), "--resume"])
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is the run's only
    monkeypatch.setattr(Trainer, "train_step", original)
    main(shlex.split(command)[1:])
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]


def test_stop_before_the_first_checkpoint_says_how_to_start_over(assets, tmp_path, monkeypatch, capsys, own_signals):
    monkeypatch.setattr(Trainer, "train_step", signalled_in_step(1, signal.SIGINT))
    argv = ["--model-name-or-path", assets["model"], "--dataset-name", assets["data"], "--output-dir",
            str(tmp_path / "run"), "--max-completion-length", "5", "--eval-num-samples", "4", "--disable-tqdm",
            "--report-to", "none"]
    with pytest.raises(SystemExit) as stop:
        main(["train", *argv])
    assert stop.value.code == 130
    (message,) = stop_message(capsys.readouterr().err)
    assert message == (f"fastgrpo train: stopped by Ctrl-C before the first checkpoint, so there is nothing to "
                       f"resume in {tmp_path / 'run'}; to start over, run the same command with --overwrite-output-dir")


def wait_for(condition, process: subprocess.Popen, stderr: Path, timeout: float = 240.0, poll: float = 0.005):
    """Polls `condition` until it returns something truthy, while `process` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if process.poll() is not None:
            raise AssertionError(f"the run ended (code {process.returncode}) first: {stderr.read_text()[-3000:]}")
        time.sleep(poll)
    raise AssertionError("timed out")


def start(argv: list[str], stderr: Path) -> subprocess.Popen:
    """`python -m fastgrpo train` with argv, its stderr into a file (a pipe nobody reads could fill and block it)."""
    with stderr.open("w") as err:
        return subprocess.Popen([sys.executable, "-m", "fastgrpo", "train", *argv], stdout=subprocess.DEVNULL,
                                stderr=err)


def partial_checkpoint(run: Path) -> Path | None:
    """A checkpoint being written, with a complete one before it."""
    return next((p for p in run.glob(".checkpoint-*.partial") if p.name != ".checkpoint-1.partial"), None)


@pytest.mark.parametrize("moment", ["mid_step", "mid_checkpoint"])
@pytest.mark.slow
def test_sigkill_then_resume_equals_an_unbroken_run(assets, tmp_path, moment):
    """`python -m fastgrpo train` killed during step 2 (checkpoint-1 complete) or while checkpoint-2 is being
    written, then resumed."""
    settings = dict(max_steps=2, **SMALL)
    Trainer(make_config(assets, tmp_path / "a", **settings)).train()
    make_config(assets, tmp_path / "b", **settings).save_yaml(tmp_path / "b.yaml")
    run, log = tmp_path / "b" / "run", tmp_path / "stderr.txt"

    killed = start(["--config", str(tmp_path / "b.yaml")], log)
    wait_for(lambda: (run / "checkpoint-1").is_dir(), killed, log)
    if moment == "mid_checkpoint":
        with pytest.raises(FileExistsError, match=rf"in use by another fastgrpo run \(pid {killed.pid}\)"):
            Trainer(make_config(assets, tmp_path / "b", resume=True, **settings))
        partial = wait_for(lambda: partial_checkpoint(run), killed, log)  # writing one takes ~100 ms, fsyncs included
    killed.kill()
    assert killed.wait() == -signal.SIGKILL
    if moment == "mid_checkpoint":
        assert partial.exists(), "the kill came after the checkpoint was complete"
    else:
        assert not (run / "checkpoint-2").exists(), "the kill came after step 2 was saved"
    for complete in checkpoint.checkpoints(run):
        checkpoint.verify(complete)

    main(["train", "--output-dir", str(run), "--resume"])  # the lock died with the killed run
    assert not list(run.glob(".checkpoint-*.partial"))
    assert_same_metrics(read_metrics(tmp_path / "a" / "run"), read_metrics(run))
    unbroken = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "run" / "checkpoint-2").state_dict()
    resumed = AutoModelForCausalLM.from_pretrained(run / "checkpoint-2").state_dict()
    for name in unbroken:
        torch.testing.assert_close(resumed[name], unbroken[name], atol=1e-6, rtol=0, msg=name)
