"""`python -m jaxdp.bench COMMAND ...`: one subcommand per benchmark module (jaxdp/bench/__init__.py
lists them)."""

from __future__ import annotations

import argparse
import sys

from jaxdp import bench
from jaxdp.bench import (budget, collectives, compression, data, ddp, dispatch, goodput, gpt, hierarchy, localsgd, memory,
                         nanogpt, pace, plan, quality, saves, slowlink, train, variants, zero)
from jaxdp.cluster.malloc_env import reexec_if_needed

# Each registers its subcommands, with `run` (args -> list of result dicts) as their default.
BENCHMARKS = (collectives, gpt, train, ddp, zero, slowlink, hierarchy, variants, dispatch, compression, localsgd, pace, goodput, saves,
              plan, nanogpt, quality, data, memory, budget)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxdp.bench", description=bench.__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for benchmark in BENCHMARKS:
        benchmark.register(subparsers)
    # argparse names every choice in the usage; name only those with a help line (not the workers).
    subparsers.metavar = "{" + ",".join(action.dest for action in subparsers._choices_actions) + "}"
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run this process's command line (argv None) or `argv`; only the former may re-exec the
    process with the malloc environment (jaxdp/cluster/malloc_env.py), as its first act, before JAX loads."""
    if argv is None:
        reexec_if_needed()
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
