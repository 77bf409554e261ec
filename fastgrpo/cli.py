"""`fastgrpo` command line: `fastgrpo train [options]`, `fastgrpo bench <suite>`."""

import argparse

from fastgrpo.bench import sampling, trl_step
from fastgrpo.train import cli as train_cli

SUITES = {"sampling": sampling, "trl": trl_step}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fastgrpo", description="fastgrpo: fast, lean GRPO on one GPU")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a causal LM with GRPO (built-in default task without options)",
                                description=train_cli.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    train_cli.add_arguments(train)
    bench = commands.add_parser("bench", help="run a benchmark suite: print a table, write .json and .md results")
    suites = bench.add_subparsers(dest="suite", required=True)
    for name, suite in SUITES.items():
        suite.add_arguments(suites.add_parser(name, help=suite.__doc__.splitlines()[0], description=suite.__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    if args.command == "train":
        train_cli.run(args, train)
    else:
        SUITES[args.suite].run(args)


if __name__ == "__main__":
    main()
