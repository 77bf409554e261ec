"""`fastgrpo bench routing-replay`: GRPO on a tiny mixture-of-experts model with and without routing replay, the same
seeds, on the built-in arithmetic task.

1. The model: a tiny Qwen3-MoE (hidden 128, 2 layers of 8 experts, 2 a token) warmed up as the default model is
   (`python -m fastgrpo.train.build_default_model --architecture qwen3_moe`, 340 steps), built once into --work-dir.
2. Per seed, the built-in recipe (fastgrpo/train/default.yaml: 32 prompts x 8 completions a step, dapo, lr 3e-4)
   for --steps steps, evaluated every 25 on --eval-samples held-out problems, with the sampler on fp8 KV pages
   (--kv-cache-dtype fp8): its hidden states then differ from the trainer's, as a separate inference engine's do, and
   some routes flip. Once without --routing-replay, once with it.
3. Per run: held-out accuracy, the mean of routing/mismatch (the trainer's own top k against the sampler's) and of
   TRL's sampling/sampling_logp_difference (mean and max), the mean reward; one figure of the curves.

It measures these runs, nothing beyond: a tiny model on a CPU, a few seeds.
"""

import argparse
import datetime
import json
import statistics
from pathlib import Path

from fastgrpo import bench as harness


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("--work-dir", default="runs/routing-replay", help="the model and the runs")
    parser.add_argument("--out-dir", default="benchmarks/results")


def train(model: Path, output: Path, steps: int, seed: int, eval_samples: int, replay: bool) -> list[dict]:
    from fastgrpo.train import TrainConfig, Trainer
    from fastgrpo.train.config import DEFAULT_RECIPE
    from fastgrpo.train.logs import read_metrics

    config = TrainConfig.from_yaml(DEFAULT_RECIPE, model_name_or_path=str(model), max_steps=steps, eval_steps=25,
                                   eval_num_samples=eval_samples, kv_cache_dtype="fp8", seed=seed,
                                   routing_replay=replay, output_dir=str(output), overwrite_output_dir=True,
                                   save_steps=0, disable_tqdm=True, report_to=["none"])  # fmt: skip
    Trainer(config).train()
    return read_metrics(output)


def summary(rows: list[dict]) -> dict:
    steps = [r for r in rows if r["step"] > 0]
    mean = lambda key: statistics.fmean(r[key] for r in steps)
    return {"accuracy": [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None],
            "mismatch": mean("routing/mismatch"), "logp_difference": mean("sampling/sampling_logp_difference/mean"),
            "logp_difference_max": max(r["sampling/sampling_logp_difference/max"] for r in steps),
            "reward": mean("reward"), "seconds": rows[-1]["time/elapsed"]}


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for (seed, replay), rows in runs.items():
        steps = [r for r in rows if r["step"] > 0]
        style = dict(color="C1" if replay else "C0", alpha=0.8, label=f"{'replay' if replay else 'no replay'}, "
                                                                      f"seed {seed}")
        accuracy = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
        axes[0].plot(*zip(*accuracy, strict=True), "o-", **style)
        axes[1].plot([r["step"] for r in steps], [r["sampling/sampling_logp_difference/mean"] for r in steps], **style)
        axes[2].plot([r["step"] for r in steps], [r["routing/mismatch"] for r in steps], **style)
    for ax, title in zip(axes, ("held-out accuracy", "sampler - trainer |logp| (mean)", "routing/mismatch"),
                         strict=True):  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    import torch

    from fastgrpo.train import build_default_model

    harness.check_out_dir(args.out_dir)
    work = Path(args.work_dir)
    model = work / "model"
    if not (model / "config.json").is_file():
        build_default_model.build(model, build_default_model.DEFAULT_STEPS, build_default_model.DEFAULT_SEED,
                                  "qwen3_moe")
    runs = {(seed, replay): train(model, work / f"seed{seed}-{'replay' if replay else 'plain'}", args.steps, seed,
                                  args.eval_samples, replay)
            for seed in args.seeds for replay in (False, True)}  # fmt: skip
    results = {f"seed {seed}, {'replay' if replay else 'no replay'}": summary(rows)
               for (seed, replay), rows in runs.items()}
    day = datetime.date.today().isoformat()
    env = harness.environment(torch.device("cpu"))
    name = harness.results_stem("routing-replay", env)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, out / f"{name}.png")
    lines = [f"# Routing replay on a tiny MoE, GRPO with and without it ({day}, {env['device']}, torch "
             f"{env['torch']})", "",
             f"`fastgrpo bench routing-replay --steps {args.steps} --seeds {' '.join(map(str, args.seeds))}`: a tiny "
             "Qwen3-MoE (8 experts, 2 a token, 1.7M parameters) warmed up to ~40% held-out accuracy, then the "
             f"built-in recipe for {args.steps} steps, the sampler on fp8 KV pages, evaluated greedily on "
             f"{args.eval_samples} held-out problems every 25 steps. Means over the steps.", "",
             "| run | held-out accuracy (step: share) | routing/mismatch | sampling_logp_difference mean | max | "
             "reward | seconds |", "|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        said = ", ".join(f"{step}: {share:.3f}" for step, share in r["accuracy"])
        lines.append(f"| {label} | {said} | {r['mismatch']:.4f} | {r['logp_difference']:.4f} | "
                     f"{r['logp_difference_max']:.2f} | {r['reward']:.3f} | {r['seconds']:.0f} |")
    lines += ["", f"![curves]({name}.png)"]
    text = "\n".join(lines) + "\n"
    print(text)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({"environment": env, "runs": results}, indent=1) + "\n")
    return results
