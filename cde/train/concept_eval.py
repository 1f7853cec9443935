"""Steering efficacy and attribution accuracy, measured through the API's own fields.

- amplify: neutral prompts (the topic is left open), steered toward one topic concept with the
  `amplify` preset at a strength; the share of the output's sentences the topic judge gives to
  that topic, per strength (strength 0 = unsteered baseline).
- suppress: prompts that ask for the topic, with the `suppress` preset on its concept; the share
  falls from its unsteered value.
- attribution: prompts that ask for a topic, with attribution on; per 64-token chunk of the reply,
  the top known concept (the API ranks concepts by |contribution|) against the topic's concept
  (strict), or any concept of the topic's catalog group (topic or subtopic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cde.train.concepts import concepts, topic_concept
from cde.train.samples import NEUTRAL_PROMPTS
from cde.train.text import on_topic_share
from cde.train.vocab import TOPICS

if TYPE_CHECKING:
    from cde.train.backends import EngineBackend, HttpBackend

MIN_CHUNK_CHARS = 40  # a chunk shorter than a sentence says little about its topic


def _chat(text: str, max_tokens: int, **extra: Any) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0.0, **extra}


def _shares(backend: EngineBackend | HttpBackend, bodies: list[dict], topics: list[str]) -> float:
    batch = backend.run(bodies)
    return sum(on_topic_share(c.text, t) for c, t in zip(batch.completions, topics)) / max(len(topics), 1)


def amplify(
    backend: EngineBackend | HttpBackend, strengths: list[float], n_topics: int, n_prompts: int, max_tokens: int = 64
) -> list[dict]:
    topics = TOPICS[:n_topics]
    cases = [(t, p) for t in topics for p in NEUTRAL_PROMPTS[:n_prompts]]
    rows = []
    for s in strengths:
        bodies = [
            _chat(
                p,
                max_tokens,
                **(
                    {"steering": {"concepts": [topic_concept(t.name)], "preset": "amplify", "strength": s}} if s else {}
                ),
            )
            for t, p in cases
        ]
        rows.append({"strength": s, "on_topic": _shares(backend, bodies, [t.name for t, _ in cases])})
    return rows


def suppress(backend: EngineBackend | HttpBackend, n_topics: int, max_tokens: int = 64) -> dict:
    topics = TOPICS[:n_topics]
    ask = [f"Tell me about {t.phrase}." for t in topics]
    names = [t.name for t in topics]
    base = _shares(backend, [_chat(q, max_tokens) for q in ask], names)
    steered = _shares(
        backend,
        [
            _chat(q, max_tokens, steering={"concepts": [topic_concept(t.name)], "preset": "suppress"})
            for q, t in zip(ask, topics)
        ],
        names,
    )
    return {"baseline": base, "suppressed": steered}


def attribution(backend: EngineBackend | HttpBackend, n_topics: int, max_tokens: int = 128) -> dict:
    """How often a chunk's top known concept is its topic."""
    topics = TOPICS[:n_topics]
    group = {c.id: c.group_id for c in concepts()}
    bodies = [_chat(f"Tell me about {t.phrase}.", max_tokens, attribution={"top_k": 8}) for t in topics]
    batch = backend.run(bodies)
    strict = grouped = total = 0
    for t, c in zip(topics, batch.completions):
        want = topic_concept(t.name)
        for chunk in c.attribution or []:
            known = [e for e in chunk["concepts"] if e["type"] == "known"]
            if len(chunk["text"]) < MIN_CHUNK_CHARS or not known:
                continue
            total += 1
            strict += known[0]["id"] == want
            grouped += group.get(known[0]["id"]) == group[want]
    return {"chunks": total, "top_is_topic": strict / max(total, 1), "top_in_topic_group": grouped / max(total, 1)}
