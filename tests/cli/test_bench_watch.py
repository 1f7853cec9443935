"""cde/commands/bench_watch.py on a real tiny engine (CPU): while passes run it reports the engine's
progress and no stacks; when no pass runs for a whole period it dumps every thread's stack, the
main thread's included, so a bench that never finishes says where it waits."""

import json
import re
import time

from cde.shared.protocol import GenerateRequest
from cde.worker.engine import Engine, EngineArgs

from cde.commands.bench_watch import Watch


def _reports(err: str) -> list[tuple[dict, bool]]:
    """Each report, and whether a stack dump follows it (before the next report)."""
    out: list[tuple[dict, bool]] = []
    for line in err.splitlines():
        if line.startswith('{"watch"'):
            out.append((json.loads(line), False))
        elif out and line.startswith(("Current thread", "Thread 0x")):
            out[-1] = (out[-1][0], True)
    return out


def test_a_running_engine_is_reported_and_a_stalled_one_dumps_its_stacks(tiny_dir, capfd):
    engine = Engine(EngineArgs(str(tiny_dir), max_running=4))
    for i in range(2):
        engine.add_request(GenerateRequest(f"r{i}", [5, 6, 7], max_tokens=128))
    with Watch(engine, every_s=0.1):
        while engine.has_work():
            engine.step()
    reports = _reports(capfd.readouterr().err)
    assert len(reports) >= 3
    passes = [r["forward_passes"] for r, _ in reports]
    assert passes == sorted(passes) and passes[-1] > passes[0]
    for (before, _), (now, dumped) in zip(reports, reports[1:]):
        assert dumped == (now["forward_passes"] == before["forward_passes"])  # stacks only when stalled
    both = [r for r, _ in reports if r["running"] == 2]
    assert both and {q["id"] for q in both[0]["least_advanced"]} == {"r0", "r1"}

    engine.add_request(GenerateRequest("stuck", [5, 6, 7], max_tokens=64))  # queued, never stepped
    with Watch(engine, every_s=0.05):
        time.sleep(0.3)
    stalled = capfd.readouterr().err
    reports = _reports(stalled)
    assert len({r["forward_passes"] for r, _ in reports}) == 1 and reports[-1][0]["waiting"] == 1
    assert [dumped for _, dumped in reports] == [False] + [True] * (len(reports) - 1)
    assert "test_a_running_engine_is_reported_and_a_stalled_one_dumps_its_stacks" in stalled  # the main thread


def test_a_call_that_holds_the_gil_still_gets_its_stacks_dumped(tiny_dir, capfd):
    """The report thread cannot run while a C call holds the GIL; faulthandler's watchdog can."""
    engine = Engine(EngineArgs(str(tiny_dir), max_running=4))
    with Watch(engine, every_s=0.05):
        time.sleep(0.12)  # the thread runs: it re-arms the watchdog and reports
        re.match(r"(a+)+$", "a" * 24 + "b")  # backtracks in C, holding the GIL, for ~0.5 s
    err = capfd.readouterr().err
    assert "Timeout (" in err  # the watchdog's dump, not the thread's
    assert "test_a_call_that_holds_the_gil_still_gets_its_stacks_dumped" in err

    with Watch(engine, every_s=0.05):
        time.sleep(0.4)  # nothing holds the GIL: the watchdog never fires
    assert "Timeout (" not in capfd.readouterr().err
