"""How much a text repeats itself: the share of its word 3-grams that already occurred earlier in
the same text. Degenerate steering reads high ("sand sand sand sand sand": 2 of its 3); the generator's
own paragraphs read low. Counted over texts pooled, so a long text weighs by its length."""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z0-9]+(?:['-][a-z0-9]+)*")


def trigrams(text: str) -> list[tuple[str, str, str]]:
    words = _WORD.findall(text.lower())
    return list(zip(words, words[1:], words[2:]))


def repeated_trigram_share(texts: list[str]) -> float:
    """Repeated 3-grams / all 3-grams over the texts (each text counts its own repeats); 0 without any."""
    repeated = total = 0
    for text in texts:
        seen: set[tuple[str, str, str]] = set()
        for g in trigrams(text):
            repeated += g in seen
            seen.add(g)
            total += 1
    return repeated / total if total else 0.0
