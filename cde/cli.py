"""`cde` command line: one subcommand per module under `cde/commands/`.

Only the chosen command's module is imported, so `cde gateway` and `cde serve` never load torch."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import signal
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NoReturn

from cde.cli_errors import add_debug_argument, run_reporting_errors, take_debug_flag
from cde.shared.home import use_compile_caches
from cde.worker.cpu_threads import use_huge_pages

STARTED = time.monotonic()  # the process's start, near enough: what "ready in" counts from

# name -> (module in cde.commands, one-line help); each module has `add_arguments(parser)` and
# `run(args) -> int`.
COMMANDS = {
    "serve": ("serve", "start the gateway and worker processes (OpenAI-compatible HTTP API)"),
    "gateway": ("gateway", "run only the HTTP gateway, in front of workers started elsewhere"),
    "worker": ("worker", "run only one engine worker process, bound to a ZeroMQ endpoint"),
    "generate": ("generate", "generate from one prompt with the offline engine (no server)"),
    "make-model": ("make_model", "write a random-weight Steerling checkpoint of a preset shape"),
    "keys": ("keys", "`keys generate DIR`: CURVE key pairs for encrypted gateway <-> worker links"),
    "bench": ("bench", "benchmarks: `bench engine` (offline) and `bench serve` (HTTP load)"),
    "eval": ("eval", "quality of a trained model: held-out accuracy per decoding setting, steering, attribution"),
}


class Parser(argparse.ArgumentParser):
    """A flag mistake is one line naming the command, as every other error is (exit status 2,
    argparse's own for usage errors), not the whole usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the flags)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        # A command's parser refuses what it does not know itself, naming the command whose --help
        # lists its flags (argparse hands a subcommand's leftovers to `cde`, whose help does not).
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self.prog != "cde":
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


class _Version(argparse._VersionAction):
    """Looked up only when asked: a source tree run without an install (scripts/gpu_run.sh) has no
    package metadata, and every other command must still run there."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        try:
            installed = version("cde")
        except PackageNotFoundError:
            installed = "(not installed: a source tree)"
        print(f"cde {installed}")
        parser.exit(0)


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the help already says it: its value, or
    "off" for a switch. An option that is unset by default (None) says in its own words what
    that means (`tests/cli/test_help_defaults.py` holds every command to it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default in (None, argparse.SUPPRESS) or "default" in text:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return text + " (default: off)"
        return text + " (default: %(default)s)"


def main(argv: list[str] | None = None) -> int:
    argv = take_debug_flag(sys.argv[1:] if argv is None else argv)
    # Before any command imports torch: compiled kernels are kept under CDE_HOME and reused, and
    # large CPU tensors come in huge pages.
    use_compile_caches()
    use_huge_pages()
    # `kill -USR1 PID` writes every thread's Python stack to stderr and the process runs on: how
    # a worker or gateway that seems stuck shows where it is (docs/operations.md, "Errors").
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser, module = build_parser(chosen)
    args = parser.parse_args(argv)
    return run_reporting_errors(args.command, module.run, args)


def build_parser(chosen: str | None) -> tuple[argparse.ArgumentParser, Any]:
    """The parser, with the arguments of the `chosen` command only (and that command's module)."""
    parser = Parser(prog="cde", description="CDE, the Causal Diffusion Engine", formatter_class=HelpFormatter)
    parser.add_argument("--version", action=_Version)
    add_debug_argument(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    module = None
    for name, (mod, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        if name == chosen:
            module = importlib.import_module(f"cde.commands.{mod}")
            p.description = module.__doc__
            add_debug_argument(p)
            module.add_arguments(p)
    return parser, module


if __name__ == "__main__":
    sys.exit(main())
