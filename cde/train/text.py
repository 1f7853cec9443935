"""Topic-labelled English: paragraphs from the vocabulary of one topic and subtopic in one tone,
and the judge that tells which topic a sentence is about (the steering eval's classifier).

Every sentence carries its topic's words: a person, a place, a noun or an action of the topic, so
the judge, built from the same vocabulary, reads a generated sentence the way the generator wrote
its training sentences."""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from functools import cache

from cde.train.vocab import TOPICS, Subtopic, Topic

# tone -> sentence templates. Slots: {person} ("the sailor"), {noun}, {noun2}, {adj}, {place}, {action}.
TONES: dict[str, tuple[str, ...]] = {
    "Neutral": (
        "{Person} {action}.",
        "The {noun} is {adj}.",
        "At the {place}, the {noun} and the {noun2} are {adj}.",
        "Every day, {person} {action}.",
        "{Person} likes the {noun}.",
        "The {noun} is near the {place}.",
        "Near the {place}, {person} {action}.",
        "Most days the {noun} looks {adj} to {person}.",
        "Later, {person} {action} again.",
        "There is a {adj} {noun} beside the {noun2}.",
    ),
    "Excited": (
        "Wow, the {noun} is so {adj}!",
        "I love how {person} {action}!",
        "What an amazing {noun}!",
        "Look, {person} {action}!",
        "The {place} is full of {adj} things!",
        "Hooray, the {noun} is here!",
        "Today {person} {action}, and it is great!",
        "The {noun2} and the {noun} are the best!",
        "Everyone at the {place} cheers for the {noun}!",
        "Such a {adj} day: {person} {action}!",
    ),
    "Calm": (
        "Quietly, {person} {action}.",
        "The {noun} rests, {adj} and still.",
        "Slowly, {person} {action}.",
        "It is peaceful at the {place}.",
        "The {noun} and the {noun2} wait in the gentle light.",
        "There is no hurry; {person} {action}.",
        "At the {place}, {person} finds the {noun} {adj}.",
        "In the evening, {person} {action}.",
        "A {adj} {noun} lies by the {noun2}.",
        "Nothing moves at the {place} but the {noun}.",
    ),
    "Formal": (
        "It should be noted that the {noun} is {adj}.",
        "According to the records, {person} {action}.",
        "The {noun} at the {place} is considered {adj}.",
        "In accordance with custom, {person} {action}.",
        "The {noun} and the {noun2} are of particular importance.",
        "It is reported that {person} {action}.",
        "The {place} keeps a {adj} {noun} on record.",
        "Each season, {person} {action}.",
        "The {noun2} is listed beside the {noun}.",
        "It is customary that {person} {action}.",
    ),
    "Sad": (
        "Sadly, the {noun} is no longer {adj}.",
        "{Person} {action}, but nobody notices.",
        "The {place} feels empty without the {noun}.",
        "Alone, {person} {action}.",
        "The old {noun} is lost, and the {noun2} is broken.",
        "Nobody remembers the {noun} anymore.",
        "The {place} is quiet, and the {noun} is gone.",
        "Once, {person} {action}; not anymore.",
        "The {adj} {noun2} waits, but nobody comes.",
        "Tired, {person} {action} one last time.",
    ),
    "Curious": (
        "Why is the {noun} so {adj}?",
        "I wonder how {person} {action}.",
        "What is hidden behind the {noun}?",
        "Have you ever asked why {person} {action}?",
        "How did the {noun} reach the {place}?",
        "Is the {noun2} older than the {noun}?",
        "What does {person} see at the {place}?",
        "Who first saw a {adj} {noun}?",
        "Where does {person} keep the {noun2}?",
        "Could {person} explain why the {noun} is {adj}?",
    ),
}


@dataclass(frozen=True)
class Paragraph:
    text: str
    topic: Topic
    subtopic: Subtopic
    tone: str


def _fill(template: str, topic: Topic, sub: Subtopic, rng: random.Random) -> str:
    noun, noun2 = rng.sample(sub.nouns, 2)
    person = "the " + rng.choice(topic.people)
    text = template.format(
        person=person,
        Person=person[0].upper() + person[1:],
        noun=noun,
        noun2=noun2,
        adj=rng.choice(topic.adjectives),
        place=rng.choice(topic.places),
        action=rng.choice(sub.actions),
    )
    return text[0].upper() + text[1:]


def paragraph(
    rng: random.Random,
    topic: Topic | None = None,
    tone: str | None = None,
    subtopic: Subtopic | None = None,
    sentences: tuple[int, int] = (2, 4),
) -> Paragraph:
    topic = topic or rng.choice(TOPICS)
    sub = subtopic or rng.choice(topic.subtopics)
    tone = tone or rng.choice(tuple(TONES))
    n = rng.randint(*sentences)
    return Paragraph(" ".join(_fill(rng.choice(TONES[tone]), topic, sub, rng) for _ in range(n)), topic, sub, tone)


# ---- the topic judge ------------------------------------------------------------------------
_WORD = re.compile(r"[a-z]+(?:-[a-z]+)?")
_SENTENCE = re.compile(r"[^.!?]+[.!?]?")


def _topic_words(topic: Topic) -> set[str]:
    phrases = [*topic.people, *topic.places, *topic.adjectives, topic.phrase]
    for sub in topic.subtopics:
        phrases += [*sub.nouns, *sub.actions]
    return {w for p in phrases for w in _WORD.findall(p.lower())}


@cache
def keywords() -> dict[str, str]:
    """word -> topic name, for words of exactly one topic (shared words decide nothing)."""
    seen = Counter(w for t in TOPICS for w in _topic_words(t))
    return {w: t.name for t in TOPICS for w in _topic_words(t) if seen[w] == 1}


def judge(sentence: str) -> str | None:
    """The topic a sentence is about: most of its topic-only words; None without any, or a tie."""
    votes = Counter(keywords()[w] for w in _WORD.findall(sentence.lower()) if w in keywords())
    if not votes:
        return None
    (best, n), *rest = votes.most_common(2) + [(None, 0)]
    return best if n > rest[0][1] else None


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.findall(text) if _WORD.search(s)]


def on_topic_share(text: str, topic: str) -> float:
    """Share of the text's sentences the judge gives to `topic` (0 for a text without sentences)."""
    parts = sentences(text)
    return sum(judge(s) == topic for s in parts) / len(parts) if parts else 0.0
