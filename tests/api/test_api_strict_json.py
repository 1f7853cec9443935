"""Every body and SSE event of a real `cde serve` is RFC 8259 JSON, whatever strength a client
steers with (out of range: a 400 naming the field; at the bound: finite numbers throughout), and
the errors a new user meets name the field to fix."""

import contextlib
import json
import math

import httpx
import pytest
from cde.gateway.json_out import JsonResponse
from cde.gateway.prompts import MAX_TOKEN_BYTES
from cde.gateway.sse import event
from cde.shared.limits import MAX_STEERING_STRENGTH
from cde.shared.tokenizer import get_tokenizer

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PROMPT = {"prompt": "hi"}


@pytest.fixture(scope="module")
def server(tiny_chat_server):
    return tiny_chat_server


def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def strict(text: str):
    return json.loads(text, parse_constant=_refuse)


def bodies(server, path: str, body: dict) -> tuple[int, list]:
    """The status and every JSON document of the response (each SSE event when streamed), parsed
    strictly: NaN, Infinity and -Infinity raise."""
    with httpx.stream("POST", f"{server.base_url}/{path}", json={"model": "tiny", **body}, timeout=120) as r:
        text = r.read().decode()
    if not body.get("stream") or r.status_code != 200:
        return r.status_code, [strict(text)]
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return r.status_code, [strict(e) for e in events[:-1]]


def numbers(doc) -> list[float]:
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in numbers(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in numbers(v)]
    return [doc] if isinstance(doc, float) else []


ROUTES = [("completions", PROMPT), ("chat/completions", CHAT)]
MODES = [{"stream": s, "attribution": a} for s in (False, True) for a in (False, {"top_k": 5, "per_token": True})]


@pytest.mark.parametrize(
    "steering,param",
    [
        ({"concepts": [3], "strength": 1e39}, "steering.strength"),
        ({"concepts": [3], "strength": -1e39}, "steering.strength"),
        ({"concepts": [3], "strength": 1e20}, "steering.strength"),
        ({"concepts": [3], "strength": 1e300, "normalize": False}, "steering.strength"),
        ({"concepts": [3], "strength": MAX_STEERING_STRENGTH + 0.5}, "steering.strength"),
        ({"concepts": [3], "relu_logit_mask": {"3": 1e39}}, "steering.relu_logit_mask"),
    ],
)
@pytest.mark.parametrize("route,base", ROUTES)
def test_out_of_range_steering_is_a_400_naming_the_field(server, steering, param, route, base):
    for mode in MODES:
        status, (doc,) = bodies(server, route, {**base, **mode, "max_tokens": 8, "steering": steering})
        assert status == 400 and doc["error"]["param"] == param, doc


@pytest.mark.parametrize(
    "steering",
    [
        {"concepts": [3], "strength": MAX_STEERING_STRENGTH},
        {"concepts": [3, 5], "strength": -MAX_STEERING_STRENGTH, "normalize": False, "schedule": "fixed"},
        {
            "concepts": [3],
            "preset": "suppress",
            "strength": -MAX_STEERING_STRENGTH,
            "relu_logit_mask": {"3": MAX_STEERING_STRENGTH, "5": -MAX_STEERING_STRENGTH},
        },
    ],
)
@pytest.mark.parametrize("route,base", ROUTES)
def test_steering_at_the_bound_answers_finite_json(server, steering, route, base):
    for mode in [*MODES, {"stream": True, "stream_denoise": True, "attribution": {"per_token": True}}]:
        status, docs = bodies(
            server, route, {**base, **mode, "max_tokens": 40, "tokens_per_step": 8, "steering": steering}
        )
        assert status == 200, docs
        assert all(math.isfinite(x) for doc in docs for x in numbers(doc))
        if mode["attribution"]:
            assert any("attribution" in c for doc in docs for c in doc["choices"])


def test_non_finite_numbers_are_written_as_null():
    doc = {"a": [1.5, math.nan, {"b": math.inf, "c": -math.inf}], "d": "NaN"}
    expected = {"a": [1.5, None, {"b": None, "c": None}], "d": "NaN"}
    assert strict(JsonResponse(doc).body.decode()) == expected
    assert strict(event(doc).decode().removeprefix("data: ")) == expected


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("completions", {"prompt": "a" * 200_000}, "prompt"),  # refused before tokenizing: over 128 bytes a token
        ("completions", {"prompt": "hello " * 20_000}, "prompt"),  # tokenized: 20,000 tokens
        ("completions", {"prompt": ["hi", "hello " * 20_000]}, "prompt"),
        ("completions", {"prompt": [7] * 2000}, "prompt"),
        ("completions", {"prompt": [7] * 1000, "max_tokens": 100}, "max_tokens"),
        ("chat/completions", {"messages": [{"role": "user", "content": "a" * 200_000}]}, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hello " * 20_000}]}, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}] * 300}, "messages"),
        ("chat/completions", {**CHAT, "max_completion_tokens": 5000}, "max_completion_tokens"),
        ("chat/completions", {**CHAT, "max_tokens": 5000}, "max_tokens"),
    ],
)
def test_context_overflow_names_the_field_to_shorten(server, route, body, param):
    status, (doc,) = bodies(server, route, body)
    assert status == 400 and doc["error"]["code"] == "context_length_exceeded"
    assert doc["error"]["param"] == param, doc


def test_no_token_is_longer_than_the_prompt_bound():
    """A prompt of more bytes than MAX_TOKEN_BYTES x context is refused untokenized: sound only if
    no token of the tokenizer is longer."""
    enc = get_tokenizer(True).enc
    lengths = []
    for t in range(enc.n_vocab):
        with contextlib.suppress(KeyError):  # the gaps between the ranks and the special tokens
            lengths.append(len(enc.decode_single_token_bytes(t)))
    assert max(lengths) == MAX_TOKEN_BYTES


@pytest.mark.parametrize(
    "fmt", [{"type": "xml"}, {"type": "json_schema"}, {"type": "json_object", "json_schema": {"name": "x"}}]
)
def test_a_malformed_response_format_names_itself(server, fmt):
    status, (doc,) = bodies(server, "chat/completions", {**CHAT, "response_format": fmt})
    assert status == 400 and doc["error"]["param"].startswith("response_format"), doc
    assert bodies(server, "chat/completions", {**CHAT, "max_tokens": 2, "response_format": {"type": "text"}})[0] == 200


@pytest.mark.parametrize("prompt", [5, 2.5, True, None, {"text": "hi"}])
def test_a_prompt_of_the_wrong_type_says_what_a_prompt_may_be(server, prompt):
    status, (doc,) = bodies(server, "completions", {"prompt": prompt})
    err = doc["error"]
    assert status == 400 and err["param"] == "prompt"
    assert "string" in err["message"] and "token ids" in err["message"]
