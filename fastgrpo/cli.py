"""`fastgrpo` command line: `fastgrpo bench <suite>`."""

import argparse

from fastgrpo.bench import sampling

SUITES = {"sampling": sampling}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fastgrpo", description="fastgrpo: fast, lean GRPO on one GPU")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark suite: print a table, write .json and .md results")
    suites = bench.add_subparsers(dest="suite", required=True)
    for name, suite in SUITES.items():
        suite.add_arguments(suites.add_parser(name, help=suite.__doc__.splitlines()[0], description=suite.__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    SUITES[args.suite].run(args)


if __name__ == "__main__":
    main()
