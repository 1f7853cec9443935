"""CURVE key pairs for gateway <-> worker links across machines (docs/operations.md, "Deployment").

`cde keys generate DIR` writes worker.key / worker.key_secret and gateway.key / gateway.key_secret.
Workers get worker.key_secret and the gateways' *.key; gateways get their .key_secret and worker.key."""

from __future__ import annotations

import argparse
import re


def _name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", text):
        raise argparse.ArgumentTypeError(f"key names are letters, digits, '_', '.', '-': {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    gen = sub.add_parser("generate", help="write CURVE key pairs (NAME.key public, NAME.key_secret private)")
    gen.add_argument("directory")
    gen.add_argument(
        "--name",
        action="append",
        type=_name,
        metavar="NAME",
        help="key pair to write (repeatable; default: worker and gateway)",
    )
    gen.add_argument("--force", action="store_true", help="overwrite existing key files")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cde.shared.curve import generate

    names = args.name or ["worker", "gateway"]
    existing = [str(f) for n in names for f in Path(args.directory).glob(f"{n}.key*")]
    if existing and not args.force:
        raise SystemExit(f"cde keys: refusing to overwrite {', '.join(sorted(existing))} (use --force)")
    for name in names:
        public, secret = generate(args.directory, name)
        print(f"{name}: public {public}, secret {secret}")
    return 0
