"""Held-out task accuracy: problems of the eval split, asked as one user turn through the chat
template with greedy decoding, replies checked by each family's checker. The training log asks an
engine in this process (`on_engine`, token ids straight to the engine); `cde eval` asks any of its
backends, with any decoding options, through the API's request bodies (cde/commands/eval.py)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from cde.train import tasks
from cde.train.engine_replies import Batch, greedy_chat

if TYPE_CHECKING:
    from cde.worker.engine import Engine

MAX_TOKENS = 48  # a reply's budget: every family's answer fits, with room to ramble and be wrong


def problems(n_per_family: int, seed: int = 0) -> list[tasks.Problem]:
    rng = random.Random(f"heldout:{seed}")
    return [tasks.problem(f, rng, "eval") for f in tasks.FAMILIES for _ in range(n_per_family)]


def messages(p: tasks.Problem) -> list[dict]:
    return [{"role": "user", "content": p.prompt}]


def accuracy(probs: list[tasks.Problem], batch: Batch) -> dict:
    """Of `batch`, the replies to `probs` in order: {"accuracy": {family: share},
    "tokens_per_step", "tok_s", "samples": [(prompt, reply)]}."""
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


def on_engine(engine: Engine, probs: list[tasks.Problem]) -> dict:
    """accuracy() of greedy replies, one token per step, from an engine in this process."""
    return accuracy(probs, greedy_chat(engine, [messages(p) for p in probs], MAX_TOKENS))
