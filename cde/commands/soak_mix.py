"""The soak's requests and how each is judged.

A pool of request specs (greedy, seeded n=2, steering, attribution, stop strings, chat; streaming
or not), each run alone first to record its reference output. Under load every spec must give
exactly its reference again: CDE's sampling is batch-invariant and these requests are greedy or
seeded, so any difference means a request got another request's tokens (or lost some)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from cde.commands.bench_serve import WORDS
from cde.commands.load_client import Outcome

SHED = {"http_429", "http_503"}  # load shedding: an explicit error a client should retry


@dataclass
class Spec:
    kind: str  # greedy | seeded_n2 | steering | attribution | stop | chat | invalid
    path: str  # /completions or /chat/completions
    body: dict


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24)))


def build_pool(rng: random.Random, model: str, size: int, chat: bool, max_tokens: int) -> list[Spec]:
    lengths = [m for m in (8, 24, 48, 100, 150) if m <= max_tokens] or [max_tokens]
    kinds = ["greedy", "seeded_n2", "steering", "attribution"] + (["chat"] if chat else [])
    pool = []
    for i in range(size):
        kind = kinds[i % len(kinds)]
        body = {
            "model": model,
            "max_tokens": rng.choice(lengths),
            "temperature": 0,
            "tokens_per_step": rng.choice([4, 8]),
            "stream": rng.random() < 0.5,
        }
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        else:
            body["prompt"] = _prompt(rng)
        if kind == "seeded_n2":
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31), n=2)
        elif kind == "steering":
            concepts = rng.sample(range(32), 2)
            body["steering"] = rng.choice(
                [{"concepts": concepts, "strength": 8.0}, {"preset": "suppress", "concepts": concepts[:1]}]
            )
        elif kind == "attribution":
            body["attribution"] = {"top_k": 3}
        pool.append(Spec(kind, "/chat/completions" if kind == "chat" else "/completions", body))
    return pool


def stop_spec(spec: Spec, reference: Outcome) -> Spec | None:
    """A copy of a greedy spec that stops on a piece of its own reference text, so the stop fires."""
    text = reference.texts.get(0, "")
    piece = text[len(text) // 3 :][:3]
    if len(piece) < 3 or not piece.strip():
        return None
    return Spec("stop", spec.path, {**spec.body, "stop": [piece]})


def invalid_spec(model: str) -> Spec:
    return Spec("invalid", "/completions", {"model": model, "prompt": "x", "max_tokens": -1})


def verify(spec: Spec, ref: Outcome | None, out: Outcome, deadline: float | None) -> str | None:
    """None if `out` is a right answer to `spec`, else what is wrong with it."""
    if spec.kind == "invalid":
        if out.status == "error" and out.kind == "http_400" and out.param == "max_tokens":
            return None
        return f"expected a 400 naming max_tokens, got {out.status} {out.kind} {out.message!r}"
    if out.status == "error":
        return None  # explicit; counted, and server errors are checked separately
    if out.status == "broken":
        return f"broken response: {out.kind} {out.message}"
    if out.status == "client_timeout":
        return None if deadline is not None else "client timeout without a deadline"
    if out.status == "hung_up":
        for i, text in out.texts.items():
            if not ref.texts.get(i, "").startswith(text):
                return f"choice {i}: streamed {text!r} is not a prefix of the reference {ref.texts.get(i)!r}"
        return None
    if dict(out.texts) != dict(ref.texts):
        return f"text differs from the request run alone: {dict(out.texts)!r} != {dict(ref.texts)!r}"
    if out.finish != ref.finish:
        return f"finish_reason {out.finish} != {ref.finish} alone"
    if "attribution" in spec.body and sorted(out.attribution) != sorted(out.texts):
        return "attribution missing from a choice"
    return None


def is_server_error(out: Outcome) -> bool:
    return out.status == "error" and out.kind not in SHED and not out.kind.startswith("http_4")
