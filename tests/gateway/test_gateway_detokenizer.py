"""Incremental detokenization: never broken UTF-8, never a stop string or its prefix, and the
streamed pieces join to the one-shot text."""

import random

import pytest
from cde.gateway.detokenizer import ChoiceText, Utf8Detokenizer
from cde.shared.config import EOT_ID
from cde.shared.tokenizer import get_tokenizer

TOK = get_tokenizer(True)
TEXT = "héllo wörld 🎉🐍 日本語 👩‍👩‍👧 done"


def test_emoji_bytes_split_across_tokens_are_held_back():
    ids = TOK.encode("🎉")
    assert ids == [9468, 236, 231]  # b'\xf0\x9f', b'\x8e', b'\x89': one emoji, three tokens
    d = Utf8Detokenizer(TOK)
    assert [d.add([i]) for i in ids] == ["", "", "🎉"]


@pytest.mark.parametrize("seed", range(20))
def test_any_chunking_joins_to_one_shot_decode(seed):
    ids = TOK.encode(TEXT) + [EOT_ID] + TOK.encode(" tail ✓")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(1, len(ids) - 1)))
    d = Utf8Detokenizer(TOK)
    pieces = []
    for a, b in zip([0, *cuts], [*cuts, len(ids)]):
        pieces.append(d.add(ids[a:b], final=b == len(ids)))
        assert "\ufffd" not in pieces[-1]
    assert "".join(pieces) == TOK.decode(ids)


def test_invalid_bytes_match_one_shot_replacement():
    ids = TOK.encode("🎉")[:2] + TOK.encode("ok")  # an emoji cut short, then text
    d = Utf8Detokenizer(TOK)
    assert d.add(ids[:1]) + d.add(ids[1:2]) + d.add(ids[2:], final=True) == TOK.decode(ids)


def test_truncated_sequence_is_flushed_as_replacement_at_the_end():
    d = Utf8Detokenizer(TOK)
    assert d.add(TOK.encode("a🎉")[:2]) == "a"
    assert d.add([], final=True) == "\ufffd"


def test_stop_string_cuts_text_and_its_prefix_is_held_back():
    ids = TOK.encode("one two\n\nthree")
    ct = ChoiceText(TOK, ["\n\nthr"])
    out = [ct.add([i]) for i in ids]
    assert "".join(out) == "one two"
    assert ct.stopped
    assert ct.add(TOK.encode(" more"), final=True) == ""


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    ct = ChoiceText(TOK, ["END"])
    assert ct.add(TOK.encode("abc E")) == "abc "
    assert ct.add(TOK.encode("N")) == ""
    assert ct.add(TOK.encode("x")) == "ENx"
    assert ct.add(TOK.encode(" E"), final=True) == " E"
    assert not ct.stopped


@pytest.mark.parametrize("seed", range(10))
def test_streamed_text_equals_non_streamed_with_stops(seed):
    ids = TOK.encode(TEXT + " STOP after")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(ids)), 5))
    streamed = ChoiceText(TOK, ["STOP", "zzz"])
    pieces = [streamed.add(ids[a:b], final=b == len(ids)) for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    whole = ChoiceText(TOK, ["STOP", "zzz"]).add(ids, final=True)
    assert "".join(pieces) == whole == TEXT + " "


def _one_shot_cut(text: str, stops: list[str]) -> str:
    """The reference: the text before the earliest occurrence of any stop (written here, not CDE's)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text


@pytest.mark.parametrize("seed", range(30))
def test_stops_sharing_prefixes_cut_where_the_whole_text_cuts_at_any_chunking(seed):
    # "bc" completes before "abcd" and "xab", but both start earlier: a streamer that stopped at
    # the first stop it saw complete would cut "...xa" instead of "...x".
    text = "one xabcd two"
    ids = [i for ch in text for i in TOK.encode(ch)]  # a token per character: every cut is possible
    rng = random.Random(seed)
    stops = rng.choice([["bc", "abcd"], ["abcd", "bc"], ["bc", "xab"], ["cd", "bcd", "q"], ["two", "o x"]])
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(1, len(ids) - 1)))
    streamed = ChoiceText(TOK, stops)
    pieces = [streamed.add(ids[a:b], final=b == len(ids)) for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    assert "".join(pieces) == _one_shot_cut(text, stops)


def test_released_tokens_are_those_that_make_the_returned_text():
    ids = TOK.encode("The answer is 8")
    assert [TOK.decode([i]) for i in ids[:2]] == ["The", " answer"]
    ct = ChoiceText(TOK, ["answer", "8"])
    assert ct.add(ids, final=True) == "The " and ct.stopped
    # " answer" holds the text's last character (the space) and the stop: it counts, nothing after.
    assert ct.released == 2
    at_boundary = ChoiceText(TOK, [" answer"])  # the text ends where a token ends: that token is the last
    assert at_boundary.add(ids, final=True) == "The" and at_boundary.released == 1
    whole = ChoiceText(TOK, [])
    assert whole.add(ids, final=True) == "The answer is 8" and whole.released == len(ids)


def test_released_tokens_grow_with_the_text_handed_out():
    ids = TOK.encode("abc END def")
    ct = ChoiceText(TOK, ["END"])
    released = []
    for i in ids:
        ct.add([i])
        released.append(ct.released)
    assert released == sorted(released) and ct.stopped
    assert TOK.decode(ids[: ct.released]).startswith("abc ") and not TOK.decode(ids[: ct.released - 1]).startswith(
        "abc "
    )
