"""Token streaming, logprobs and usage through a real `cde serve` of the demo model
(`cde-reference`, instruct, CPU) and the official `openai` client.

The expected text at a set of stop strings is computed here from the unstopped greedy tokens, by
the documented rule (stops are looked for when a block completes, in the whole text so far, and
the earliest occurrence of any of them cuts it), and the expected token count from those token
ids: never from what CDE answered with the same stops."""

import itertools

import openai
import pytest
from cde.shared.config import PAGE
from cde.shared.tokenizer import get_tokenizer

pytestmark = pytest.mark.slow

TOK = get_tokenizer(True)
CHAT = dict(
    model="cde-reference",
    # 45 prompt tokens: the answer (25 tokens, then EOT) crosses from the prompt's tail block into the next.
    messages=[
        {
            "role": "user",
            "content": "What is 3 + 5? Explain the answer step by step in detail, then tell me about numbers, "
            "and about dust in the village near the rock and the river.",
        }
    ],
    max_tokens=100,
    temperature=0,
)


@pytest.fixture(scope="module")
def client(server):  # the shared demo server (tests/api/conftest.py)
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy(client):
    """The unstopped greedy answer: its text, token ids, and where its first block ends (in characters)."""
    r = client.chat.completions.create(**CHAT, extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    first_block = PAGE - r.usage.prompt_tokens % PAGE  # tokens in the prompt's tail block
    assert len(ids) > first_block, "the answer must cross a block boundary"
    text = r.choices[0].message.content
    assert text == TOK.decode(ids) and text.isascii(), text
    return text, ids, len(TOK.decode(ids[:first_block]))


def _cut(text: str, stops: list[str]) -> str:
    """`text` before the earliest occurrence of any stop."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text


def _expected(text: str, boundary: int, stops: list[str]) -> str:
    """The answer's two blocks are checked at their ends: a stop in the first block's text (up to
    `boundary`) ends the generation there, else the whole text is cut."""
    first = _cut(text[:boundary], stops)
    return first if first != text[:boundary] else _cut(text, stops)


def _tokens_for(ids: list[int], text: str) -> int:
    """The fewest leading tokens whose text begins with `text`."""
    return next(n for n in range(len(ids) + 1) if TOK.decode(ids[:n]).startswith(text))


def _stop_sets(text: str, boundary: int, first_event: int) -> list[list[str]]:
    """first_event: where a streamed prefix of the unstopped answer ends (at least 4 characters in)."""
    i, e = len(text) // 3, first_event
    return [
        [text[boundary - 2 : boundary + 2]],  # straddles the first block boundary
        [text[i : i + 6], text[i + 2 : i + 4]],  # the longer starts first, the shorter completes first
        [text[i : i + 3] + "\x07", text[i + 1 : i + 3]],  # a prefix of one is held back, then given up
        [text[boundary - 3 : boundary + 3], text[boundary - 1 : boundary + 1]],  # both, across the boundary
        # In one block, the longer starts first but completes in a later committed prefix than
        # the shorter: the shorter must not cut the text before the longer one is settled.
        [text[e - 4 : e + 8], text[e - 2 : e]],
        # The longer straddles the boundary: at the first block's end the shorter is complete and cuts.
        [text[boundary - 10 : boundary + 5], text[boundary - 8 : boundary - 6]],
    ]


def _streamed(client, **kw) -> tuple[str, list, int]:
    """The joined text, the content chunks and the usage's completion_tokens of a streamed chat."""
    text, events, usage = "", [], None
    for ch in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
            events.append(ch)
    return text, events, usage


@pytest.mark.parametrize("attribution", [False, True])
def test_streamed_text_is_the_non_streamed_text_at_stop_strings(client, greedy, attribution):
    text, ids, boundary = greedy
    # The end of the first streamed prefix of at least 4 characters (a piece may be one word).
    pieces = [len(e.choices[0].delta.content) for e in _streamed(client, **CHAT)[1]]
    first_event = next(n for n in itertools.accumulate(pieces) if n >= 4)
    assert first_event + 8 < boundary, "the first pieces must leave room for a stop within the first block"
    sets = _stop_sets(text, boundary, first_event)
    for stops in sets if not attribution else sets[::3]:  # attribution: two straddling sets
        extra = {"attribution": True} if attribution else {}
        whole = client.chat.completions.create(**CHAT, stop=stops, extra_body=extra)
        expected = _expected(text, boundary, stops)
        assert whole.choices[0].message.content == expected, stops
        assert whole.choices[0].finish_reason == "stop"
        assert whole.usage.completion_tokens == _tokens_for(ids, expected), stops
        if attribution:  # over the completion's tokens: the stop string's are not in it
            chunks = whole.choices[0].model_extra["attribution"]["chunks"]
            assert chunks[-1]["end"] == whole.usage.completion_tokens, stops
            kept = TOK.decode(ids[: whole.usage.completion_tokens])  # a token the stop cut: whole
            assert "".join(c["text"] for c in chunks) == kept and kept.startswith(expected), stops
        streamed, _, usage = _streamed(client, **CHAT, stop=stops, extra_body=extra)
        assert streamed == expected and usage == whole.usage.completion_tokens, stops


def test_token_streaming_sends_prefixes_within_blocks_and_block_granularity_one_per_block(client, greedy):
    text, _, boundary = greedy
    streamed, events, _ = _streamed(client, **CHAT)
    assert streamed == text
    blocks = 2  # the prompt's tail block and the next
    assert len(events) > blocks + 1, [e.choices[0].delta.content for e in events]
    # Before the first block is complete, some of its text was already sent.
    assert len(events[0].choices[0].delta.content) < boundary
    streamed, events, _ = _streamed(client, **CHAT, extra_body={"stream_granularity": "block"})
    assert streamed == text
    assert [e.choices[0].delta.content for e in events] == [text[:boundary], text[boundary:]]


def test_chat_logprobs_streamed_and_not(client, greedy):
    text, ids, _ = greedy
    r = client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(ids)
    assert "".join(t.token for t in content) == text
    for t in content:  # temperature 0: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    chunks = client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=3, stream=True)
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(**CHAT)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


@pytest.mark.parametrize("alternatives", [0, 2])
def test_completions_top_logprobs_hold_the_sampled_token(client, alternatives):
    """OpenAI's legacy logprobs always hold the sampled token's (up to logprobs + 1 entries), also
    where sampling took a token outside the top alternatives; vLLM lists it first."""
    r = client.completions.create(
        model="cde-reference", prompt="The ocean is", max_tokens=24, temperature=2.0, seed=3, logprobs=alternatives
    )
    lp = r.choices[0].logprobs
    outside = 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert next(iter(top.items())) == (token, logprob) and len(top) <= alternatives + 1
        outside += len(top) == alternatives + 1
    assert alternatives == 0 or outside > 0  # temperature 2 sampled some token outside the top 2


EMOJI = [76460, 222]  # 😀's two tokens: b"\xf0\x9f\x98" and b"\x80", neither a whole character


def test_tokens_inside_a_character_and_specials_keep_their_own_logprobs_entries(client):
    """Both halves of 😀 as the two best alternatives: the legacy object (no `bytes` field) writes
    them as their bytes, two keys, where both decode to U+FFFD alone (their `text_offset`:
    tests/gateway/test_logprobs_render.py). Chat has `bytes` for them, and an end of turn its name and no bytes."""
    bias = {str(t): 30 for t in EMOJI}
    r = client.completions.create(
        model="cde-reference",
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        logprobs=3,
        logit_bias=bias,
        extra_body={"return_token_ids": True},
    )
    lp, ids = r.choices[0].logprobs, r.choices[0].model_extra["token_ids"]
    assert set(ids) <= set(EMOJI) and len(ids) == 4, ids  # the bias forced every token
    assert lp.tokens == ["bytes:\\xf0\\x9f\\x98" if t == EMOJI[0] else "bytes:\\x80" for t in ids]
    for top in lp.top_logprobs:
        assert {"bytes:\\xf0\\x9f\\x98", "bytes:\\x80"} <= set(top) and len(top) == 3

    r = client.chat.completions.create(
        model="cde-reference",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=64,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True, "logit_bias": bias},
    )
    content = r.choices[0].logprobs.content
    first = {t.bytes[0] if t.bytes else None: t for t in content[0].top_logprobs}
    assert first[0xF0].token == first[0x80].token == "\ufffd" and first[0xF0].bytes == [0xF0, 0x9F, 0x98]
    r = client.chat.completions.create(
        **{**CHAT, "max_tokens": 64}, logprobs=True, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    eot = [t for i, t in zip(r.choices[0].model_extra["token_ids"], r.choices[0].logprobs.content) if i == TOK.eot_id]
    assert eot and all(t.token == "<|eot_id|>" and t.bytes is None for t in eot)


def test_completions_logprobs_streamed_and_not_with_a_stop(client, greedy):
    text, ids, boundary = greedy
    stop = text[boundary - 2 : boundary + 2]
    kw = dict(model="cde-reference", prompt=TOK.chat_prompt(CHAT["messages"]), max_tokens=100)
    r = client.completions.create(**kw, temperature=0, logprobs=2, stop=[stop])
    lp = r.choices[0].logprobs
    expected = _expected(text, boundary, [stop])
    assert r.choices[0].text == expected
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert r.usage.completion_tokens == _tokens_for(ids, expected)
    assert "".join(lp.tokens).startswith(expected)
    assert lp.text_offset == [len("".join(lp.tokens[:n])) for n in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and next(iter(top)) == token and top[token] == logprob
    chunks = list(client.completions.create(**kw, temperature=0, logprobs=2, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset
    assert [x for s in streamed for x in s.token_logprobs] == lp.token_logprobs
