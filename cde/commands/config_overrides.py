"""`--set KEY=VALUE`: config values replacing a preset's when a command writes a random-weight
checkpoint (`make-model`, `bench engine --preset`), e.g. a longer context or fewer layers."""

from __future__ import annotations

import argparse


def add_config_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value of the preset, e.g. --set n_layers=4 --set block_size=131072",
    )


def config_overrides(args: argparse.Namespace) -> dict[str, int | str]:
    pairs = dict(kv.split("=", 1) for kv in args.set)
    return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in pairs.items()}
