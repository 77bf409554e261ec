"""The 2026 model families in `fastgrpo train`: tiny random models built from transformers' configs (family_helpers)
load, score their completions with the fused head as their own forward does, and train through the CLI.

Families: Gemma (1), Gemma 2 and 3 (final-logit softcap, sliding windows), Gemma 4, gpt-oss (sinks, windows,
experts), Mistral (windows), Cohere (logit scale) and the MoE families Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE.
"""

import torch
from family_helpers import save_tiny_model

from fastgrpo.cli import main
from fastgrpo.train.logs import read_metrics

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
