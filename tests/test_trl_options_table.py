"""The README's "Coming from TRL" table names every option TRL 1.16's GRPOConfig adds to TrainingArguments (and the
two it redefines); an option it calls "the same" is a TrainConfig field of that name, one it refuses is refused in
one line with the reason, as a YAML key and as a flag."""

import dataclasses
import re
from pathlib import Path

import pytest
import trl
from transformers import TrainingArguments

from fastgrpo.cli import main
from fastgrpo.train.config import TRL_ONLY, TrainConfig, flag

README = Path(__file__).resolve().parents[1] / "README.md"
OWN = sorted({f.name for f in dataclasses.fields(trl.GRPOConfig)} - {f.name for f in dataclasses.fields(
    TrainingArguments)} | {"learning_rate", "remove_unused_columns"})


def table() -> list[tuple[list[str], str]]:
    text = README.read_text()
    section = text[text.index("### Coming from TRL: every `GRPOConfig` option"):]
    section = section[: section.index("\n## ")]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `") and "GRPOConfig" not in line]
    return [(re.findall(r"`(\w+)`", left), right) for left, right in rows]


def test_every_grpo_config_option_is_in_the_table():
    named = [name for names, _ in table() for name in names]
    assert sorted(set(named) & set(OWN)) == OWN
    assert len(named) == len(set(named)), "an option in two rows"


def test_the_same_options_are_options_and_the_refused_ones_are_refused():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for names, said in table():
        if said.startswith("the same option"):
            assert set(names) <= fields, set(names) - fields
        else:
            assert set(names) <= set(TRL_ONLY), set(names) - set(TRL_ONLY)
    assert set(TRL_ONLY) | (set(OWN) & fields) == set(OWN)


@pytest.mark.parametrize("name", sorted(TRL_ONLY))
def test_a_trl_only_option_is_one_line_with_its_reason(name, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", flag(name), "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{flag(name)}: a TRL option fastgrpo train does not take: " in err
    assert TRL_ONLY[name] in err
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: builtin\ndataset_name: builtin\n{name}: 1\n")
    with pytest.raises(ValueError, match=f"{name}: a TRL option fastgrpo train does not take"):
        TrainConfig.from_yaml(config)
