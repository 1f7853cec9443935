"""`cde bench serve` for real against `cde serve --workers 2` (tiny base model, which has no end
token, so every request generates exactly max_tokens)."""

import json
import subprocess
import sys

import pytest

from tests.api_server import REPO, ServerProcess

N, MAX_TOKENS = 8, 24


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerProcess(tiny_dir, "--served-model-name", "tiny")
    yield srv
    srv.stop()


def bench(server, tmp_path, *args):
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "cde",
            "bench",
            "serve",
            "--url",
            server.url,
            "--num-prompts",
            str(N),
            "--request-rate",
            "50",
            "--max-concurrency",
            "4",
            "--prompt-len",
            "16",
            "--extra-body",
            '{"tokens_per_step": 8}',
            "--json",
            str(out),
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return res, json.loads(out.read_text())


def test_reports_every_request_and_its_tokens(server, tmp_path):
    res, s = bench(server, tmp_path, "--max-tokens", str(MAX_TOKENS))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Serving Benchmark Result" in res.stdout and "Mean TTFT (ms)" in res.stdout
    assert s["model"] == "tiny" and s["successful_requests"] == N and s["failed_requests"] == 0
    assert s["total_output_tokens"] == N * MAX_TOKENS and s["total_input_tokens"] >= N * 16
    assert s["failures"] == {}
    for key in ("ttft_ms", "tpot_ms", "e2e_latency_ms"):
        assert 0 < s[key]["median"] <= s[key]["p99"], key
    assert s["ttft_ms"]["mean"] <= s["e2e_latency_ms"]["mean"]


def test_failures_are_counted_by_kind(server, tmp_path):
    res, s = bench(server, tmp_path, "--max-tokens", "5000")  # beyond the 1024-token context: 400
    assert res.returncode == 1
    assert s["successful_requests"] == 0 and s["failures"] == {"http_400": N}
    assert "http_400:" in res.stdout


def test_block_figures_beside_the_token_figures(server, tmp_path):
    """The block figures come from each chunk's token ids: with one chunk per block (block
    granularity) the first block is the first chunk with text; streaming tokens, it is not earlier."""
    blocks = '{"tokens_per_step": 8, "stream_granularity": "block"}'
    res, s = bench(server, tmp_path, "--max-tokens", "100", "--extra-body", blocks)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Median TTFB (ms)" in res.stdout and "Median IBL (ms)" in res.stdout
    # Equal, but for a block whose last token ends inside a UTF-8 character: the gateway holds that
    # token back to the next chunk, so the bench sees the block complete one chunk later.
    assert s["ttfb_ms"]["median"] >= s["ttft_ms"]["median"] and s["inter_block_ms"]["median"] > 0
    # 16-word prompts: blocks end at 64 - prompt_tokens % 64 tokens and 64 after; 100 tokens make 2 or 3.
    res, s = bench(server, tmp_path, "--max-tokens", "100")
    assert res.returncode == 0, res.stdout + res.stderr
    assert 0 < s["ttft_ms"]["median"] <= s["ttfb_ms"]["median"] <= s["e2e_latency_ms"]["median"]
    assert s["inter_block_ms"]["median"] > 0
