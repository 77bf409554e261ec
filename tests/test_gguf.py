"""`--model-name-or-path model.gguf`: the model and tokenizer read from a GGUF file through transformers' gguf_file=,
trained, and saved as ordinary checkpoint folders that a resumed run (and from_pretrained) loads instead of the file.

The GGUF is written here with the gguf package's GGUFWriter from a tiny random Llama, as llama.cpp's
convert_hf_to_gguf.py writes one: its tensor names, F32 weights, q/k rows permuted, a byte-level BPE vocabulary.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import skip_below_transformers
from train_helpers import make_config
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from fastgrpo.cli import main
from fastgrpo.train import TrainConfig, Trainer, arithmetic, checkpoint
from fastgrpo.train.loading import load_policy, load_tokenizer, model_config

# The arithmetic task's characters, one token each, and "12" so that the BPE has a merge (transformers rebuilds
# merges from scores, which this vocabulary has none of, when the file lists no merge).
TOKENS = ["<|endoftext|>", *"0123456789+-=", "12"]
CONTROL, NORMAL = 3, 1  # llama.cpp's token types


def _interleave_rotary_halves(weight: np.ndarray, heads: int) -> np.ndarray:
    """q_proj/k_proj rows as llama.cpp stores them (convert_hf_to_gguf.py's LlamaModel.permute); transformers
    permutes them back as it loads."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(path, model: LlamaForCausalLM) -> None:
    gguf = pytest.importorskip("gguf")
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([CONTROL] + [NORMAL] * (len(TOKENS) - 1))
    writer.add_token_merges(["1 2"])
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        weight = tensor.numpy()
        if name.endswith("q_proj.weight"):
            weight = _interleave_rotary_halves(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = _interleave_rotary_halves(weight, config.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[str, dict]:
    """(the file's path, the random Llama's state dict it holds)."""
    pytest.importorskip("gguf")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    ))  # fmt: skip
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, model)
    return str(path), model.state_dict()


def test_gguf_file_loads_exactly_trains_and_resumes_from_a_checkpoint_folder(assets, tmp_path, tiny_gguf):
    skip_below_transformers("5.18", "reading a GGUF tokenizer with an EOS id but no BOS id")
    path, weights = tiny_gguf
    config = make_config(assets, tmp_path, model_name_or_path=path, max_steps=2, save_steps=2)
    assert model_config(config).num_key_value_heads == 2
    assert load_tokenizer(config)("47+85=").input_ids == [TOKENS.index(c) for c in "47+85="]
    loaded = load_policy(config, torch.device("cpu")).state_dict()
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)

    Trainer(config).train()
    saved = checkpoint.latest(tmp_path / "run")
    assert (saved / "config.json").is_file() and "quantization_config" not in (saved / "config.json").read_text()
    trained = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    assert not torch.equal(trained["lm_head.weight"], weights["lm_head.weight"])
    resumed = load_policy(config, torch.device("cpu"), checkpoint=saved).state_dict()  # what --resume loads
    assert all(torch.equal(resumed[k], trained[k]) for k in trained)
    Trainer(make_config(assets, tmp_path, model_name_or_path=path, max_steps=3, save_steps=2, resume=True)).train()
    assert checkpoint.latest(tmp_path / "run").name == "checkpoint-3"


def test_plan_reads_a_gguf_file(tiny_gguf, capsys):
    main(["plan", "--model-name-or-path", tiny_gguf[0], "--device", "cpu"])
    assert f"fastgrpo plan: {tiny_gguf[0]} on cpu" in capsys.readouterr().out


def test_missing_or_unreadable_gguf_file_is_one_line_naming_the_option(tmp_path, capsys):
    pytest.importorskip("gguf")
    (tmp_path / "notes.gguf").write_text("not a GGUF file")
    for name, message in (("missing.gguf", f"the GGUF file {tmp_path / 'missing.gguf'} does not exist"),
                          ("notes.gguf", f"cannot load '{tmp_path / 'notes.gguf'}' from the file "
                                         f"{tmp_path / 'notes.gguf'}: ValueError: ")):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", "--model-name-or-path", str(tmp_path / name), "--device", "cpu"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(f"fastgrpo plan: error: --model-name-or-path: {message}"), err
        assert err.count("\n") == 1, err


def test_without_the_gguf_package_the_error_names_the_extra(assets, tmp_path, monkeypatch):
    (tmp_path / "model.gguf").write_bytes(b"")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    config = make_config(assets, tmp_path, model_name_or_path=str(tmp_path / "model.gguf"))
    with pytest.raises(ImportError, match=r"^model_name_or_path: .*model\.gguf is a GGUF file, which transformers "
                                          r"reads with gguf and accelerate \(missing: gguf\): pip install "
                                          r"'fastgrpo\[gguf\]'$"):
        model_config(config)


def test_load_in_4bit_refuses_a_gguf_file(assets, tmp_path, tiny_gguf):
    config = make_config(assets, tmp_path, model_name_or_path=tiny_gguf[0], use_peft=True, load_in_4bit=True)
    with pytest.raises(ValueError, match="^load_in_4bit: .* is a GGUF file"):
        load_policy(config, torch.device("cpu"))


@pytest.mark.slow
def test_bench_step_runs_both_trainers_on_a_gguf_model(tiny_gguf, tmp_path):
    """`fastgrpo bench step --model x.gguf`: fastgrpo and stock TRL step on the file's weights (saved once as a
    folder both load), the prompts as text (the tiny tokenizer has no chat template), stopping at its own EOS."""
    skip_below_transformers("5.18", "reading a GGUF tokenizer with an EOS id but no BOS id")
    pytest.importorskip("trl")
    out = subprocess.run([sys.executable, "-m", "fastgrpo.bench.step", "--quick", "--device", "cpu", "--model",
                          tiny_gguf[0], "--out-dir", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (json_path,) = tmp_path.glob("step-*.json")
    rows = json.loads(json_path.read_text())["rows"]
    assert [row["method"] for row in rows] == ["trl", "fastgrpo"]
    for row in rows:
        assert "error" not in row, row
        assert row["model"] == tiny_gguf[0] and row["shape"] == "tiny.gguf" and row["generated_tokens"] > 0, row


def test_smollm2_recipe_and_its_data():
    """recipes/smollm2-arithmetic.yaml is a valid config once given the model, and its data is every a+b= with
    a, b in [0, 20], split by the built-in task's rule."""
    root = Path(__file__).resolve().parents[1]
    config = TrainConfig.from_yaml(root / "recipes" / "smollm2-arithmetic.yaml", model_name_or_path="model.gguf")
    assert config.use_peft and config.dataset_name == "recipes/data/addition-0-20"
    for split in ("train", "test"):
        text = (root / config.dataset_name / f"{split}.jsonl").read_text()
        expected = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(21) for b in range(21)
                    if arithmetic._in_test_split(a, b) == (split == "test")]
        assert list(map(json.loads, text.splitlines())) == expected
