"""Several stop strings that share prefixes, streamed: whatever the chunking of the tokens, the
streamed pieces join to the one-shot text, which ends where the earliest stop begins (found here
by plain `str.find`), or with vLLM's include_stop_str_in_output where the first stop to be complete
ends. The hold-back must keep the longest tail that could still become any of the stops, not the
first stop's."""

import random

import pytest
from cde.gateway.detokenizer import ChoiceText
from cde.shared.tokenizer import get_tokenizer

TOK = get_tokenizer(False)
# Overlapping: "cab" and "bca" sit inside "abcab"; "ca" starts "cab"; a tail "abca" could become three of them.
STOPS = ["cab", "bca", "abcab", "ca b"]


def one_shot(text: str, stops: list[str], include_stop: bool) -> str:
    cuts = [text.find(s) + (len(s) if include_stop else 0) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


@pytest.mark.parametrize("include_stop", [False, True])
def test_streamed_equals_one_shot_under_random_chunkings_with_overlapping_stops(include_stop):
    rng = random.Random(0)
    for case in range(300):
        stops = rng.sample(STOPS, rng.randint(2, len(STOPS)))
        ids = TOK.encode("".join(rng.choice("abc  ") for _ in range(rng.randint(1, 40))))
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, len(ids) - 1))) if len(ids) > 1 else []
        streamed = ChoiceText(TOK, stops, include_stop)
        pieces = [streamed.add(ids[a:b], final=b == len(ids)) for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        expected = one_shot(TOK.decode(ids), stops, include_stop)
        assert "".join(pieces) == expected, (case, stops, TOK.decode(ids), pieces)
