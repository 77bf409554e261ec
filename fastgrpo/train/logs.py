"""Where metrics go: metrics.jsonl (always), TensorBoard, wandb, a rich progress bar, and a PNG of the curves."""

import json
import math
import time
import warnings
from pathlib import Path

import torch

from fastgrpo.train.config import TrainConfig
from fastgrpo.train.rewards import Rewards
from fastgrpo.train.rollout import nanstd

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"  # log_completions: one line per sample per step
PLOT_FILE = "training_curves.png"


def read_metrics(output_dir: Path, up_to_step: int | None = None, file: str = METRICS_FILE) -> list[dict]:
    """The rows of metrics.jsonl (or of completions.jsonl) up to a step. A torn last line, left by a killed write, is
    dropped with a warning; a bad line before it is an error naming the line. Non-finite numbers (written by older
    versions) read as None."""
    path = Path(output_dir) / file
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}: not a JSON row ({e}); delete or fix that line") from None
            warnings.warn(f"{path}: dropped its last line, cut short by a killed write ({line[:40]!r}...)",
                          stacklevel=2)
            continue
        rows.append({key: _plain(value) for key, value in row.items()})
    return [r for r in rows if up_to_step is None or r["step"] <= up_to_step]


def _json_line(row: dict) -> str:
    """One row as strict JSON: non-finite numbers are null (json.dumps would write the invalid `Infinity`)."""
    return json.dumps({key: _plain(value) for key, value in row.items()}, allow_nan=False, default=str) + "\n"


class MetricsLog:
    """One JSON line per step in metrics.jsonl, mirrored to the configured sinks. Every line is strict JSON.

    On resume the file is cut back to the checkpoint's step first, so it reads as one uninterrupted run.
    """

    def __init__(self, output_dir: Path, report_to: list[str], config: dict, resume_step: int | None,
                 write: bool = True):
        self.path = Path(output_dir) / METRICS_FILE
        self.history = read_metrics(output_dir, resume_step) if resume_step is not None else []
        self.write = write  # False on all ranks but the first of several processes: history only
        self.tensorboard = self.wandb = None
        self.completions_path = Path(output_dir) / COMPLETIONS_FILE
        if not write:
            return
        _rewrite(self.path, self.history)
        if resume_step is not None and self.completions_path.is_file():
            _rewrite(self.completions_path, read_metrics(output_dir, resume_step, COMPLETIONS_FILE))
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(str(Path(output_dir) / "tensorboard"))
            except ImportError:
                warnings.warn("report_to has tensorboard but it is not installed (pip install tensorboard); "
                              f"metrics go to {self.path} only", stacklevel=2)
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("report_to has wandb but it is not installed: pip install wandb") from e
            self.wandb = wandb.init(project="fastgrpo", config=config, dir=str(output_dir), resume="allow")

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.history.append(row)
        if not self.write:
            return
        with self.path.open("a") as f:
            f.write(_json_line(row))
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and self.tensorboard is not None:
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """One line per sample in completions.jsonl: {step, prompt, completion, rewards..., advantage, extra...}."""
        if self.write:
            with self.completions_path.open("a") as f:
                f.writelines(_json_line({"step": step, **row}) for row in rows)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _rewrite(path: Path, rows: list[dict]) -> None:
    """`path` holding exactly `rows`, replaced in one rename (a killed run leaves the old file or the new one)."""
    partial = path.with_suffix(".partial")
    partial.write_text("".join(map(_json_line, rows)))
    partial.replace(path)


def _plain(value):
    """A Python scalar; NaN and +-inf (a reward of 1e39 is inf in float32) as None, JSON's null; lists and dicts
    (a conversational prompt, a reward function's log_extra values) item by item."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    value = value.item() if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def plot(history: list[dict], path: Path) -> Path:
    """Reward (and held-out accuracy), KL (entropy when beta = 0) and completion length against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        points = [(r["step"], r[key]) for r in history if r.get(key) is not None]
        return [p[0] for p in points], [p[1] for p in points]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(*series("reward"), label="train reward")
    steps, accuracy = series("eval/accuracy")
    if steps:
        axes[0].plot(steps, accuracy, "o-", label="held-out accuracy")
    axes[0].set_title("reward")
    axes[0].legend()
    divergence = "kl" if any(r.get("kl") is not None for r in history) else "entropy"
    axes[1].plot(*series(divergence))
    axes[1].set_title(divergence if divergence == "kl" else "entropy (beta = 0: no KL)")
    axes[2].plot(*series("completions/mean_length"))
    axes[2].set_title("mean completion length (tokens)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- step metrics and presentation ------------------------------------------------------------------------------


def nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def reward_metrics(rewards: Rewards, per_func: torch.Tensor, total: torch.Tensor, flat: torch.Tensor) -> dict:
    """TRL 1.16's reward metrics from per_func [n, F] (NaN where a function returned None) and total [n] (NaN where
    every function did): means and stds over the samples that have a value, the std being the whole round's."""
    metrics = {"reward": _nan_stat(total, torch.nanmean), "reward_std": _nan_stat(total, nanstd),
               "frac_reward_zero_std": flat.float().mean().item()}
    for k, name in enumerate(rewards.metric_names):
        metrics[f"rewards/{name}/mean"] = _nan_stat(per_func[:, k], torch.nanmean)
        metrics[f"rewards/{name}/std"] = _nan_stat(per_func[:, k], nanstd)
    return metrics


def _nan_stat(x: torch.Tensor, statistic) -> float | None:
    """A NaN-ignoring statistic as a float; None (null in metrics.jsonl) when there are no values to take it of."""
    value = statistic(x).item()
    return None if math.isnan(value) else value


def length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    terminated = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "completions/min_terminated_length": terminated.min().item(),
        "completions/max_terminated_length": terminated.max().item(),
    }


def summary_line(summary: dict, config: TrainConfig) -> str:
    how = "greedy" if config.eval_temperature == 0 else f"temperature {config.eval_temperature}"
    if summary["initial_accuracy"] is None:
        accuracy_text = "no held-out evaluation"
    else:
        accuracy_text = (f"held-out accuracy {summary['initial_accuracy']:.1%} -> {summary['final_accuracy']:.1%} "
                         f"(pass@1, {how}, {summary['eval_prompts']} held-out prompts)")
    steps = f"{summary['steps']} step" + ("" if summary["steps"] == 1 else "s")
    ran = f"{steps} in {summary['seconds']:.0f} s"
    if summary.get("resumed_from"):
        ran = (f"steps {summary['resumed_from'] + 1}-{summary['steps']} in {summary['seconds_run']:.0f} s, resumed "
               f"from step {summary['resumed_from']} ({ran} in all)")
    return f"fastgrpo: {accuracy_text}; {ran}; run in {summary['output_dir']}"


class Timer:
    """Laps of one step, as time/<lap> metrics."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.last = now - self.last, now

    @property
    def total(self) -> float:
        return self.last - self.start

    def metrics(self) -> dict:
        return {**{f"time/{k}": v for k, v in self.laps.items()}, "time/step": self.total}


class Progress:
    """A rich progress bar: step, reward, KL, tokens/s and ETA (nothing when disable_tqdm)."""

    def __init__(self, config: TrainConfig, start_step: int):
        self.enabled = not config.disable_tqdm
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.task = self.progress.add_task("train", total=config.max_steps, completed=start_step, info="")

    def __enter__(self):
        if self.enabled:
            self.progress.start()
        return self

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        info = f"reward {metrics['reward']:.3f}"
        if metrics.get("kl") is not None and not math.isnan(metrics["kl"]):
            info += f"  kl {metrics['kl']:.4f}"
        info += f"  {metrics['tokens_per_second']:.0f} tok/s"
        if metrics.get("eval/accuracy") is not None:
            info += f"  held-out {metrics['eval/accuracy']:.1%}"
        self.progress.update(self.task, completed=step, info=info)

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.stop()
