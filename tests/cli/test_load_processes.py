"""`cde bench serve --client-processes`: the requests split over client processes
(cde/commands/load_processes.py) against a real `cde serve` on the tiny CPU model, whose base model
has no end token, so every request generates exactly max_tokens."""

import json
import math
import random
import subprocess
import sys

import pytest

from cde.commands.load_processes import split
from tests.api_server import REPO, ServerProcess

N, PROMPT_LEN, MAX_TOKENS = 5, 16, 8


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerProcess(tiny_dir, workers=1)
    yield srv
    srv.stop()


def bench(server, tmp_path, *args):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "cde", "bench", "serve", "--url", server.url, "--num-prompts", str(N)]
    cmd += ["--prompt-ids", "--prompt-len", str(PROMPT_LEN), "--max-tokens", str(MAX_TOKENS)]
    cmd += ["--extra-body", '{"tokens_per_step": 8}', "--json", str(out), *args]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    return res, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.parametrize("rate", ["inf", "40"])
def test_two_client_processes_send_every_request_once(server, tmp_path, rate):
    before = server.metrics()
    res, s = bench(server, tmp_path, "--client-processes", "2", "--max-concurrency", "4", "--request-rate", rate)
    after = server.metrics()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Serving Benchmark Result" in res.stdout and "Successful requests:" in res.stdout
    assert s["client_processes"] == 2 and s["num_prompts"] == N and s["max_concurrency"] == 4
    assert s["successful_requests"] == N and s["failed_requests"] == 0 and s["failures"] == {}
    assert s["total_output_tokens"] == N * MAX_TOKENS and s["total_input_tokens"] == N * PROMPT_LEN
    # The server saw each request once: none lost, none sent twice.
    for name, per_request in (
        ("cde_requests_finished_total", 1),
        ("cde_prompt_tokens_total", PROMPT_LEN),
        ("cde_generation_tokens_total", MAX_TOKENS),
    ):
        assert after.get(name, 0) - before.get(name, 0) == N * per_request, name
    # From the common release to the last completion: at least the slowest request.
    assert s["e2e_latency_ms"]["p99"] <= s["duration_s"] * 1000
    assert 0 < s["ttft_ms"]["median"] <= s["e2e_latency_ms"]["median"]


def test_one_process_reports_client_processes(server, tmp_path):
    res, s = bench(server, tmp_path, "--max-concurrency", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert s["client_processes"] == 1 and s["successful_requests"] == N
    assert s["total_output_tokens"] == N * MAX_TOKENS


def test_more_processes_than_concurrency_is_refused(server, tmp_path):
    res, s = bench(server, tmp_path, "--client-processes", "3", "--max-concurrency", "2")
    assert res.returncode != 0 and s is None
    assert "--client-processes 3 is more than --max-concurrency 2" in res.stderr


def test_split_deals_requests_round_robin():
    bodies = [{"i": i} for i in range(7)]
    shares = split(bodies, 6.0, 5, random.Random(0), 3)
    assert [[b["i"] for b in s.bodies] for s in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [s.max_concurrency for s in shares] == [2, 2, 1] and [s.rate for s in shares] == [2.0] * 3
    assert len({s.rng.random() for s in shares}) == 3  # each process its own arrivals
    one = split(bodies, math.inf, None, random.Random(0), 1)
    assert len(one) == 1 and one[0].bodies is bodies and one[0].max_concurrency is None
