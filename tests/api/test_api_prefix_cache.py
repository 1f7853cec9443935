"""Prefix caching through the API of a real `cde serve` (two workers, prefix routing) with the real
openai client: usage.prompt_tokens_details.cached_tokens on chat and completions, streamed with
include_usage; the same answer cached or not; /metrics' prefix cache gauges; and a server with
--no-prefix-cache that reports none."""

import time

import openai
import pytest

from tests.api_server import ServerProcess

SYSTEM = " ".join(f"rule {i}: answer in plain words." for i in range(40))  # > 3 pages of tokens


@pytest.fixture(scope="module")
def server(tiny_instruct_dir):
    srv = ServerProcess(tiny_instruct_dir, "--served-model-name", "tiny", workers=2)
    yield srv
    srv.stop()


def chat(client: openai.OpenAI, question: str, **kw):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, **kw)


def fresh_metrics(server, ready, timeout: float = 10.0) -> dict[str, float]:
    """/metrics once `ready` holds: the worker gauges are the gateway's last heartbeats, which may
    predate requests that finished within one heartbeat interval."""
    deadline = time.monotonic() + timeout
    while not ready(m := server.metrics()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return m


def test_a_second_request_with_the_same_system_prompt_finds_its_pages_cached(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    first = chat(client, "What is one plus one?")
    assert first.usage.prompt_tokens > 3 * 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat(client, "And two plus two?")  # routed to the worker holding the first page
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 3 * 64 and cached % 64 == 0 and cached <= second.usage.prompt_tokens
    again = chat(client, "What is one plus one?")  # every full page cached: the same answer
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // 64 * 64
    chunks = list(chat(client, "What is one plus one?", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // 64 * 64
    assert all(c.usage is None for c in chunks[:-1])
    text = client.completions.create(model="tiny", prompt=SYSTEM, max_tokens=4, temperature=0, n=2)
    assert text.usage.prompt_tokens_details.cached_tokens in (0, text.usage.prompt_tokens // 64 * 64)
    m = fresh_metrics(server, lambda m: m["cde_worker_prefix_cache_hit_tokens"] >= 3 * cached)
    assert m["cde_worker_prefix_cache_hit_tokens"] >= 3 * cached
    assert m["cde_worker_prefix_cache_query_tokens"] > m["cde_worker_prefix_cache_hit_tokens"]
    assert m["cde_worker_prefix_cache_pages"] >= first.usage.prompt_tokens // 64


def test_no_prefix_cache_reports_nothing_cached(tiny_instruct_dir):
    srv = ServerProcess(tiny_instruct_dir, "--served-model-name", "tiny", "--no-prefix-cache", workers=1)
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        assert [chat(client, "hi").usage.prompt_tokens_details.cached_tokens for _ in range(2)] == [0, 0]
        m = fresh_metrics(srv, lambda m: m["cde_worker_kv_pages_total"] > 0)
        assert m["cde_worker_prefix_cache_query_tokens"] == 0
    finally:
        srv.stop()
