"""Held-out task accuracy: problems of the eval split, asked through the chat template with
greedy decoding, replies checked by each family's checker. Used by the training log and by
`cde eval` (any backend, any decoding options)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from cde.train import tasks

if TYPE_CHECKING:
    from cde.train.backends import EngineBackend, HttpBackend


def problems(n_per_family: int, seed: int = 0) -> list[tasks.Problem]:
    rng = random.Random(f"heldout:{seed}")
    return [tasks.problem(f, rng, "eval") for f in tasks.FAMILIES for _ in range(n_per_family)]


def body(p: tasks.Problem, options: dict) -> dict:
    return {"messages": [{"role": "user", "content": p.prompt}], "max_tokens": 48, "temperature": 0.0, **options}


def accuracy(backend: EngineBackend | HttpBackend, probs: list[tasks.Problem], options: dict | None = None) -> dict:
    """{"accuracy": {family: share}, "tokens_per_step", "tok_s", "samples": [(prompt, reply)]}."""
    batch = backend.run([body(p, options or {}) for p in probs])
    right: dict[str, list[bool]] = {}
    for p, c in zip(probs, batch.completions):
        right.setdefault(p.family, []).append(tasks.check(p, c.text))
    tokens = sum(c.tokens for c in batch.completions)
    steps = sum(c.steps for c in batch.completions)
    return {
        "accuracy": {f: sum(v) / len(v) for f, v in right.items()},
        "tokens_per_step": tokens / max(steps, 1),
        "tok_s": tokens / max(batch.seconds, 1e-9),
        "samples": [(p.prompt, c.text) for p, c in zip(probs, batch.completions)][:: max(1, len(probs) // 8)],
    }
