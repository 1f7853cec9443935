"""gateway/logprobs_render.py: the legacy completions object's token strings and `text_offset`
where tokens split characters, checked against the decoded text itself."""

import pytest
from cde.gateway.logprobs_render import CompletionLogprobsRenderer
from cde.shared.tokenizer import get_tokenizer

TOK = get_tokenizer(True)
HEAD, TAIL = TOK.encode("😀")  # b"\xf0\x9f\x98", b"\x80"
A = TOK.encode("a")[0]


def _offsets_in_text(ids: list[int]) -> list[int]:
    """Where each token's first byte lies in the completion's text, found from the text alone:
    a byte position splits the text where decoding the two sides apart gives the same text; a
    token starting inside a character starts at that character."""
    pieces = [TOK.decode_bytes([t]) for t in ids]
    whole = b"".join(pieces)
    text = whole.decode("utf-8", errors="replace")
    out, start = [], 0
    for piece in pieces:
        cut = max(
            b
            for b in range(start + 1)
            if whole[:b].decode("utf-8", "replace") + whole[b:].decode("utf-8", "replace") == text
        )
        out.append(len(whole[:cut].decode("utf-8", "replace")))
        start += len(piece)
    return out


@pytest.mark.parametrize(
    "ids",
    [
        [HEAD, TAIL, HEAD, TAIL],  # two whole emoji
        [HEAD, HEAD, HEAD, HEAD],  # each start given up by the next
        [HEAD, A, A],  # a start given up by plain text
        [TAIL, HEAD, TAIL, A],  # a stray continuation byte, then a whole emoji
        [A, HEAD],  # ends inside a character
    ],
)
def test_text_offset_is_where_each_token_starts_in_the_text(ids):
    rows = [(-1.0, [], [])] * len(ids)
    renderer = CompletionLogprobsRenderer(TOK)
    whole = renderer.render(ids, rows).text_offset
    assert whole == _offsets_in_text(ids)
    streamed = CompletionLogprobsRenderer(TOK)  # chunk by chunk: the same offsets
    assert [x for i in range(len(ids)) for x in streamed.render(ids[i : i + 1], rows[:1]).text_offset] == whole


def test_alternatives_never_share_a_key():
    """Both halves of an emoji, a special and ids with no text: each its own key."""
    no_text = [100256, 100261]
    alternatives = [HEAD, TAIL, TOK.eot_id, *no_text]
    (top,) = CompletionLogprobsRenderer(TOK).render([A], [(-1.0, alternatives, [-2.0] * 5)]).top_logprobs
    emoji = ["bytes:\\xf0\\x9f\\x98", "bytes:\\x80"]
    assert list(top) == ["a", *emoji, "<|eot_id|>", "token_id:100256", "token_id:100261"]
