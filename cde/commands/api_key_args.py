"""The API key on the command line of the server (`serve`, `gateway`: the key it requires) and of
its clients (`bench serve`, `bench soak`, `eval --url`: the key they send), one rule for both:
from $CDE_API_KEY or `--api-key-file FILE`, never `--api-key KEY`, which every local user could
read in /proc/PID/cmdline."""

from __future__ import annotations

import argparse
import os
from typing import Any

ENV = "CDE_API_KEY"


def add_api_key_arguments(p: argparse.ArgumentParser, use: str) -> None:
    """`use`: what the key does, e.g. "require `Authorization: Bearer KEY`"."""
    p.add_argument(
        "--api-key-file",
        dest="api_key",
        type=_read_key,
        metavar="FILE",
        help=f"{use}, KEY read from FILE (default: env {ENV}, never shown here)",
    )
    p.add_argument("--api-key", action=_RefuseKeyOnCommandLine, nargs="?", help=argparse.SUPPRESS)


def api_key(args: argparse.Namespace) -> str | None:
    """The key of --api-key-file, else $CDE_API_KEY (read here, not as the flag's default:
    argparse would pass a default through the flag's file reader)."""
    return args.api_key or os.environ.get(ENV) or None


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


class _RefuseKeyOnCommandLine(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error(
            "--api-key is not accepted on the command line (every local user can read it in "
            f"/proc/PID/cmdline): set {ENV} or give --api-key-file FILE"
        )


def _read_key(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the API key: {exc}") from None
    if not key:
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return key
