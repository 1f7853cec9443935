"""`cde bench soak` for real against `cde serve --workers 2` (tiny instruct model): a CI-sized
mixed load, then its checks; and the checker itself catches a response with foreign tokens."""

import json
import subprocess
import sys

import pytest

from cde.commands.load_client import Outcome
from cde.commands.soak_mix import Spec, verify
from tests.api_server import REPO, ServerProcess


@pytest.fixture(scope="module")
def server(tiny_instruct_dir):
    srv = ServerProcess(tiny_instruct_dir, "--served-model-name", "tiny")
    yield srv
    srv.stop()


def test_soak_passes_and_leaves_the_server_idle(server, tmp_path):
    out = tmp_path / "soak.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "cde",
            "bench",
            "soak",
            "--url",
            server.url,
            "--num-requests",
            "32",
            "--concurrency",
            "6",
            "--pool-size",
            "10",
            "--max-tokens",
            "100",
            "--hang-up",
            "0.3",
            "--deadline",
            "0.3",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    assert report["passed"] and report["requests"] == 32 and not report["problems"]
    assert report["outcomes"]["ok"] > 0 and report["outcomes"].get("broken", 0) == 0
    assert {"greedy", "seeded_n2", "steering", "attribution", "chat", "stop"} <= set(report["kinds"])
    assert report["idle_at_end"] == {g: 0 for g in report["idle_at_end"]}
    assert set(report["rss_mb"]) == {"gateway", "worker-0", "worker-1"}
    assert all(mb["start"] > 0 and mb["end"] > 0 for mb in report["rss_mb"].values())


def outcome(texts: dict[int, str], finish: dict[int, str], status: str = "ok") -> Outcome:
    out = Outcome(status=status)
    out.texts.update(texts)
    out.finish.update(finish)
    return out


def test_checker_catches_foreign_and_truncated_output():
    spec = Spec("seeded_n2", "/completions", {"n": 2, "stream": True})
    ref = outcome({0: "alpha beta", 1: "gamma delta"}, {0: "length", 1: "length"})
    assert verify(spec, ref, outcome({0: "alpha beta", 1: "gamma delta"}, {0: "length", 1: "length"}), None) is None
    swapped = outcome({0: "gamma delta", 1: "alpha beta"}, {0: "length", 1: "length"})
    assert "differs" in verify(spec, ref, swapped, None)
    assert verify(spec, ref, outcome({0: "alpha"}, {}, "hung_up"), None) is None
    assert "not a prefix" in verify(spec, ref, outcome({0: "gamma"}, {}, "hung_up"), None)
    assert "client timeout" in verify(spec, ref, outcome({}, {}, "client_timeout"), None)
    assert verify(spec, ref, outcome({}, {}, "client_timeout"), 0.2) is None
    broken = outcome({0: "alpha beta"}, {}).fail("broken", "no_done", "the stream ended without [DONE]")
    assert "no_done" in verify(spec, ref, broken, None)
