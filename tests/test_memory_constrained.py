"""Memory-constrained training: 4-bit base weights (QLoRA), 8-bit AdamW states and offloaded checkpoint boundaries,
on a CPU (bitsandbytes >= 0.50 runs NF4 layers and its 8-bit optimizers there)."""

import copy
import sys

import pytest
import torch
from train_helpers import assert_same_metrics, killed_then_resumed, make_config
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fastgrpo.cli import main
from fastgrpo.train import TrainConfig, Trainer
from fastgrpo.train.logs import read_metrics
from fastgrpo.train.offload import ActivationOffload

bnb = pytest.importorskip("bitsandbytes")


# -- offloaded checkpoint boundaries ---------------------------------------------------------------------------------


def tiny_model(layers: int = 3) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def gradients(model, ids) -> dict:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    (logits.float().log_softmax(-1)[..., 0] * torch.linspace(-1, 1, ids.shape[1])).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_offloaded_checkpoints_give_the_gradients_of_plain_checkpointing():
    """Every decoder layer's input but the last goes through the offload (L - 1 per forward), and the gradients
    equal plain checkpointing's (and no checkpointing's) to 1e-6."""
    plain = tiny_model().train()
    offloaded = copy.deepcopy(plain)
    reference = copy.deepcopy(plain)
    for model in (plain, offloaded):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offload = ActivationOffload(torch.device("cpu"))
    offload.install(offloaded)
    ids = torch.randint(0, 50, (2, 24))
    want, got, none = gradients(plain, ids), gradients(offloaded, ids), gradients(reference, ids)
    assert offload.packed == 2  # 3 layers, the last kept
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(got[name], none[name], atol=1e-6, rtol=0, msg=name)
    gradients(offloaded, ids)  # a second micro-batch: its own chain of inputs
    assert offload.packed == 4


@pytest.mark.slow
def test_offload_activations_trains_like_plain_checkpointing(assets, tmp_path):
    """`offload_activations` in the trainer: the same metrics and weights as without it."""
    settings = dict(max_steps=2, save_steps=2, beta=0.05)
    Trainer(make_config(assets, tmp_path / "a", **settings)).train()
    trainer = Trainer(make_config(assets, tmp_path / "b", offload_activations=True, **settings))
    layers = trainer.model.model.layers
    assert isinstance(layers[0]._gradient_checkpointing_func.__self__, ActivationOffload)
    assert not isinstance(getattr(layers[-1]._gradient_checkpointing_func, "__self__", None), ActivationOffload)
    trainer.train()
    assert layers[0]._gradient_checkpointing_func.__self__.packed > 0
    assert_same_metrics(read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "b" / "run"))
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "run" / "checkpoint-2").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "run" / "checkpoint-2").state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


# -- 8-bit AdamW and 4-bit base weights: exact resumes ---------------------------------------------------------------


def resumed_equals_unbroken(assets, tmp_path, monkeypatch, **settings):
    """4 steps unbroken, and killed after the step-2 checkpoint then resumed: the same metrics."""
    resumed = killed_then_resumed(assets, tmp_path, monkeypatch, max_steps=4, save_steps=2, **settings)
    assert_same_metrics(read_metrics(tmp_path / "a" / "run"), read_metrics(tmp_path / "b" / "run"))
    return resumed


def saved_tensors(path) -> dict:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (path / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(path / name)


@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
@pytest.mark.slow
def test_adamw_8bit_resumes_exactly(assets, tmp_path, monkeypatch, use_peft):
    settings = dict(optim="adamw_8bit", use_peft=use_peft, lora_r=64)  # r 64: lora_A [64, 64] gets 8-bit states
    trainer = resumed_equals_unbroken(assets, tmp_path, monkeypatch, **settings)
    assert isinstance(trainer.optimizer, bnb.optim.AdamW8bit)
    states = [s for s in trainer.optimizer.state.values() if "state1" in s]
    assert any(s["state1"].dtype == torch.uint8 for s in states)  # tensors of >= 4096 values: 8-bit moments
    a, b = (saved_tensors(tmp_path / side / "run" / "checkpoint-4") for side in "ab")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)
    if not use_peft:
        initial = AutoModelForCausalLM.from_pretrained(assets["model"]).state_dict()
        assert not torch.allclose(a["lm_head.weight"], initial["lm_head.weight"], atol=1e-4)  # it trained


@pytest.mark.slow
def test_4bit_lora_resumes_exactly_and_keeps_the_head_unquantized(assets, tmp_path, monkeypatch):
    trainer = resumed_equals_unbroken(assets, tmp_path, monkeypatch, use_peft=True, load_in_4bit=True, lora_r=8,
                                      beta=0.04)
    net = trainer.model.base_model.model
    assert isinstance(net.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    assert net.model.layers[0].self_attn.q_proj.base_layer.weight.quant_state.nested  # double quantization
    assert type(net.lm_head) is torch.nn.Linear and net.lm_head.weight.dtype == torch.float32
    a, b = (saved_tensors(tmp_path / side / "run" / "checkpoint-4") for side in "ab")
    assert a and all("lora_" in name for name in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


def test_the_engine_samples_from_the_4bit_model(assets, tmp_path):
    """The paged engine runs the same 4-bit modules: its greedy completions are transformers' greedy ones."""
    from fastgrpo.sampling import SamplingParams

    trainer = Trainer(make_config(assets, tmp_path, use_peft=True, load_in_4bit=True))
    prompts = trainer.train_prompts.token_ids[:4]
    params = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=trainer.stop_token_ids)
    ours = [group[0].token_ids for group in trainer.engine.generate(prompts, n=1, params=params)]
    trainer.model.eval()
    for prompt, got in zip(prompts, ours, strict=True):
        out = trainer.model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                                     eos_token_id=trainer.stop_token_ids, pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        assert got == want[: len(got)] and (len(got) == 5 or got[-1] in trainer.stop_token_ids)


@pytest.mark.slow
def test_4bit_lora_learns_the_builtin_task(tmp_path):
    """QLoRA on the built-in task: held-out accuracy rises (NF4 base, LoRA r 16 on every linear layer but the head)."""
    config = TrainConfig.from_yaml(
        "fastgrpo/train/default.yaml", use_peft=True, load_in_4bit=True, learning_rate=3e-3, max_steps=30,
        eval_steps=0, eval_num_samples=300, save_steps=0, output_dir=str(tmp_path / "run"), disable_tqdm=True)
    summary = Trainer(config).train()
    print(summary)
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.08, summary


# -- bad values ------------------------------------------------------------------------------------------------------


def test_memory_options_refuse_bad_values(assets, tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["train", "--optim", "sgd"])
    err = capsys.readouterr().err
    assert "argument --optim: invalid choice: 'sgd' (choose from 'adamw_torch', 'adamw_8bit')" in err
    with pytest.raises(ValueError, match=r"optim must be one of \('adamw_torch', 'adamw_8bit'\), got 'adamw'"):
        make_config(assets, tmp_path, optim="adamw")
    with pytest.raises(ValueError, match="load_in_4bit needs use_peft"):
        make_config(assets, tmp_path, load_in_4bit=True)
    with pytest.raises(ValueError, match="offload_activations needs gradient_checkpointing"):
        make_config(assets, tmp_path, offload_activations=True, gradient_checkpointing=False)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed
    with pytest.raises(ImportError, match=r"load_in_4bit needs bitsandbytes>=0.50: pip install 'fastgrpo\[quant\]'"):
        Trainer(make_config(assets, tmp_path / "a", use_peft=True, load_in_4bit=True))
    with pytest.raises(ImportError, match=r"optim adamw_8bit needs bitsandbytes>=0.50"):
        Trainer(make_config(assets, tmp_path / "b", optim="adamw_8bit"))
    assert not (tmp_path / "a" / "run").exists()  # nothing left behind
