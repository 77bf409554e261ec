"""`fastgrpo train`: options generated from TrainConfig's fields, on top of a YAML config or the built-in recipe."""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import sys
import threading
import typing
from pathlib import Path

import yaml

from fastgrpo.sizes import parse_size
from fastgrpo.train import distributed
from fastgrpo.train.config import BUILTIN, DEFAULT_RECIPE, TRL_ONLY, TrainConfig, field_types, flag
from fastgrpo.train.distributed import RankFailed

DESCRIPTION = """\
Train a causal LM with GRPO on one device, or on several processes started by torchrun.

  fastgrpo train                                   the built-in arithmetic task on a tiny model (CPU: < 5 min)
  fastgrpo train --config recipes/gsm8k.yaml       a recipe; any option below overrides it
  fastgrpo train --output-dir runs/a --resume      continue a run from its newest checkpoint
  torchrun --nproc-per-node 8 -m fastgrpo train --config recipes/gsm8k.yaml
                                                   8 GPUs (FSDP2; --parallelism ddp for small models): each samples
                                                   and trains on its share of the same global batch

Without --config, and without --model-name-or-path, the built-in recipe (fastgrpo/train/default.yaml) is the base:
its values are shown as [built-in recipe: ...] where they differ from the defaults. With --resume and no --config,
the run's own config.yaml is.
"""


def _none_or(parse):
    return lambda text: None if text.lower() in ("none", "null") else parse(text)


def _json_object(text: str) -> dict:
    """A dict option's value on the command line: a JSON object (TRL's parser takes the same)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def _default_help(f: dataclasses.Field, recipe: dict) -> str:
    """An option's help with its one default: TrainConfig's, and where the built-in recipe (what a bare `fastgrpo
    train` runs) sets another value, that one too, said as such."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    said = f.metadata["help"]
    if "default:" not in said:  # (a help that explains its default itself keeps its own words)
        said += f" (default: {default})"
    if f.name in recipe and recipe[f.name] != default:
        said += f" [built-in recipe: {recipe[f.name]}]"
    return said


class _TRLOnly(argparse.Action):
    """A TRL GRPOConfig flag that fastgrpo train does not take: refused with the reason (config.TRL_ONLY)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: a TRL option fastgrpo train does not take: {TRL_ONLY[self.dest]}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML file of options (e.g. recipes/gsm8k.yaml)")
    recipe = yaml.safe_load(DEFAULT_RECIPE.read_text())
    for f in dataclasses.fields(TrainConfig):
        kind, optional = field_types()[f.name]
        names = [f"--{f.name.replace('_', '-')}", *f.metadata.get("aliases", ())]
        kwargs = {"dest": f.name, "default": argparse.SUPPRESS, "help": _default_help(f, recipe)}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind is dict:
            kwargs.update(type=_none_or(_json_object), metavar="JSON")
        elif typing.get_origin(kind) is typing.Union:  # str | dict: a JSON object, or the text as it is
            kwargs.update(type=_none_or(lambda text: _json_object(text) if text.lstrip().startswith("{") else text),
                          metavar="STR|JSON")
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            kwargs.update(nargs="+", type=item, metavar=item.__name__.upper())
        else:
            kwargs.update(type=_none_or(kind) if optional else kind, metavar=kind.__name__.upper())
            if f.metadata.get("choices"):
                kwargs.update(choices=f.metadata["choices"], metavar="{" + ",".join(f.metadata["choices"]) + "}")
        parser.add_argument(*names, **kwargs)
    for name in TRL_ONLY:
        parser.add_argument(flag(name), dest=name, nargs="?", action=_TRLOnly, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "command", "func")}
    if args.config is not None:
        return TrainConfig.from_yaml(args.config, **overrides)
    if overrides.get("resume") and overrides.get("output_dir"):
        saved = Path(overrides["output_dir"]) / "config.yaml"
        if not saved.is_file():
            raise FileNotFoundError(f"--resume: {saved} is missing, so the run's options are unknown; restore it, or "
                                    "pass the run's options with --config")
        # overwrite_output_dir is how the run started, not an option of the run: it does not carry over
        return TrainConfig.from_yaml(saved, **{"overwrite_output_dir": False, **overrides})
    if "model_name_or_path" not in overrides:
        if os.environ.get("RANK", "0") == "0":  # one line, not one per process under torchrun
            print(f"fastgrpo {args.command}: no --config: the built-in arithmetic recipe ({DEFAULT_RECIPE})",
                  file=sys.stderr)
        return TrainConfig.from_yaml(DEFAULT_RECIPE, **overrides)
    return TrainConfig(**overrides)


def flagged(error: Exception) -> str:
    """An error of fastgrpo's checks in the words a command-line user typed: the options it names as flags
    (max_steps -> --max-steps; a one-word option only where the message starts with it)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    text = re.sub(r"(?<!['\w])[a-z0-9]+(?:_[a-z0-9]+)+(?!['\w])", lambda m: flag(m[0]) if m[0] in fields else m[0],
                  str(error))  # (a quoted name stays: it is a YAML key or a value)
    first = re.match(r"([a-z0-9]+)(?=[: ])", text)
    return flag(first[1]) + text[first.end():] if first and first[1] in fields else text


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so that the run stops the same way."""


@contextlib.contextmanager
def _sigterm_raises():
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set signal handlers
        yield
        return

    def terminated(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped_message(trainer, stop: KeyboardInterrupt) -> str:
    """What Ctrl-C or SIGTERM prints instead of a traceback: where the last checkpoint is and how to resume."""
    how = "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C"
    if trainer is None:
        return f"fastgrpo train: stopped by {how} before training began\n"
    from fastgrpo.train import checkpoint

    out, last = trainer.output_dir, checkpoint.latest(trainer.output_dir)
    if last is None:
        return (f"fastgrpo train: stopped by {how} before the first checkpoint, so there is nothing to resume in "
                f"{out}; to start over, run the same command with --overwrite-output-dir\n")
    resume = shlex.join(["fastgrpo", "train", "--output-dir", str(out), "--resume"])
    return f"fastgrpo train: stopped by {how}; the last checkpoint is {last}; resume with:\n  {resume}\n"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    if os.getcwd() not in sys.path:  # `module:function` options import from the working directory, as TRL's CLI does
        sys.path.insert(0, os.getcwd())  # (`python -m fastgrpo` has it there already; the console script does not)
    try:
        config = resolve_config(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.exit(2, f"fastgrpo train: error: {flagged(e)}\n")
    import datasets
    from transformers.utils import logging

    from fastgrpo.train.finite import NonFiniteError
    from fastgrpo.train.rewards import RewardError
    from fastgrpo.train.tools import RolloutError

    datasets.disable_progress_bars()  # the run has its own progress bar
    logging.disable_progress_bar()
    trainer, finished = None, False
    with _sigterm_raises():
        try:
            trainer = _trainer(config, parser)
            summary = trainer.train()
            finished = True
            return summary
        except KeyboardInterrupt as stop:
            status = 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)  # the shell's codes
            parser.exit(status, stopped_message(trainer, stop))
        except RankFailed as failed:  # another process's error, which that process prints with its traceback
            parser.exit(1, f"fastgrpo train: error: {failed}\n")
        except (RewardError, RolloutError, NonFiniteError) as error:  # a reward, rollout_func or environment that
            parser.exit(1, f"fastgrpo train: error: {flagged(error)}\n")  # raised or returned nonsense; NaN or inf
        finally:
            trainer = None  # its DDP / FSDP2 wrappers go before the process group (distributed.leave)
            distributed.leave(finished)


PLAN_DESCRIPTION = """\
The memory plan of a `fastgrpo train` run: each phase's peak device memory (sampling, no-grad logprobs, a training
micro-batch) predicted from the model's config alone (no weights are downloaded or allocated), and whether it fits.

  fastgrpo plan --model-name-or-path Qwen/Qwen2.5-7B-Instruct --use-peft --load-in-4bit --gpu-memory 16GiB
  fastgrpo plan --config recipes/gsm8k.yaml --gpu-memory 24GiB --auto-fit    the settings --auto-fit would pick

Takes every option of `fastgrpo train`. Plans are for one process (under FSDP2 each GPU holds a share of the
weights and states). How each figure is computed: benchmarks/NOTES.md, "Memory plan".
"""


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="the device to plan for (default: cuda); on cpu the loss's chunks are a CPU's")


def run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Prints the plan (with --auto-fit, of the settings it picks); exits 1 when a gpu_memory is given and the plan
    does not fit it."""
    from fastgrpo.train import plan as memory
    from fastgrpo.train.loading import model_config

    device = args.device
    del args.device
    if "dataset_name" not in vars(args) and args.config is None:
        args.dataset_name = BUILTIN  # a plan reads no data; the option is required only to train
    try:
        config = resolve_config(args)
        gpu = parse_size(config.gpu_memory) if config.gpu_memory is not None else None
        shapes = memory.model_shapes(model_config(config))
        plan = memory.plan_run(config, shapes, device, gpu)
    except (ValueError, TypeError, OSError, ImportError) as e:
        parser.exit(2, f"fastgrpo plan: error: {flagged(e)}\n")
    model = "the built-in model" if config.model_name_or_path == BUILTIN else config.model_name_or_path
    print(f"fastgrpo plan: {model} on {device}, {config.num_generations} completions of "
          f"{config.max_completion_length} tokens per prompt, {config.generation_batch_size} per round")
    print(memory.format_plan(plan, gpu))
    if gpu is None:
        print("no --gpu-memory given: pass the device's memory (e.g. --gpu-memory 24GiB) to check that it fits")
    if config.auto_fit:
        picks = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in memory.fitted(config, plan).items())
        print("--auto-fit picks: " + picks)
    if gpu is not None and not plan.fits(gpu):
        smaller = memory.what_would_fit(config, shapes, device, gpu)
        parser.exit(1, f"fastgrpo plan: does not fit; {smaller}; or --auto-fit\n")


def _trainer(config: TrainConfig, parser: argparse.ArgumentParser):
    """The Trainer; an error found while it checks the output folder and loads is one line, not a traceback."""
    from fastgrpo.train.trainer import Trainer

    try:
        return Trainer(config)
    except (ValueError, TypeError, OSError, ImportError) as e:
        parser.exit(2, f"fastgrpo train: error: {flagged(e)}\n")
