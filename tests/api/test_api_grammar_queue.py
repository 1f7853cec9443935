"""The line of grammar checks at a real `cde serve` (gateway/grammar_checker.py): a grammar that
overruns the check's bound holds a checker for CHECK_TIMEOUT_S, so the line is bounded (more
pending checks get a 429 at once, from one client or in all) and a check whose client hung up is
never run. Either way another client's cheap grammar is answered after the checks already running,
not after the whole line. Clients from other loopback addresses are other clients."""

import asyncio
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from cde.gateway.grammar_checker import CHECK_TIMEOUT_S, MAX_PENDING, MAX_PENDING_PER_CLIENT

# Wall-clock bounds on a check's wait: alone on the machine
pytestmark = [pytest.mark.serial]

PATH = "/v1/chat/completions"
SLOW = {"regex": "a{300000}"}  # compiles for ~20 s: refused at CHECK_TIMEOUT_S
CHEAP = {"choice": ["yes", "no"]}
# A cheap check waits for the checks running (CHECK_TIMEOUT_S), a checker's restart (~1.4 s: the
# overrun one was killed), its own check and 4 tokens: ~3.5 s. Behind the eight slow checks of the
# audit it waited for them all: 11 s and more.
PROMPT_S = CHECK_TIMEOUT_S + 5


def chat(outputs: dict) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Yes or no?"}],
        "max_tokens": 4,
        "structured_outputs": outputs,
    }


def client(server, address: str) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=server.url, timeout=60, transport=transport)


def assert_refused(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == code, error
    assert error["param"] == "structured_outputs" and "waiting for a check" in error["message"], error
    assert r.headers["retry-after"] == "1"


async def cheap_answer_took(server) -> float:
    async with client(server, "127.0.0.1") as other:
        t0 = time.monotonic()
        r = await other.post(PATH, json=chat(CHEAP))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in CHEAP["choice"], r.text
        return time.monotonic() - t0


async def first_answers(tasks: list[asyncio.Task], n: int, within: float) -> set[asyncio.Task]:
    """The first `n` of `tasks` to end, as soon as they have; fewer if `within` seconds pass first."""
    done: set[asyncio.Task] = set()
    deadline = time.monotonic() + within
    while len(done) < n and (left := deadline - time.monotonic()) > 0:
        ended, _ = await asyncio.wait(set(tasks) - done, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        done |= ended
    return done


async def test_a_full_line_is_refused_at_once_and_others_are_still_served(tiny_chat_server):
    """One client's checks beyond its share get a 429 `client_overloaded` at once, and any check
    beyond the line's bound a 429 `overloaded`; once the flooding clients hang up, another client's
    cheap grammar is answered after the checks running."""
    assert MAX_PENDING == 2 * MAX_PENDING_PER_CLIENT  # two flooding clients fill the line
    async with client(tiny_chat_server, "127.0.0.2") as a, client(tiny_chat_server, "127.0.0.3") as b:
        # One over its share from each: once both are refused, both shares (the whole line) are taken.
        flood = [
            asyncio.create_task(cl.post(PATH, json=chat(SLOW)))
            for cl in (a, b)
            for _ in range(MAX_PENDING_PER_CLIENT + 1)
        ]
        # Long before a slow check ends (its bound, after the checkers' start: ~3.4 s).
        refused = await first_answers(flood, 2, within=3.0)
        assert len(refused) == 2, [t.result().text for t in refused]
        for task in refused:
            assert_refused(task.result(), "client_overloaded")
        async with client(tiny_chat_server, "127.0.0.4") as c:
            assert_refused(await asyncio.wait_for(c.post(PATH, json=chat(CHEAP)), 3.0), "overloaded")
        waiting = set(flood) - refused
        for task in waiting:
            task.cancel()  # and the clients' exits close their connections
        await asyncio.gather(*waiting, return_exceptions=True)
    assert await cheap_answer_took(tiny_chat_server) < PROMPT_S


@pytest.mark.parametrize("path", [PATH, "/v1/completions"])
async def test_checks_of_clients_that_hung_up_are_not_run(tiny_chat_server, path):
    """The audit's case: eight slow grammars from connections closed right after their request,
    from four addresses (so that neither one client's share nor the turns between clients hides
    them): a later client's check waits for the two running, not for the rest."""
    url = urlparse(tiny_chat_server.url)
    slow = (
        chat(SLOW)
        if path == PATH
        else {"model": "tiny", "prompt": "Yes or no?", "max_tokens": 4, "structured_outputs": SLOW}
    )
    body = httpx.Request("POST", "http://x" + path, json=slow).content
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    for i in range(8):
        address = (f"127.0.0.{2 + i % 4}", 0)
        with socket.create_connection((url.hostname, url.port), source_address=address) as s:
            s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await asyncio.sleep(0.05)
    assert await cheap_answer_took(tiny_chat_server) < PROMPT_S
