"""pyproject.toml ships every subpackage and the built-in model: an editable install would hide a missing one."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_and_the_default_model_are_packaged():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {"fastgrpo.kernels"} | {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fastgrpo").rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == found
    data = setuptools["package-data"]["fastgrpo.train"]
    assert "default.yaml" in data and "default_model/*" in data
    assert (ROOT / "fastgrpo" / "train" / "default_model" / "model.safetensors").is_file()


def test_the_benchmarks_model_configs_are_packaged():
    """`fastgrpo bench memory-plan` and `decode-bytes` read fastgrpo/bench/models/<name>/config.json: package data."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-data"]["fastgrpo.bench"] == ["models/*/config.json"]
    names = {p.parent.name for p in (ROOT / "fastgrpo" / "bench" / "models").glob("*/config.json")}
    assert names == {"qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-8b", "gpt-oss-20b", "gemma-3-12b", "gemma-4-e2b",
                     "qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-30b-a3b"}
