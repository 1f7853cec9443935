"""Hostile requests against a real `cde serve`: each must get an OpenAI error JSON (naming the
`param` where there is one), never a 500, and leave the server healthy and serving."""

import json
import select
import socket
from urllib.parse import urlparse

import httpx
import pytest

MODEL = "tiny"
LIMIT = 4 << 20  # the default --max-request-bytes
MB = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_chat_server):
    return tiny_chat_server


@pytest.fixture(autouse=True)
def still_serving(server):
    """After every hostile case: healthy, and a normal request still completes."""
    yield
    assert server.health()[0] == 200
    r = post(server, {"model": MODEL, "prompt": "ok", "max_tokens": 2, "tokens_per_step": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def post(server, body, path="/completions", **kw):
    return httpx.post(server.base_url + path, json=body, timeout=60, **kw)


def raw_post(server, content: bytes, path="/completions", content_type="application/json"):
    return httpx.post(server.base_url + path, content=content, headers={"Content-Type": content_type}, timeout=60)


def assert_error(r, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    # `param` names the field, or a path inside it (`prompt.3`).
    assert err["param"] == param or (param and err["param"].startswith(param + ".")), err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- size ----------------------------------------------------------------------------------------
def _http(server, head: bytes, chunks=()) -> tuple[bytes, int]:
    """Send a raw request; returns (response bytes, body bytes the server let us send)."""
    url = urlparse(server.url)
    sent = 0
    with socket.create_connection((url.hostname, url.port), timeout=5) as s:
        s.sendall(head)
        for chunk in chunks:
            if select.select([s], [], [], 0)[0]:
                break  # the server answered before reading the rest
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            sent += len(chunk)
        s.settimeout(30)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            reply += data
    return reply, sent


def _status_and_error(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[body.index(b"{") : body.rindex(b"}") + 1])["error"]


def test_content_length_over_limit_is_413_before_any_body(server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (LIMIT + 1)
    )
    status, err = _status_and_error(_http(server, head)[0])  # no body sent at all
    assert status == 413 and err["code"] == "request_too_large" and str(LIMIT) in err["message"]


def test_streamed_body_over_limit_is_413_without_reading_it_all(server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b" " * 65536
    total = 64 * MB
    reply, sent = _http(server, head, (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(total // len(piece))))
    status, err = _status_and_error(reply)
    assert status == 413 and err["code"] == "request_too_large"
    assert sent < total // 2, f"the server read {sent} bytes of a {total}-byte body"


def test_body_just_under_limit_is_parsed(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": "u" * (LIMIT - 200)}).encode()
    assert len(body) < LIMIT
    assert raw_post(server, body).status_code == 200


# ---- echoes --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": MODEL, "prompt": "hi", "x" * MB: 1}, 400, "x" * 128),
        ({"model": "m" * MB, "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": "hi", "steering": {"concepts": ["label" * (MB // 5)]}}, 400, "steering.concepts"),
        ({"model": MODEL, "prompt": "hi", "steering": {"concepts": ["#" + "9" * 10000]}}, 400, "steering.concepts"),
        ({"model": MODEL, "prompt": "hi", "stop": ["s"] * 100000}, 400, "stop"),
    ],
)
def test_errors_never_echo_the_input(server, body, status, param):
    r = post(server, body)
    assert_error(r, status, param)
    assert len(r.content) < 2048


# ---- structure -----------------------------------------------------------------------------------
def test_deep_nesting_is_400(server):
    deep = b"[" * 200_000 + b"]" * 200_000
    assert_error(raw_post(server, b'{"model": "tiny", "prompt": ' + deep + b"}"), 400, None, "invalid_json")
    shallow_but_wrong = json.loads("[" * 500 + "]" * 500)
    assert_error(post(server, {"model": MODEL, "prompt": shallow_but_wrong}), 400, "prompt")


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("n", 10**6, "n"),
        ("n", 0, "n"),
        ("max_tokens", 10**12, "max_tokens"),
        ("max_tokens", 2000, "max_tokens"),  # over the model's context
        ("top_k", 2**63, "top_k"),
        ("seed", 2**70, "seed"),
        ("stop_token_ids", [1] * 1000, "stop_token_ids"),
    ],
)
def test_huge_numbers_are_400_with_param(server, field, value, param):
    assert_error(post(server, {"model": MODEL, "prompt": "hi", field: value}), 400, param)


def test_too_many_choices_is_400(server):
    assert_error(post(server, {"model": MODEL, "prompt": ["a"] * 8, "n": 16}), 400, "n")
    assert_error(post(server, {"model": MODEL, "prompt": ["a"] * 65}), 400, "prompt")


def test_integer_with_thousands_of_digits_is_400(server):
    raw = b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    assert_error(raw_post(server, raw), 400, None, "invalid_json")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
@pytest.mark.parametrize(
    "field,param",
    [
        (b'"temperature": %s', "temperature"),
        (b'"steering": {"concepts": [1], "strength": %s}', "steering.strength"),
        (b'"steering": {"concepts": [1], "relu_logit_mask": {"1": %s}}', "steering.relu_logit_mask"),
    ],
)
def test_nan_and_infinity_are_400(server, literal, field, param):
    raw = b'{"model": "tiny", "prompt": "hi", ' + field % literal + b"}"
    err = assert_error(raw_post(server, raw), 400, param)
    assert "finite" in err["message"]


def test_invalid_utf8_is_400(server):
    assert_error(raw_post(server, b'{"model": "tiny", "prompt": "\xff\xfe\xc3"}'), 400, None, "invalid_json")


@pytest.mark.parametrize(
    "path,raw,param",
    [
        ("/completions", rb'{"model": "tiny", "prompt": "a\ud800b"}', "prompt"),
        (
            "/chat/completions",
            rb'{"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]}',
            "messages.0.content",
        ),
        ("/completions", rb'{"model": "tiny\udc00", "prompt": "x"}', "model"),
    ],
)
def test_lone_surrogates_are_400(server, path, raw, param):
    assert_error(raw_post(server, raw, path), 400, param, "invalid_json")


@pytest.mark.parametrize(
    "raw,param",
    [
        # U+D800's bytes as UTF-8 would write them, in a string each layer reads differently.
        (b'{"model": "tiny", "prompt": "a\xed\xa0\x80b"}', None),
        (b'{"model": "tiny", "prompt": "x", "stop": ["\xed\xa0\x80"]}', None),
        (b'{"model": "tiny\xed\xb0\x80", "prompt": "x"}', None),
        # A UTF-16 body (json.detect_encoding's other reading): an escaped and a bare surrogate.
        ('{"model": "tiny", "prompt": "a\\ud800"}'.encode("utf-16-le"), "prompt"),
        (b'{\x00"\x00p\x00"\x00:\x00"\x00\x00\xd8"\x00}\x00', None),
    ],
    ids=["utf8-prompt", "utf8-stop", "utf8-model", "utf16-escaped", "utf16-bare"],
)
def test_lone_surrogates_in_the_bytes_are_400_and_the_connection_lives(server, raw, param):
    """Not only as JSON escapes: raw bytes that Python's json would decode to a surrogate, which
    no later layer (the tokenizer, the wire, a response) can encode; one connection carries the
    next request, so the error left it usable."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        r = client.post("/completions", content=raw, headers={"Content-Type": "application/json"})
        assert_error(r, 400, param, "invalid_json")
        assert client.post("/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


# ---- meaning -------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [[-1], [100284], [10**30], [[5], [-3]], [1, "2"], [True]])
def test_token_ids_out_of_range_are_400(server, prompt):
    assert_error(post(server, {"model": MODEL, "prompt": prompt}), 400, "prompt")


@pytest.mark.parametrize(
    "steering,param",
    [
        ({"concepts": ["no such concept"]}, "steering.concepts"),
        ({"concepts": [96]}, "steering.concepts"),
        ({"concepts": [-1]}, "steering.concepts"),
        ({"concepts": [1], "relu_logit_mask": {"nope": 2.0}}, "steering.relu_logit_mask"),
        ({"concepts": []}, "steering.concepts"),
    ],
)
def test_unknown_concepts_are_400(server, steering, param):
    for path, body in (
        ("/completions", {"prompt": "hi"}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        assert_error(post(server, {"model": MODEL, **body, "steering": steering}, path), 400, param)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "application/jsonx"],
)
def test_wrong_content_type_is_400(server, content_type):
    raw = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    assert_error(raw_post(server, raw, content_type=content_type), 400, None, "unsupported_content_type")


@pytest.mark.parametrize(
    "raw,param,code",
    [
        (b"", None, "invalid_json"),
        (b"{", None, "invalid_json"),
        (b"null", None, None),
        (b"[]", None, None),
        (b'"prompt"', None, None),
        (b'{"model": "tiny"}', "prompt", "missing_required_parameter"),
    ],
)
def test_non_object_bodies_are_400(server, raw, param, code):
    assert_error(raw_post(server, raw), 400, param, code)
