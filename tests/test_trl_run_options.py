"""TRL 1.16 options of the run (not the loss): sync_ref_model / ref_model_mixup_alpha / ref_model_sync_steps,
disable_dropout, num_generations_eval. Each against TRL's own code where TRL has code for it, and its refusals."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import assert_same_metrics, killed_then_resumed, make_config
from transformers import AutoModelForCausalLM
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import disable_dropout_in_model

from fastgrpo.train import TrainConfig, Trainer
from fastgrpo.train.logs import read_metrics


def test_sync_ref_model_moves_the_reference_as_trl(assets, tmp_path, monkeypatch):
    """Every ref_model_sync_steps-th optimizer step the reference becomes alpha * policy + (1 - alpha) * reference:
    replayed with TRL's own SyncRefModelCallback on the policy's weights after each optimizer step, the reference
    ends where fastgrpo's does (3 rounds of 2 optimizer steps, synced every 3rd)."""
    trainer = Trainer(make_config(assets, tmp_path, max_steps=3, beta=0.05, sync_ref_model=True,
                                  ref_model_sync_steps=3, ref_model_mixup_alpha=0.3, steps_per_generation=4))
    assert trainer.optimizer_steps_per_round == 2
    replay = [p.detach().clone() for p in trainer.ref_model.parameters()]
    policies = []
    trainer.optimizer.register_step_post_hook(
        lambda *a: policies.append([p.detach().clone() for p in trainer.model.parameters()]))
    trainer.train()
    assert len(policies) == 6
    target = type("Module", (), {"parameters": lambda self: replay})()
    for step, policy in enumerate(policies, 1):
        if step % 3 == 0:
            SyncRefModelCallback._sync_target_model(type("M", (), {"parameters": lambda self, p=policy: p})(),
                                                    target, 0.3)
    for ours, theirs in zip(trainer.ref_model.parameters(), replay, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    initial = AutoModelForCausalLM.from_pretrained(assets["model"])
    assert any((a - b).abs().max() > 1e-5 for a, b in zip(initial.parameters(), replay, strict=True))  # it moved
    saved = load_file(tmp_path / "run" / "checkpoint-3" / "reference.safetensors")
    for name, parameter in trainer.ref_model.named_parameters():
        torch.testing.assert_close(saved[name], parameter.detach(), rtol=0, atol=0)


@pytest.mark.slow
def test_sync_ref_model_resumes_exactly(assets, tmp_path, monkeypatch):
    """A run killed after its step-2 checkpoint and resumed ends where the unbroken run does: the checkpoint holds
    the moved reference (the KL term reads it)."""
    settings = dict(max_steps=4, save_steps=2, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1,
                    ref_model_mixup_alpha=0.5)
    killed_then_resumed(assets, tmp_path, monkeypatch, **settings)
    assert_same_metrics(read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "b" / "run"))
    a = load_file(tmp_path / "a" / "run" / "checkpoint-4" / "reference.safetensors")
    b = load_file(tmp_path / "b" / "run" / "checkpoint-4" / "reference.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def test_disable_dropout_as_trl(assets, tmp_path):
    """Every torch.nn.Dropout of the policy (LoRA's too) at p 0, as TRL's disable_dropout_in_model leaves it."""
    trainer = Trainer(make_config(assets, tmp_path, use_peft=True, lora_dropout=0.1, disable_dropout=True))
    dropouts = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    other = Trainer(make_config(assets, tmp_path / "trl", use_peft=True, lora_dropout=0.1))
    assert any(m.p == 0.1 for m in other.model.modules() if isinstance(m, torch.nn.Dropout))
    disable_dropout_in_model(other.model)
    assert [m.p for m in other.model.modules() if isinstance(m, torch.nn.Dropout)] == [m.p for m in dropouts]


def test_num_generations_eval_averages_over_samples(assets, tmp_path):
    """n completions per held-out prompt at eval_temperature: the accuracy is the mean over all n * prompts, and the
    first completion of each prompt is the one a single-sample evaluation draws (its random stream)."""
    one = Trainer(make_config(assets, tmp_path / "one", eval_temperature=1.0))
    four = Trainer(make_config(assets, tmp_path / "four", eval_temperature=1.0, num_generations_eval=4))
    calls = []
    original = four._sample
    four._sample = lambda data, picked, n, params, first_group=0: calls.append(n) or original(data, picked, n, params,
                                                                                               first_group)
    accuracy = four.evaluate()
    assert calls == [4] and 0 <= accuracy <= 1
    assert one.evaluate() is not None


@pytest.mark.parametrize("options, error", [
    (dict(sync_ref_model=True), "sync_ref_model needs beta > 0"),
    (dict(sync_ref_model=True, beta=0.1, use_peft=True), "sync_ref_model needs full fine-tuning"),
    (dict(ref_model_mixup_alpha=1.5), r"ref_model_mixup_alpha must be in \[0, 1\]"),
    (dict(ref_model_sync_steps=0), "ref_model_sync_steps must be >= 1"),
    (dict(num_generations_eval=0), "num_generations_eval must be None or >= 1"),
    (dict(num_generations_eval=4), "num_generations_eval=4 with eval_temperature 0"),
    (dict(multi_objective_aggregation="mean"), "multi_objective_aggregation must be one of"),
])
def test_refusals(options, error):
    with pytest.raises(ValueError, match=error):
        TrainConfig(model_name_or_path="builtin", dataset_name="builtin", **options)


def test_streamed_data_in_stream_order_and_exact_resume(assets, tmp_path, monkeypatch):
    """dataset_streaming: the train rows are taken in the file's order (a stream is not shuffled), prepared as the
    run reaches them; the held-out prompts are the test split's first eval_num_samples; a resumed run continues the
    stream where it was and ends as the unbroken one."""
    trainer = Trainer(make_config(assets, tmp_path / "order", dataset_streaming=True, max_steps=2))
    rows = [json.loads(line) for line in (Path(assets["data"]) / "train.jsonl").read_text().splitlines()]
    assert len(trainer.train_prompts.rows) < len(rows)  # not read whole
    picked = trainer.order.next(5)
    assert [trainer.train_prompts.rows[i]["prompt"] for i in picked] == [r["prompt"] for r in rows[:5]]
    held_out = [json.loads(line) for line in (Path(assets["data"]) / "test.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in trainer.eval_prompts.rows] == [r["prompt"] for r in held_out[:8]]
    killed_then_resumed(assets, tmp_path, monkeypatch, dataset_streaming=True, max_steps=4, save_steps=2)
    assert_same_metrics(read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "b" / "run"))


def test_streaming_refuses_the_builtin_task():
    with pytest.raises(ValueError, match="dataset_streaming reads a dataset as a stream"):
        TrainConfig(model_name_or_path="builtin", dataset_name="builtin", dataset_streaming=True)
