"""`cde bench engine --constrained`: what structured output costs. Each level runs three times in
the same engine: plain, every request constrained by a JSON schema, and half of the requests
constrained (mixed: do the plain half lose anything?). Per run, tok/s and ms per pass are the
engine's; the mixed run also reports each half's tok/s."""

from __future__ import annotations

import argparse

from cde.shared.grammar import json_schema_grammar
from cde.shared.protocol import GenerateRequest

# Open-ended on purpose (an object holding an array of strings): a random-weight model keeps
# writing inside it, so the constrained requests run about as long as the plain ones.
SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
}
VARIANTS = {"plain": 0.0, "constrained": 1.0, "mixed": 0.5}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--constrained",
        action="store_true",
        help="run each level three times in the same engine: plain, all requests constrained to a JSON "
        "schema, half of them constrained (mixed)",
    )


def variants(args: argparse.Namespace) -> list[str]:
    return list(VARIANTS) if args.constrained else ["plain"]


def constrain(reqs: list[GenerateRequest], variant: str) -> list[GenerateRequest]:
    """The first share of the requests (every other one when mixed) get the schema's grammar."""
    share = VARIANTS[variant]
    if share:
        grammar = json_schema_grammar(SCHEMA)
        for i, r in enumerate(reqs):
            if share == 1.0 or i % 2 == 0:
                r.grammar = grammar
    return reqs


def group_rates(res: dict, reqs: list[GenerateRequest]) -> dict:
    """tok/s of the constrained and the plain requests of a run, each group on its own: its tokens
    over the time its last request finished."""
    out = {}
    for name, group in (("constrained", [r for r in reqs if r.grammar]), ("plain", [r for r in reqs if not r.grammar])):
        if group:
            tokens = sum(len(res["outputs"][r.request_id]) for r in group)
            out[f"{name}_tok_per_s"] = tokens / max(res["last_block_s"][r.request_id] for r in group)
    return out
