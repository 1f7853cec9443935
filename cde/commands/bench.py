"""Benchmarks: `cde bench engine` (offline engine) and `cde bench serve` (HTTP load generator)."""

from __future__ import annotations

import importlib

SUBCOMMANDS = {"engine": "bench_engine", "serve": "bench_serve"}


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    for name, mod in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"cde.commands.{mod}")
        except ModuleNotFoundError:
            continue
        sp = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0], description=module.__doc__)
        module.add_arguments(sp)
        sp.set_defaults(bench_run=module.run)


def run(args) -> int:
    return args.bench_run(args)
