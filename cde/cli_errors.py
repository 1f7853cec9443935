"""How a `cde` command reports an error: one line on stderr naming the command, exit status 1, and
the traceback only when asked (`--debug` anywhere on the command line, or CDE_DEBUG=1, which the
processes a command starts inherit)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable

DEBUG_ENV = "CDE_DEBUG"
DEBUG_HELP = f"on an error, print the full traceback, not one line (also {DEBUG_ENV}=1)"


def take_debug_flag(argv: list[str]) -> list[str]:
    """`argv` without `--debug`, which may sit before or after the (sub)command; when it was there,
    CDE_DEBUG=1 is set so that workers `cde serve` starts report the same way."""
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"
    return [a for a in argv if a != "--debug"]


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def add_debug_argument(p: argparse.ArgumentParser) -> None:
    """Listed in --help; `take_debug_flag` removes it before argparse sees it."""
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)


def run_reporting_errors(
    command: str, run: Callable[[argparse.Namespace], int | None], args: argparse.Namespace
) -> int:
    try:
        return run(args) or 0
    except SystemExit as exc:  # the commands' own checks: a message, named here by the command
        if not isinstance(exc.code, str):
            raise
        if debugging():  # where the check was made, and what it caught (`from None` or not), above the line
            exc.__suppress_context__ = False
            traceback.print_exc()
        text = exc.code.removeprefix("cde: ")
        print(text if text.startswith(f"cde {command}") else f"cde {command}: {text}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C, or a signal a command maps to it (`cde serve`'s SIGTERM)
        print(f"cde {command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        if debugging():
            raise
        # ValueError and OSError are what bad input raises (a checkpoint, a path, a port): the
        # message says it all. Anything else is unexpected: its type helps a bug report.
        what = str(exc) if isinstance(exc, ValueError | OSError) else f"{type(exc).__name__}: {exc}"
        print(
            f"cde {command}: {what.splitlines()[0] if what else type(exc).__name__} "
            f"(--debug or {DEBUG_ENV}=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
