"""gateway/grammar_checker.py: grammar checks in child processes, killed past their time bound."""

import asyncio
import multiprocessing
import time

import pytest
from cde.gateway.grammar_checker import CHECK_TIMEOUT_S, CheckersBusy, GrammarChecker
from cde.shared.grammar import lark_grammar

# Compiles for ~20 s on one core: a forced literal of 300,000 bytes (quadratic in llguidance).
SLOW = lark_grammar("start: /a{300000}/")
VOCAB = 100352


def test_an_overrun_is_refused_in_time_and_its_compile_killed():
    checker = GrammarChecker(1)

    async def run() -> tuple[str, float, str, str]:
        assert await checker.error(lark_grammar('start: "x"'), True, VOCAB) == ""  # the child is up
        t0 = time.monotonic()
        slow = await checker.error(SLOW, True, VOCAB)
        took = time.monotonic() - t0
        # the next check gets a fresh child; the overrun one no longer runs
        return (
            slow,
            took,
            await checker.error(lark_grammar('start: "y"'), True, VOCAB),
            await checker.error(lark_grammar("start: undefined_rule"), True, VOCAB),
        )

    try:
        slow, took, fine, bad = asyncio.run(run())
        assert slow == f"the grammar did not compile within {CHECK_TIMEOUT_S:g} s"
        assert took < CHECK_TIMEOUT_S + 1.5, took
        assert fine == "" and "undefined_rule" in bad
        assert len(multiprocessing.active_children()) == 1  # the overrun child was killed and reaped
    finally:
        checker.close()
    assert multiprocessing.active_children() == []


def test_checks_beyond_the_checkers_wait_their_turn():
    """Two slow grammars on one checker: the second waits for the first's bound, then has its own;
    an honest grammar queued behind them is still answered."""
    checker = GrammarChecker(1)

    async def run() -> list[str]:
        return await asyncio.gather(
            checker.error(SLOW, False, VOCAB),
            checker.error(SLOW, False, VOCAB),
            checker.error(lark_grammar('start: "z"'), False, VOCAB),
        )

    try:
        assert [bool(e) for e in asyncio.run(run())] == [True, True, False]
    finally:
        checker.close()


def test_a_child_ends_quietly_when_its_gateway_goes():
    """The pipe closed (the gateway exited, or was killed): the child returns, no traceback."""
    import subprocess
    import sys

    code = (
        "import asyncio, os, sys\n"
        "from cde.gateway.grammar_checker import GrammarChecker\n"
        "from cde.shared.grammar import lark_grammar\n"
        "c = GrammarChecker(1)\n"
        "assert asyncio.run(c.error(lark_grammar('start: \"x\"'), True, 100352)) == ''\n"
        "print(c._children.get().proc.pid, flush=True)\n"
        "os._exit(0)\n"  # as a killed gateway: no cleanup
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the checker outlived its gateway"
        time.sleep(0.1)
    assert "Traceback" not in out.stderr, out.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_checker_that_fails_to_start_gives_its_slot_back(monkeypatch):
    """A start that raises (no file descriptors left) fails that check alone: the slot goes back,
    and the next check starts a checker again instead of waiting for ever."""
    from cde.gateway import grammar_checker

    real, calls = grammar_checker._Child, []

    def flaky() -> grammar_checker._Child:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(24, "Too many open files")
        return real()

    monkeypatch.setattr(grammar_checker, "_Child", flaky)
    checker = GrammarChecker(1)

    async def run() -> str:
        with pytest.raises(OSError):  # that check fails alone
            await checker.error(lark_grammar('start: "x"'), True, VOCAB)
        return await asyncio.wait_for(checker.error(lark_grammar('start: "x"'), True, VOCAB), 60)

    try:
        assert asyncio.run(run()) == "" and len(calls) == 2
    finally:
        checker.close()


def test_turns_go_client_by_client_within_bounds_and_a_cancelled_check_never_runs():
    """One checker, checks standing in for grammars: a client's checks beyond its share, and any
    beyond the line's bound, are refused at once; b's check waits for a's running one, not for
    a's whole line; c's, cancelled while it waits (its client hung up), is never run."""
    checker = GrammarChecker(1, max_pending=5, max_pending_per_client=3)
    ran: list[str] = []

    def check(grammar: str, instruct: bool, vocab_size: int) -> str:
        ran.append(grammar)
        time.sleep(0.05)
        return ""

    checker._check = check  # type: ignore[method-assign]

    async def run() -> list[object]:
        names = ["a1", "a2", "a3", "a4", "b1", "c1", "d1"]
        tasks = {n: asyncio.create_task(checker.error(n, True, VOCAB, n[0])) for n in names}
        await asyncio.sleep(0)  # each has asked for its turn, in order
        tasks["c1"].cancel()
        return await asyncio.gather(*tasks.values(), return_exceptions=True)

    try:
        a1, a2, a3, a4, b1, c1, d1 = asyncio.run(run())
    finally:
        checker.close()
    assert [a1, a2, a3, b1] == ["", "", "", ""] and isinstance(c1, asyncio.CancelledError)
    assert isinstance(a4, CheckersBusy) and a4.code == "client_overloaded"
    assert isinstance(d1, CheckersBusy) and d1.code == "overloaded"
    assert ran == ["a1", "a2", "b1", "a3"]
