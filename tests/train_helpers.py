"""Shared helpers of the `fastgrpo train` tests: a TrainConfig for conftest's `assets` (the tiny model and dataset),
metric comparisons that leave out the machine's timings, and a run killed after a checkpoint then resumed."""

import math

import pytest

from fastgrpo.train import TrainConfig, Trainer, checkpoint

# Metrics that measure the machine, not the run: excluded when two runs are compared.
TIMING = ("time/", "tokens_per_second", "peak_memory")


def make_config(assets, tmp_path, **overrides) -> TrainConfig:
    values = dict(
        model_name_or_path=assets["model"], dataset_name=assets["data"], output_dir=str(tmp_path / "run"),
        num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_completion_length=5,
        learning_rate=3e-3, max_steps=4, save_steps=2, eval_num_samples=8, report_to=["none"], disable_tqdm=True,
        seed=7, reward_funcs=["accuracy", "length"],
    )  # fmt: skip
    # The random model never answers right: the length penalty (-1 for 5 tokens, else 0) varies across completions,
    # so advantages, and the updates that tests compare, are not zero.
    return TrainConfig(**{**values, **overrides})


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def assert_same_metrics(a: list[dict], b: list[dict], tol: float = 1e-6) -> None:
    a, b = comparable(a), comparable(b)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys(), (ra.keys() ^ rb.keys())
        for key in ra:
            x, y = ra[key], rb[key]
            assert (x is None and y is None) or math.isclose(x, y, rel_tol=tol, abs_tol=tol), (ra["step"], key, x, y)


def killed_then_resumed(assets, tmp_path, monkeypatch, **settings) -> Trainer:
    """The run of `settings` (save_steps 2) unbroken in a/, and in b/ killed in step 3 (its step-2 checkpoint
    written) then resumed; returns the resumed Trainer, done."""
    Trainer(make_config(assets, tmp_path / "a", **settings)).train()
    original_step = Trainer.train_step

    def killed_at_step_3(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return original_step(self)

    monkeypatch.setattr(Trainer, "train_step", killed_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        Trainer(make_config(assets, tmp_path / "b", **settings)).train()
    monkeypatch.setattr(Trainer, "train_step", original_step)
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "b" / "run")] == ["checkpoint-2"]
    resumed = Trainer(make_config(assets, tmp_path / "b", resume=True, **settings))
    resumed.train()
    return resumed
