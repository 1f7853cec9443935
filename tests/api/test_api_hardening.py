"""The HTTP listener of a real `cde serve` against a penetration test's findings: slow and idle
connections time out, connections are capped, a foreign Host or a second Authorization header is
refused, the page's security headers are set, /health shows pids and paths only to a key holder,
a hang-up mid-body is a 499 (no traceback), and one huge request does not starve the others."""

import json
import select
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.api_server import ServerProcess

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, MAX_CONNECTIONS = 1.0, 2.0, 1.0, 8
ORIGIN = "https://app.example"  # a web app allowed by --allowed-origins


@pytest.fixture(scope="module")
def server(tiny_instruct_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    srv = ServerProcess(
        tiny_instruct_dir,
        "--api-key-file",
        str(key_file),
        "--served-model-name",
        "tiny",
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--keep-alive-timeout",
        str(KEEP_ALIVE),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--allowed-origins",
        f"{ORIGIN}/, https://other.example",
        workers=1,
    )
    yield srv
    srv.stop()


def connect(server) -> socket.socket:
    url = urlparse(server.url)
    return socket.create_connection((url.hostname, url.port), timeout=15)


def read_reply(sock) -> tuple[int, dict, bytes]:
    """Status, headers and body of one response (b"" and status 0 when the server just closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def completion(server, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "tokens_per_step": 4, **extra}
    return httpx.post(server.base_url + "/completions", json=body, headers=AUTH, timeout=60)


def test_page_and_static_files_carry_security_headers(server):
    for path in ("/", "/static/playground.js", "/static/playground.css"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["referrer-policy"] == "no-referrer"


def test_a_foreign_host_is_refused_on_a_loopback_listener(server):
    port = urlparse(server.url).port
    for path in ("/", "/v1/models/", "/health"):  # /v1/models/ redirected to the Host it was given
        r = httpx.get(server.url + path, headers={"Host": f"rebound.attacker.example:{port}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert "attacker" not in str(r.headers)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200


def test_pages_of_the_allowed_origins_may_call_the_api(server):
    """A browser asks first (a preflight, without the API key), then sends the request; it lets
    the page read an answer, errors included, only when that answer names the page's origin."""
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.base_url + "/chat/completions", headers={"Origin": ORIGIN, **ask})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "POST" in r.headers["access-control-allow-methods"]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    r = httpx.post(server.base_url + "/completions", json=body, headers={"Origin": ORIGIN, **AUTH}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(server.base_url + "/completions", json=body, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    for foreign in ("https://attacker.example", "https://app.example.evil"):
        r = httpx.options(server.base_url + "/chat/completions", headers={"Origin": foreign, **ask})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.get(server.url + "/health", headers={"Origin": foreign})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_two_authorization_headers_are_refused(server):
    wrong = "Bearer nope"
    for pair in ((AUTH["Authorization"], wrong), (wrong, AUTH["Authorization"]), (AUTH["Authorization"],) * 2):
        headers = httpx.Headers([("Authorization", value) for value in pair])
        r = httpx.get(server.base_url + "/models", headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_authorization"


def test_health_shows_pids_and_paths_only_with_the_key(server):
    (public,) = httpx.get(server.url + "/health").json()["workers"]
    assert public["alive"] and "pid" not in public and "endpoint" not in public
    assert "ipc" not in httpx.get(server.url + "/health").text
    (private,) = httpx.get(server.url + "/health", headers=AUTH).json()["workers"]
    assert private["endpoint"].startswith("ipc://") and private["pid"] > 0
    # --api-key-file: the key is on no command line another local user can read.
    assert KEY.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    assert KEY.encode() not in Path(f"/proc/{private['pid']}/cmdline").read_bytes()


def test_idle_and_slow_headers_time_out(server):
    with connect(server) as idle:
        t0 = time.monotonic()
        assert idle.recv(100) == b""  # closed, without a word
        assert time.monotonic() - t0 < HEADER_TIMEOUT + 3
    with connect(server) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        t0 = time.monotonic()
        status, _headers, body = read_reply(slow)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert time.monotonic() - t0 < HEADER_TIMEOUT + 3
    with connect(server) as kept:  # keep-alive: a second request that never completes
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_reply(kept)[0] == 200
        kept.sendall(b"GET /he")
        assert read_reply(kept)[0] in (0, 408)


def test_a_slow_body_gets_408(server):
    with connect(server) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{"
        )
        t0 = time.monotonic()
        # One byte at a time (the pen test's 1 byte/s body got a 200), until the server answers.
        while not select.select([s], [], [], 0.3)[0] and time.monotonic() - t0 < BODY_TIMEOUT + 5:
            s.sendall(b" ")
        status, headers, body = read_reply(s)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert headers["connection"] == "close" and time.monotonic() - t0 < BODY_TIMEOUT + 3


@pytest.mark.parametrize("auth", [b"", b"Authorization: Bearer " + KEY.encode() + b"\r\n"])
def test_an_early_answer_closes_a_connection_whose_body_trickles(server, auth):
    """A 401 (no key) or a 404 given before the body arrived: the connection closes, whatever
    the client still sends (each byte used to re-arm the keep-alive timer: held for ever)."""
    with connect(server) as s:
        s.sendall(b"POST /v1/nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + b"Content-Length: 100000\r\n\r\n{")
        status, headers, _body = read_reply(s)
        assert status == (404 if auth else 401)
        assert headers["connection"] == "close"  # a client must not keep it for its next request
        t0 = time.monotonic()
        with pytest.raises(OSError):  # the server closed: a reset, or a broken pipe, as bytes go on
            while time.monotonic() - t0 < HEADER_TIMEOUT + BODY_TIMEOUT + 5:
                s.sendall(b" ")
                if select.select([s], [], [], 0.3)[0] and s.recv(100) == b"":
                    raise ConnectionResetError("closed")
        assert time.monotonic() - t0 < 3


def test_an_answer_after_the_whole_body_keeps_the_connection(server):
    """Only an early answer closes: one given after its body was read (a 200, or a 401 whose
    small body came with its head) leaves the connection to the client's next request."""
    body = b'{"model": "tiny", "prompt": "hi"}'
    head = b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n" % len(body)
    with connect(server) as s:
        for auth in (b"Authorization: Bearer " + KEY.encode() + b"\r\n", b""):
            s.sendall(head + auth + b"\r\n" + body)
            status, headers, _body = read_reply(s)
            assert status == (200 if auth else 401) and "connection" not in headers, headers
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_reply(s)[0] == 200


@pytest.mark.parametrize("size", [60_000, 15_000])
@pytest.mark.parametrize("eol", [b"\r\n", b"\n"])
def test_request_headers_past_16_kib_are_refused_whole(server, size, eol):
    """A head that arrives in one read (asyncio reads up to 256 KiB), which h11 takes whole, with
    either line ending h11 reads; then a small request on the same connection, as pipelined."""
    with connect(server) as s:
        small = b"GET /health HTTP/1.1" + eol + b"Host: 127.0.0.1" + eol + eol
        s.sendall(b"GET /health HTTP/1.1" + eol + b"Host: 127.0.0.1" + eol + b"X-Pad: " + b"a" * size + eol + eol)
        status, headers, body = read_reply(s)
        if size > 16 << 10:
            assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
            assert headers["connection"] == "close"
            return
        assert status == 200
        s.sendall(small)
        assert read_reply(s)[0] == 200


def test_connections_are_capped(server):
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        with connect(server) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: " + ORIGIN.encode() + b"\r\n\r\n")
            status, headers, body = read_reply(extra)
            assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
            assert headers["connection"] == "close"
            assert headers["access-control-allow-origin"] == ORIGIN  # the page may read why
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_hang_up_mid_body_is_logged_as_499(server):
    with connect(server) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + KEY.encode()
            + b'\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{"mo'
        )
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while not (lines := [line for line in server.output if '"POST", "path": "/v1/chat/completions"' in line]):
        assert time.monotonic() < deadline, "".join(server.output[-20:])
        time.sleep(0.1)
    assert '"status": 499' in lines[-1]
    logs = "".join(server.output)
    assert "Traceback" not in logs and '"status": 500' not in logs


def test_one_huge_request_does_not_starve_the_others(server):
    # The pen test's request: 1 MB, n 16, 500,000 concepts. It held the event loop for 10 s, the
    # worker missed its heartbeats and every other client got 503 no_worker for ~48 s.
    attack = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 16, "steering": {"concepts": [1] * 500_000}}
    assert len(json.dumps(attack)) > 1_000_000
    answers: list[httpx.Response] = []

    def attacker():
        for _ in range(3):
            answers.append(httpx.post(server.base_url + "/completions", json=attack, headers=AUTH, timeout=120))

    thread = threading.Thread(target=attacker)
    thread.start()
    honest = []
    while thread.is_alive() or len(honest) < 3:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        honest.append(completion(server).status_code)
    thread.join()
    assert set(honest) == {200}
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["param"] == "steering.concepts", r.text[:300]
