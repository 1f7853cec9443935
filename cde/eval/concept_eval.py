"""Steering efficacy and attribution accuracy, measured through the API's own fields.

- amplify: neutral prompts (the topic is left open), steered toward one topic concept with the
  `amplify` preset at a strength; the share of the output's sentences the topic judge gives to
  that topic, and the share of repeated word 3-grams (degenerate loops), per strength (strength
  0 = unsteered baseline).
- suppress: prompts that ask for the topic, with the `suppress` preset on its concept; the share
  falls from its unsteered value.
- attribution: prompts that ask for a topic (unsteered), or neutral prompts amplified toward a
  topic (steered), with attribution on; per 64-token chunk of the reply, whether the topic's
  concept is the first known concept (the API ranks concepts by |contribution|), among the first
  three, and whether the first is of the topic's catalog group (topic or subtopic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cde.eval.repetition import repeated_trigram_share
from cde.train.reference_concepts import concepts, topic_concept
from cde.train.samples import NEUTRAL_PROMPTS
from cde.train.text import on_topic_share
from cde.train.vocab import TOPICS

if TYPE_CHECKING:
    from cde.eval.backends import EngineBackend, HttpBackend

MIN_CHUNK_CHARS = 40  # a chunk shorter than a sentence says little about its topic


def _chat(text: str, max_tokens: int, **extra: Any) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0.0, **extra}


def _shares(backend: EngineBackend | HttpBackend, bodies: list[dict], topics: list[str]) -> float:
    batch = backend.run(bodies)
    return _on_topic([c.text for c in batch.completions], topics)


def _on_topic(texts: list[str], topics: list[str]) -> float:
    return sum(on_topic_share(x, t) for x, t in zip(texts, topics)) / max(len(topics), 1)


def _amplified(topic: str, strength: float) -> dict:
    if not strength:
        return {}
    return {"steering": {"concepts": [topic_concept(topic)], "preset": "amplify", "strength": strength}}


def amplify(
    backend: EngineBackend | HttpBackend, strengths: list[float], n_topics: int, n_prompts: int, max_tokens: int = 64
) -> list[dict]:
    topics = TOPICS[:n_topics]
    cases = [(t, p) for t in topics for p in NEUTRAL_PROMPTS[:n_prompts]]
    rows = []
    for s in strengths:
        batch = backend.run([_chat(p, max_tokens, **_amplified(t.name, s)) for t, p in cases])
        texts = [c.text for c in batch.completions]
        rows.append(
            {
                "strength": s,
                "on_topic": _on_topic(texts, [t.name for t, _ in cases]),
                "repeated_3grams": repeated_trigram_share(texts),
                "prompts": [p for _, p in cases],
                "replies": texts,
            }
        )
    return rows


def on_topic_strength(rows: list[dict], share: float = 0.8) -> dict | None:
    """The first (weakest) steered row whose on-topic share reaches `share`."""
    return next((r for r in rows if r["strength"] and r["on_topic"] >= share), None)


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


def attribution(
    backend: EngineBackend | HttpBackend, n_topics: int, steer_strength: float = 0.0, max_tokens: int = 128
) -> dict:
    """How often a chunk's top known concept is its topic (and the topic is among the top 3).
    steer_strength 0: "Tell me about <topic>."; else a neutral prompt amplified toward the topic."""
    topics = TOPICS[:n_topics]
    if steer_strength:
        prompts = [NEUTRAL_PROMPTS[i % len(NEUTRAL_PROMPTS)] for i in range(len(topics))]
    else:
        prompts = [f"Tell me about {t.phrase}." for t in topics]
    bodies = [
        _chat(q, max_tokens, attribution={"top_k": 8}, **_amplified(t.name, steer_strength))
        for q, t in zip(prompts, topics)
    ]
    batch = backend.run(bodies)
    ranked = [
        [
            [e["id"] for e in chunk["concepts"] if e["type"] == "known"]
            for chunk in c.attribution or []
            if _counts(chunk)
        ]
        for c in batch.completions
    ]
    return {"strength": steer_strength, **chunk_ranks(ranked, [topic_concept(t.name) for t in topics])}


def _counts(chunk: dict) -> bool:
    return len(chunk["text"]) >= MIN_CHUNK_CHARS and any(e["type"] == "known" for e in chunk["concepts"])


def chunk_ranks(ranked: list[list[list[int]]], wanted: list[int]) -> dict:
    """ranked: per reply, per chunk, its known concept ids by |contribution|; wanted: per reply,
    the topic concept. Shares of chunks whose first id is the topic, whose first three hold it,
    whose first is of the topic's catalog group."""
    group = {c.id: c.group_id for c in concepts()}
    top1 = top3 = grouped = total = 0
    for chunks, want in zip(ranked, wanted):
        for ids in chunks:
            total += 1
            top1 += ids[0] == want
            top3 += want in ids[:3]
            grouped += group.get(ids[0]) == group[want]
    n = max(total, 1)
    return {"chunks": total, "top_is_topic": top1 / n, "topic_in_top3": top3 / n, "top_in_topic_group": grouped / n}
