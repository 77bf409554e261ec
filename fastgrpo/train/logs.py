"""Where metrics go: metrics.jsonl (always), TensorBoard, wandb, a rich progress bar, and a PNG of the curves."""

import json
import math
import warnings
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"


def read_metrics(output_dir: Path, up_to_step: int | None = None) -> list[dict]:
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if up_to_step is None or r["step"] <= up_to_step]


class MetricsLog:
    """One JSON line per step in metrics.jsonl, mirrored to the configured sinks.

    On resume the file is cut back to the checkpoint's step first, so it reads as one uninterrupted run.
    """

    def __init__(self, output_dir: Path, report_to: list[str], config: dict, resume_step: int | None):
        self.path = Path(output_dir) / METRICS_FILE
        self.history = read_metrics(output_dir, resume_step) if resume_step is not None else []
        partial = self.path.with_suffix(".partial")
        partial.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        partial.replace(self.path)
        self.tensorboard = self.wandb = None
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
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and self.tensorboard is not None:
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(value):
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and math.isnan(value) else value


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
