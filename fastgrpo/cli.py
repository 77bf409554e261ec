"""`fastgrpo` command line: `fastgrpo train [options]`, `fastgrpo plan [options]`, `fastgrpo bench [<suite>]
[options]`."""

import argparse

from fastgrpo.bench import loss, sampling, step, trl_step
from fastgrpo.train import cli as train_cli

SUITES = {"loss": loss, "sampling": sampling, "trl": trl_step, "step": step}
DEFAULT_SUITE = "loss"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fastgrpo", description="fastgrpo: fast, lean GRPO on one GPU node")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a causal LM with GRPO (built-in default task without options)",
                                description=train_cli.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    train_cli.add_arguments(train)
    plan = commands.add_parser("plan", help="the memory plan of a training run: peak memory per phase, and what fits",
                               description=train_cli.PLAN_DESCRIPTION,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    train_cli.add_plan_arguments(plan)
    bench = commands.add_parser("bench", help="run a benchmark suite: print a table, write .json and .md results",
                                description=f"Without a suite: the {DEFAULT_SUITE} suite (`fastgrpo bench --quick` is "
                                            "its CPU quick mode).")
    bench.add_argument("--quick", action="store_true", help=f"without a suite: the {DEFAULT_SUITE} suite's quick mode")
    suites = bench.add_subparsers(dest="suite")
    for name, suite in SUITES.items():
        suite.add_arguments(suites.add_parser(name, help=suite.__doc__.splitlines()[0], description=suite.__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    if args.command == "train":
        train_cli.run(args, train)
    elif args.command == "plan":
        train_cli.run_plan(args, plan)
    elif args.suite is None:
        main(["bench", DEFAULT_SUITE, *(["--quick"] if args.quick else [])])
    else:
        SUITES[args.suite].run(args)


if __name__ == "__main__":
    main()
