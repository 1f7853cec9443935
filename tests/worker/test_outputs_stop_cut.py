"""worker/outputs.py's stop cut (`stop_cut`) against the gateway's detokenizer (gateway/detokenizer.py, where
the client's text comes from), over characters split across tokens and invalid bytes: the tokens
the worker keeps read, unstreamed, as the text cut at the earliest stop, and the worker counts the
completion as the gateway does (`usage.completion_tokens`, the span input attribution covers)."""

import random

import pytest
from cde.gateway.detokenizer import ChoiceText
from cde.shared.stops import find_stop
from cde.shared.tokenizer import Tokenizer
from cde.worker.outputs import stop_cut

TOK = Tokenizer()
# cl100k pieces: 76460 = F0 9F 98 (the first three bytes of 😀 and 😞), 222 = 80 (😀's last), 252 =
# 9E (😞's, or 語's after 45918 = E8 AA), 9468 236 231 = 🎉; whole 日 (9080), 本 (22656), " the", " cat".
PIECES = [76460, 222, 252, 45918, 9468, 236, 231, 9080, 22656, 279, 8415]
STOPS = [["\ufffd"], ["日"], ["本", "😀"], ["😞"], ["語"], [" cat"]]


def worker(ids: list[int], edge: int, stops: list[str]) -> tuple[list[int], int]:
    """The tokens the worker keeps and the completion it counts, its blocks ids[:edge] and
    ids[edge:] checked as each completes (OutputStage._stop_strings). It counts within the block
    the stop ended (`Sequence.text_tokens`), the blocks before it whole."""
    for generated, new in ((ids[:0], ids[:edge]), (ids[:edge], ids[edge:])):
        cut = stop_cut(TOK, generated, new, stops)
        if cut is not None:
            return generated + cut[0], len(generated) + cut[1]
    return ids, len(ids)


def check(ids: list[int], edge: int, stops: list[str]) -> None:
    streamed = TOK.decode_so_far(ids)  # all the tokens, as a stream shows them before the last
    found = find_stop(streamed, stops)
    kept, counted = worker(ids, edge, stops)
    client = ChoiceText(TOK, stops)
    text = client.add(kept[:edge]) + client.add(kept[edge:], final=True)  # the request ends with its stop
    if found is None:
        assert kept == ids
        return
    assert text == streamed[: found[0]], (ids, stops)
    before = edge if len(kept) > edge else 0  # the tokens of the blocks before the one the stop ended
    assert counted == max(client.released, before), (ids, edge, stops)


@pytest.mark.parametrize(
    "ids,stops,text,tokens",
    [
        # the emoji's head alone is no U+FFFD yet: the stop is the invalid sequence after 😞
        ([76460, 252, 76460, 9080], ["\ufffd"], "😞", 2),
        ([76460, 222, 76460, 222, 9080], ["日"], "😀😀", 4),  # the token completing 😀 counts
    ],
)
def test_a_character_split_across_tokens_is_cut_and_counted_as_the_client_reads_it(ids, stops, text, tokens):
    kept, counted = worker(ids, len(ids), stops)
    client = ChoiceText(TOK, stops)
    assert (client.add(kept, final=True), counted, client.released) == (text, tokens, tokens)


@pytest.mark.parametrize("seed", range(8))
def test_random_pieces_are_cut_and_counted_as_the_client_reads_them(seed):
    rng = random.Random(seed)
    for _ in range(300):
        ids = [rng.choice(PIECES) for _ in range(rng.randint(1, 10))]
        check(ids, rng.randint(0, len(ids)), rng.choice(STOPS))
