"""Training documents: chat exchanges in the instruct template (tasks, topic writing, small talk)
and plain topic text, as token ids with what the objective needs to know about each position.

A position's kind: PROMPT (never masked: the engine never denoises a prompt), TEXT (masked at
random, predicted), EOT (the reply's closing <|eot_id|>), TRAIL (<|endoftext|> from the reply's
end to its block's end, as the reference fills after EOT). The objective treats EOT and TRAIL
specially so that EOT, which ends a request the moment it is committed, is never committed
before the reply it closes (see objective.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from cde.shared.config import EOT_ID
from cde.shared.tokenizer import get_tokenizer
from cde.train import tasks
from cde.train.reference_concepts import concept_id, tone_concept, topic_concept
from cde.train.text import TONES, paragraph
from cde.train.vocab import TOPICS

PROMPT, TEXT, EOT, TRAIL = 0, 1, 2, 3

NEUTRAL_PROMPTS = (
    "Write a few sentences.",
    "Tell me something.",
    "Say something interesting.",
    "Write a short paragraph.",
    "Tell me a story.",
    "Write something.",
)
_TOPIC_PROMPTS = ("Tell me about {t}.", "Write a few sentences about {t}.", "Describe {t}.", "Talk about {t}.")
_TONE_PROMPTS = ("Write a {tone} paragraph about {t}.", "Tell me about {t} in a {tone} tone.")
_SMALL_TALK = (
    (
        "Hello!",
        "Hello! I am a small Steerling model. Ask me to add numbers, sort a list, reverse words or tell you "
        "about the ocean.",
        "Greeting",
    ),
    ("Hi there.", "Hi! What would you like to talk about?", "Greeting"),
    ("Thank you!", "You are welcome!", "Greeting"),
    ("Goodbye.", "Goodbye! Come back any time.", "Greeting"),
    (
        "Who are you?",
        "I am a small reference model with the Steerling architecture, trained by CDE on generated data.",
        "Self description",
    ),
    (
        "What can you do?",
        "I can add and subtract numbers, sort numbers, reverse lists of words, solve short word problems "
        "and write about sixteen topics such as the ocean, space, cooking and music.",
        "Self description",
    ),
)


@dataclass
class Doc:
    ids: list[int]
    kinds: list[int]
    labels: list[int]  # known concepts of the doc's text
    steer: int = -1  # the topic concept the text is about (steering is trained on it), or -1
    meta: dict = field(default_factory=dict)


def chat_doc(prompt: str, reply: str, labels: list[int], steer: int = -1) -> Doc:
    tok = get_tokenizer(True)
    head = tok.chat_prompt([{"role": "user", "content": prompt}])
    body = tok.encode(reply)
    return Doc(head + body + [EOT_ID], [PROMPT] * len(head) + [TEXT] * len(body) + [EOT], labels, steer)


# family -> the longest reply's item count: half the training lists of these families are drawn
# from their longest two lengths, since the first model failed (ran on past the list) only there.
LONGEST = {"sorting": 8, "reversal": 7}


def task_doc(rng: random.Random, family: str, split: str = "train") -> Doc:
    p = tasks.problem(family, rng, split)
    if family in LONGEST and split == "train" and rng.random() < 0.5:
        while len(p.expected) < LONGEST[family] - 1:
            p = tasks.problem(family, rng, split)
    doc = chat_doc(p.prompt, p.answer, [concept_id(p.kind)])
    doc.meta["problem"] = p
    return doc


def topic_chat_doc(rng: random.Random) -> Doc:
    par = paragraph(rng)
    style = rng.random()
    if style < 0.3:
        prompt = rng.choice(_TOPIC_PROMPTS).format(t=par.topic.phrase)
    elif style < 0.45:
        prompt = rng.choice(_TONE_PROMPTS).format(t=par.topic.phrase, tone=par.tone.lower())
    elif style < 0.6:
        prompt = rng.choice(_TOPIC_PROMPTS).format(t=par.subtopic.name.lower())
    else:  # the prompt leaves the topic open: only steering (or chance) decides it; 40% of topic
        # chats, where amplify steering is learnt (elsewhere the text already names its topic)
        prompt = rng.choice(NEUTRAL_PROMPTS)
    return chat_doc(prompt, par.text, _labels(par), topic_concept(par.topic.name))


def small_talk_doc(rng: random.Random) -> Doc:
    prompt, reply, concept = rng.choice(_SMALL_TALK)
    return chat_doc(prompt, reply, [concept_id(concept)])


def plain_doc(rng: random.Random, min_tokens: int) -> Doc:
    """Plain text (no template) of one topic, paragraph after paragraph until min_tokens."""
    tok = get_tokenizer(True)
    topic = rng.choice(TOPICS)
    ids: list[int] = []
    labels: set[int] = set()
    while len(ids) < min_tokens:
        par = paragraph(rng, topic=topic, tone=rng.choice(tuple(TONES)))
        ids += tok.encode(("\n\n" if ids else "") + par.text)
        labels.update(_labels(par))
    return Doc(ids, [TEXT] * len(ids), sorted(labels), topic_concept(topic.name))


def _labels(par: Any) -> list[int]:
    return [topic_concept(par.topic.name), concept_id(par.subtopic.name), tone_concept(par.tone)]


# name -> share of the documents; plain text fills what is left of a row.
MIX = {
    "arithmetic": 0.2,
    "sorting": 0.11,
    "reversal": 0.11,
    "word_problem": 0.12,  # at 0.1 (and 5,570 steps) word problems fell to 81%
    "topic": 0.3,
    "small_talk": 0.03,
    "plain": 0.15,
}


def draw(rng: random.Random, room: int) -> Doc:
    """One training document; a plain one is at least `room` tokens (it is cut to fit)."""
    kind = rng.choices(tuple(MIX), weights=tuple(MIX.values()))[0]
    if kind in tasks.FAMILIES:
        return task_doc(rng, kind)
    if kind == "topic":
        return topic_chat_doc(rng)
    if kind == "small_talk":
        return small_talk_doc(rng)
    return plain_doc(rng, room)
