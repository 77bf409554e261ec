"""`fastgrpo` command line: `fastgrpo train [options]`, `fastgrpo plan [options]`, `fastgrpo check [options]`,
`fastgrpo bench [<suite>] [options]`."""

import argparse
import importlib
import sys

from fastgrpo import __version__
from fastgrpo.train import cli as train_cli

# `fastgrpo bench <suite>`: each suite's module (its add_arguments and run), imported only when `fastgrpo bench` runs
SUITES = {"loss": "fastgrpo.bench.loss", "sampling": "fastgrpo.bench.sampling", "trl": "fastgrpo.bench.trl_step",
          "step": "fastgrpo.bench.step", "cpu-memory": "fastgrpo.bench.cpu_memory",
          "decode-bytes": "fastgrpo.bench.decode_bytes", "memory-plan": "fastgrpo.bench.memory_plan",
          "agent": "fastgrpo.bench.agent_rollout", "architectures": "fastgrpo.bench.architectures",
          "windows": "fastgrpo.bench.windows", "routing-replay": "fastgrpo.bench.routing_replay"}
DEFAULT_SUITE = "loss"


class Parser(argparse.ArgumentParser):
    """argparse's errors as one line (its usage of every option runs to 50 lines), pointing to --help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(prog="fastgrpo", description="fastgrpo: fast, lean GRPO on one GPU node")
    parser.add_argument("--version", action="version", version=f"fastgrpo {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a causal LM with GRPO (built-in default task without options)",
                                description=train_cli.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    train_cli.add_arguments(train)
    plan = commands.add_parser("plan", help="the memory plan of a training run: peak memory per phase, and what fits",
                               description=train_cli.PLAN_DESCRIPTION,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    train_cli.add_plan_arguments(plan)
    check = commands.add_parser("check", help="check fastgrpo on this machine: kernels, engine, loss, a train step, "
                                "timings (PASS / FAIL, one results file)")
    if argv[:1] == ["check"]:
        from fastgrpo.check import command as check_command

        check.description = check_command.__doc__
        check.formatter_class = argparse.RawDescriptionHelpFormatter
        check_command.add_arguments(check)
    bench = commands.add_parser("bench", help="run a benchmark suite: print a table, write .json and .md results",
                                description=f"Without a suite: the {DEFAULT_SUITE} suite (`fastgrpo bench --quick` is "
                                            "its CPU quick mode).")
    bench.add_argument("--quick", action="store_true", help=f"without a suite: the {DEFAULT_SUITE} suite's quick mode")
    suites = bench.add_subparsers(dest="suite")
    if argv[:1] == ["bench"]:
        add_suites(suites, chosen=argv[1] if len(argv) > 1 and argv[1] in SUITES else None)
    args = parser.parse_args(argv)
    if args.command == "train":
        train_cli.run(args, train)
    elif args.command == "plan":
        train_cli.run_plan(args, plan)
    elif args.command == "check":
        from fastgrpo.check import command as check_command

        check_command.run(args)
    elif args.suite is None:
        main(["bench", DEFAULT_SUITE, *(["--quick"] if args.quick else [])])
    else:
        importlib.import_module(SUITES[args.suite]).run(args)


def add_suites(suites, chosen: str | None) -> None:
    """The suites' parsers: the `chosen` suite's arguments alone (only its module is imported), or every suite's (the
    help of `fastgrpo bench`)."""
    for name, module in SUITES.items():
        if chosen is not None and name != chosen:
            suites.add_parser(name)
            continue
        suite = importlib.import_module(module)
        suite.add_arguments(suites.add_parser(name, help=suite.__doc__.splitlines()[0], description=suite.__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))


if __name__ == "__main__":
    main()
