"""A run's options on disk: config.yaml holds the options in force; a resumed run whose options changed keeps the
earlier ones in config_history.yaml, so that the run still records how its first steps ran.

    config_history.yaml     - until_step: 2          the options of steps 1-2 (the first resume that changed any)
                              config: {...}
                            - until_step: 5          the options of steps 3-5 (the next such resume)
                              config: {...}
"""

from pathlib import Path

import yaml

from fastgrpo.train.config import TrainConfig, flag

CONFIG_FILE = "config.yaml"
HISTORY_FILE = "config_history.yaml"
# How a run was started, not how it trains: a resume passes them without changing the run.
NOT_OPTIONS = ("resume", "overwrite_output_dir", "output_dir")


def changed_options(saved: dict, config: TrainConfig) -> dict[str, tuple]:
    """{option: (the saved value, the new one)} for every option that differs (values compared as YAML holds them)."""
    new = yaml.safe_load(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return {name: (saved.get(name), value) for name, value in new.items()
            if name not in NOT_OPTIONS and saved.get(name) != value}


def record(output_dir: Path, config: TrainConfig, resumed_step: int | None) -> str | None:
    """Writes config.yaml. On resume at `resumed_step`, when options changed, first appends the earlier config.yaml to
    config_history.yaml (with the last step it ran); returns the one line that says what changed, else None."""
    path = Path(output_dir) / CONFIG_FILE
    said = None
    if resumed_step is not None and path.is_file():
        saved = yaml.safe_load(path.read_text()) or {}
        changes = changed_options(saved, config)
        if changes:
            history = Path(output_dir) / HISTORY_FILE
            entries = yaml.safe_load(history.read_text()) if history.is_file() else []
            # Steps past resumed_step are run again: the entries of their options go. An entry that ends at
            # resumed_step already holds how the run got here (config.yaml then ran no step that a checkpoint kept).
            kept = [e for e in entries or [] if e["until_step"] <= resumed_step]
            if not any(e["until_step"] == resumed_step for e in kept):
                kept.append({"until_step": resumed_step, "config": saved})
            history.write_text(yaml.safe_dump(kept, sort_keys=False))
            listed = ", ".join(f"{flag(name)} {old!r} -> {new!r}" for name, (old, new) in changes.items())
            said = (f"fastgrpo train: resuming at step {resumed_step} with changed options: {listed}; steps up to "
                    f"{resumed_step} ran with the earlier ones, kept in {history}")
    config.save_yaml(path)
    return said
