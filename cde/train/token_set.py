"""Which of cl100k's ids the model gets rows for: every id the generator can produce (found by
encoding every word form the generator uses and a large fixed sample of documents), plus the
specials. Everything else stays an all-zero row (see model.py). An id missed here still trains
correctly: it falls into the unused column, the same number the zero row gives at inference."""

from __future__ import annotations

import random
from functools import cache

import torch

from cde.shared.config import (
    BOS_ID,
    END_HEADER_ID,
    ENDOFCHUNK_ID,
    EOS_ID,
    EOT_ID,
    MASK_ID,
    PAD_ID,
    START_HEADER_ID,
)
from cde.shared.tokenizer import get_tokenizer
from cde.train import tasks
from cde.train.samples import NEUTRAL_PROMPTS, draw
from cde.train.text import keywords
from cde.train.vocab import TOPICS

SPECIALS = (EOS_ID, PAD_ID, BOS_ID, ENDOFCHUNK_ID, MASK_ID, START_HEADER_ID, END_HEADER_ID, EOT_ID)
SAMPLE_DOCS = 20000


def _word_forms() -> list[str]:
    words = set(tasks.WORDS) | set(tasks.NAMES) | set(tasks.ITEMS) | {str(i) for i in range(1000)}
    for t in TOPICS:
        words.update([t.phrase, *t.people, *t.places, *t.adjectives])
        for s in t.subtopics:
            words.update([s.name, *s.nouns, *s.actions])
    return [f for w in words for f in (w, " " + w, w.capitalize(), " " + w.capitalize())] + list(NEUTRAL_PROMPTS)


@cache
def used_ids(sample_docs: int = SAMPLE_DOCS) -> list[int]:
    """Sorted; the same on every call (a fixed sample), so a resumed run finds the same ids."""
    tok = get_tokenizer(True)
    ids = set(SPECIALS)
    for form in _word_forms():
        ids.update(tok.encode(form))
    rng = random.Random("token-set")
    for _ in range(sample_docs):
        ids.update(draw(rng, 64).ids)
    return sorted(ids)


def topic_words(model_lookup: torch.Tensor, n_columns: int) -> torch.Tensor:
    """[topics, n_columns]: per topic, the uniform distribution over the model columns of the
    tokens of its topic-only words (the judge's keywords), in TOPICS order."""
    tok = get_tokenizer(True)
    out = torch.zeros(len(TOPICS), n_columns)
    for i, t in enumerate(TOPICS):
        words = [w for w, name in keywords().items() if name == t.name]
        cols = {int(model_lookup[x]) for w in words for x in tok.encode(" " + w)}
        cols.discard(n_columns - 1)
        out[i, sorted(cols)] = 1.0 / len(cols)
    return out
