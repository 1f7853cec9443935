"""The reference model's known concepts: topics, their subtopics, tones, task kinds and the
conversation concepts, in a fixed order (the id is the index), with the catalog rows of the
official `concept_labels.parquet` schema. Groups: one per topic (the topic and its subtopics),
one for tones, one for tasks, one for conversation."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from cde.train.text import TONES
from cde.train.vocab import TOPICS

TASK_KINDS = {
    "Addition": "Adding two numbers written digit by digit; arithmetic, sums, plus.",
    "Subtraction": "Subtracting one number from another, written digit by digit; arithmetic, difference, minus.",
    "Sorting": "Sorting a list of numbers from smallest to largest; ordering, lists.",
    "Reversal": "Writing a list of words in reverse order; lists, word order.",
    "Word problem": "Short stories with a numeric question: someone has, gets or gives things; arithmetic.",
}
CONVERSATION = {
    "Greeting": "Hellos, thanks and goodbyes in a conversation; chat, small talk.",
    "Self description": "The model describing itself and what it can do; assistant, abilities.",
}
TONE_WORDS = {
    "Neutral": "plain, factual statements",
    "Excited": "enthusiastic exclamations, wow, love, amazing",
    "Calm": "quiet, slow, peaceful, gentle",
    "Formal": "official, reported, noted, in accordance",
    "Sad": "sadness, loss, lonely, broken, nobody",
    "Curious": "questions, wonder, why, how",
}


@dataclass(frozen=True)
class Concept:
    id: int
    name: str
    description: str
    group_id: int
    group_name: str
    kind: str  # topic | subtopic | tone | task | conversation


@cache
def concepts() -> tuple[Concept, ...]:
    out: list[Concept] = []

    def add(name: str, description: str, group_id: int, group_name: str, kind: str) -> None:
        out.append(Concept(len(out), name, description, group_id, group_name, kind))

    for g, topic in enumerate(TOPICS):
        people = ", ".join(topic.people)
        subs = ", ".join(s.name.lower() for s in topic.subtopics)
        add(topic.name, f"Text about {topic.phrase}: {subs}; people such as the {people}.", g, topic.name, "topic")
        for sub in topic.subtopics:
            add(sub.name, f"{sub.name} ({topic.phrase}): {', '.join(sub.nouns)}.", g, topic.name, "subtopic")
    g = len(TOPICS)
    for tone in TONES:
        add(f"{tone} tone", f"Text written in a {tone.lower()} tone: {TONE_WORDS[tone]}.", g, "Tones", "tone")
    for name, description in TASK_KINDS.items():
        add(name, description, g + 1, "Tasks", "task")
    for name, description in CONVERSATION.items():
        add(name, description, g + 2, "Conversation", "conversation")
    return tuple(out)


@cache
def concept_id(name: str) -> int:
    return next(c.id for c in concepts() if c.name == name)


def topic_concept(topic_name: str) -> int:
    return concept_id(topic_name)


def tone_concept(tone: str) -> int:
    return concept_id(f"{tone} tone")


def catalog_rows() -> list[dict]:
    """Rows in the official concept_labels.parquet schema (known head only: the discovered
    concepts of the reference model have no names)."""
    return [
        {
            "concept_id": c.id,
            "concept_name": c.name,
            "concept_description": c.description,
            "head": "known",
            "public_group_id": c.group_id,
            "group_name": c.group_name,
            "is_steerable": c.kind in ("topic", "subtopic", "tone"),
            "is_tone": c.kind == "tone",
            "is_alignment": False,
            "is_demographic": False,
        }
        for c in concepts()
    ]


def write_catalog(path: str | Path) -> Path:
    from cde.shared.catalog import write_catalog as write

    return write(path, catalog_rows())
