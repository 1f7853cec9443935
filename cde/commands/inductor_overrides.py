"""`cde bench engine --inductor KEY=VALUE`: a torch._inductor.config value set before the engine
compiles its blocks, so that a compiler option (e.g. `combo_kernels=True`, which launches
independent kernels as one) is measured against the default in one call without a code change.
Keys may be dotted (`triton.cudagraph_trees=False`); values are Python literals of the option's own
type; anything else is refused before a model is loaded."""

from __future__ import annotations

import argparse
import ast
from typing import Any

import torch._inductor.config as inductor_config


def add_inductor_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set torch._inductor.config.KEY to the Python literal VALUE before the engine compiles "
        "(an experiment beside the default, e.g. --inductor combo_kernels=True; default: none)",
    )


def parse_inductor_overrides(items: list[str]) -> dict[str, Any]:
    """{dotted key: value} for `KEY=VALUE` items; SystemExit with the reason for an unknown key, a
    value that is not a literal, or one of another type than the option's."""
    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--inductor {item!r}: expected KEY=VALUE")
        if not hasattr(inductor_config, key):  # the config module resolves dotted keys itself
            raise SystemExit(f"--inductor {item!r}: torch._inductor.config has no option {key!r}")
        current = getattr(inductor_config, key)
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--inductor {item!r}: {text!r} is not a Python literal") from None
        if current is not None and type(value) is not type(current):
            raise SystemExit(f"--inductor {item!r}: {key} takes a {type(current).__name__}, not {text!r}")
        overrides[key] = value
    return overrides


def apply_inductor_overrides(overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        setattr(inductor_config, key, value)
