"""gateway/grammar_checker.py: grammar checks in child processes, killed past their time bound."""

import asyncio
import multiprocessing
import time

from cde.gateway.grammar_checker import CHECK_TIMEOUT_S, GrammarChecker
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
