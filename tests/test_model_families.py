"""The 2026 model families in `fastgrpo train`: tiny random models built from transformers' configs (family_helpers)
load, score their completions with the fused head as their own forward does, and train through the CLI.

Families: Gemma (1), Gemma 2 and 3 (final-logit softcap, sliding windows), Gemma 4, gpt-oss (sinks, windows,
experts), Mistral (windows), Cohere (logit scale), the MoE families Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, and the
hybrids (recurrent layers beside attention) Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Nemotron-H, Granite-4.0-H, LFM2.
"""

import math
from pathlib import Path

import pytest
import torch
from family_helpers import FAMILIES, GEMMA4_KV_SHARED, GEMMA4_MOE, HYBRIDS, MOE, WINDOW, save_tiny_model, tiny_model
from safetensors.torch import load_file

from fastgrpo.cli import main
from fastgrpo.loss import token_logprobs
from fastgrpo.train.loading import PLAIN_HEAD, check_head
from fastgrpo.train.logs import read_metrics
from fastgrpo.train.policy_loss import completion_hidden, lm_head

# A run of 3 rounds of 8 completions (2 prompts x 4) on the built-in arithmetic task, 4 held-out prompts.
SHORT_RUN = ["--dataset-name", "builtin", "--num-generations", "4", "--per-device-train-batch-size", "8",
             "--max-completion-length", "4", "--max-steps", "3", "--save-steps", "0", "--eval-num-samples", "4",
             "--report-to", "none", "--disable-tqdm", "--learning-rate", "1e-2"]


def train_from_cli(model: str, run, *options: str) -> list[dict]:
    """`fastgrpo train` on `model` for SHORT_RUN plus `options`; the run's metrics rows."""
    main(["train", "--model-name-or-path", model, "--output-dir", str(run), *SHORT_RUN, *options])
    return read_metrics(run)


# -- loading --------------------------------------------------------------------------------------------------------


def test_moe_model_trains_from_the_cli(tmp_path, capsys):
    """Issue 40: a Qwen3-MoE crashed at load (check_head's probe returned no router_logits, which its forward reads)."""
    model = save_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    rows = train_from_cli(model, tmp_path / "run")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert "held-out accuracy" in capsys.readouterr().out
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in rows[1:])


# -- the fused head: each family's logit transform -------------------------------------------------------------------

# family -> the transform check_head must find: Gemma 2/3/4 cap their final logits at 30, Cohere scales them.
HEADS = {family: {"logit_scale": 1.0, "logit_softcap": None} for family in FAMILIES}
HEADS.update({family: {"logit_scale": 1.0, "logit_softcap": 30.0} for family in ("gemma2", "gemma3_text",
                                                                                  "gemma4_text")})
HEADS["cohere"] = {"logit_scale": 0.25, "logit_softcap": None}
# their configs tie the head to the embeddings
TIED = ("gemma", "gemma2", "gemma3_text", "gemma4_text", "cohere", "lfm2")
# The head's weight is scaled so that the logits reach about +-60 (a random tiny model's stay within +-1): a cap of 30
# bends them by more than 1 nat there, so the check below that the plain head is wrong can fail, and the softmax is
# not saturated either.
LOGIT_SPAN = 60.0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_head_scores_as_the_models_own_logits(family, temperature):
    """fastgrpo's token logprobs from the backbone's hidden states and the lm_head (with check_head's transform) equal
    log_softmax(the model's own logits / temperature), fp32, on a sequence longer than the sliding windows."""
    model = tiny_model(family)
    sequence, prompt = [(7 * i + 3) % 16 for i in range(3 * WINDOW)], 5
    completion = torch.tensor(sequence[prompt:])  # [T]
    with torch.no_grad():
        own = model(input_ids=torch.tensor([sequence])).logits  # [1, L, V]
        model.get_output_embeddings().weight.mul_(LOGIT_SPAN / own.abs().max())
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == (family in TIED)
    head = check_head(model)
    assert head == HEADS[family]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sequence])).logits[0, prompt - 1 : -1]  # [T, V]
        want = (logits / temperature).log_softmax(-1).gather(-1, completion[:, None])[:, 0]  # [T]
        hidden = completion_hidden(model, [sequence], [prompt], len(completion), packed=False)[0]  # [T, H]
        weight, bias = lm_head(model)
        ours = token_logprobs(hidden, weight, completion, bias=bias, temperature=temperature, **head)[0]
        plain = token_logprobs(hidden, weight, completion, bias=bias, temperature=temperature)[0]
    assert logits.abs().max() > 20  # the transform matters at this scale (a tied head scales the embeddings too)
    # fp32: the same GEMM in another summation order, then exp/log over logits of ~60
    assert torch.allclose(ours, want, rtol=0, atol=1e-4), (ours - want).abs().max()
    if head != PLAIN_HEAD:
        assert (plain - want).abs().max() > 0.1


# -- 3 steps through the CLI -------------------------------------------------------------------------------------------

# name -> (model_type, options on top of family_helpers' FAMILIES)
TRAINED = {
    **{family: (family, {}) for family in ("gemma", "gemma2", "gemma3_text", "gemma4_text", "gpt_oss", "mistral",
                                           "qwen3_moe", "mixtral", "olmoe", "qwen2_moe")},
    "gemma4_moe": ("gemma4_text", GEMMA4_MOE),
    "gemma4_kv_shared": ("gemma4_text", GEMMA4_KV_SHARED),
    **{family: (family, {}) for family in HYBRIDS},
}
WITH_EXPERTS = (*MOE, "gemma4_moe", "qwen3_5_moe_text", "qwen3_next", "nemotron_h", "granitemoehybrid")
# The length reward varies across the random models' completions (the accuracy reward is 0 for all), so advantages,
# and the updates, are not zero; beta 0.04 runs the reference (a copy, or with LoRA the base, adapters off).
SWEEP = ["--reward-funcs", "accuracy", "length", "--beta", "0.04", "--gradient-checkpointing"]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", TRAINED)
def test_family_trains_three_steps_from_the_cli(tmp_path, family, lora):
    """`fastgrpo train` 3 steps with gradient checkpointing, full fine-tuning or LoRA (on the experts too, which needs
    lora_dropout 0, and with routing replay): every step's loss finite, and the weights it trains changed by the
    end."""
    model_type, extra = TRAINED[family]
    model = save_tiny_model(model_type, tmp_path / "model", **extra)
    options = []
    if lora:
        options = ["--use-peft", "--lora-r", "4", *(["--lora-dropout", "0"] if family in WITH_EXPERTS else [])]
    if lora and family in WITH_EXPERTS:  # LoRA runs replay the sampler's routes (full runs only compare them)
        options.append("--routing-replay")
    rows = train_from_cli(model, tmp_path / "run", *SWEEP, *options)
    if family in WITH_EXPERTS:  # every step measures the trainer's routes against the sampler's (fp32: the same)
        assert all(row["routing/mismatch"] == 0 for row in rows[1:])
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in rows[1:])
    assert any(row["grad_norm"] > 0 for row in rows[1:])
    (final,) = [path for path in (tmp_path / "run").iterdir() if path.name.startswith("checkpoint-")]
    if lora:
        adapters = load_file(final / "adapter_model.safetensors")
        trained = [name for name in adapters if "lora_B" in name]
        assert trained and all(adapters[name].abs().max() > 0 for name in trained)  # lora_B starts at zero
        if family in WITH_EXPERTS:
            assert any(".experts." in name for name in trained)
    else:
        before, after = load_file(Path(model) / "model.safetensors"), load_file(final / "model.safetensors")
        assert sum(not torch.equal(before[name], after[name]) for name in before) > len(before) // 2
