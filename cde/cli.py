"""`cde` command line: one subcommand per module under `cde/commands/`."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module in cde.commands; each module has `add_arguments(parser)` and `run(args) -> int`.
COMMANDS = {
    "make-model": "make_model",
    "generate": "generate",
    "serve": "serve",
    "gateway": "gateway",
    "worker": "worker",
    "bench": "bench",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cde", description="CDE, the Causal Diffusion Engine")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, mod in COMMANDS.items():
        module = importlib.import_module(f"cde.commands.{mod}")
        p = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0], description=module.__doc__)
        module.add_arguments(p)
        modules[name] = module
    args = parser.parse_args(argv)
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
