"""Grammar checks in child processes, each killed once it overruns its time bound.

llguidance compiles a long forced literal in time quadratic in its length, outside its fuel limits
(a regex `a{300000}`: 21 s). On a thread such a compile would run on after its request got its
400, holding a core and an executor thread; a child process that overruns is killed and replaced,
so one request costs at most CHECK_TIMEOUT_S of one checker. CHECKERS children, started when the
first grammar comes; checks beyond them wait their turn on the checkers' own threads, never on the
event loop's default executor (concept search, tokenizing).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import signal
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from cde.shared.grammar import grammar_error, ll_tokenizer

CHECKERS = 2
# A schema's compile and first mask take ~1-20 ms; a grammar still compiling after this is
# refused, which also bounds what the worker's own compile of it costs the engine thread.
CHECK_TIMEOUT_S = 2.0
START_TIMEOUT_S = 60.0  # a child's start and its tokenizer's tables (~0.7 s), not the grammar's time
STARTED = ""  # the child's word that its tokenizer is ready and the compile begins


def _serve(conn: Connection) -> None:
    """The child: answer (grammar, instruct, vocab_size) jobs with grammar_error's text, until its
    gateway closes the pipe (or dies: the child never outlives it). Ctrl-C reaches the whole
    process group: the gateway, which drains and then ends its children, answers it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            grammar, instruct, vocab_size = conn.recv()
        except (EOFError, OSError):
            return
        tokenizer = ll_tokenizer(instruct, vocab_size)  # cached per process
        conn.send(STARTED)
        conn.send(grammar_error(grammar, tokenizer))


class _Child:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(theirs,), daemon=True, name="cde-grammar-check")
        self.proc.start()
        theirs.close()
        self.alive = True

    def ask(self, grammar: str, instruct: bool, vocab_size: int) -> str:
        """grammar_error's answer; when the child overruns or dies, it is killed (alive False) and
        the answer says so."""
        try:
            self.conn.send((grammar, instruct, vocab_size))
            if not (self.conn.poll(START_TIMEOUT_S) and self.conn.recv() == STARTED):
                answer = "the grammar checker did not start"
            elif self.conn.poll(CHECK_TIMEOUT_S):
                return self.conn.recv()
            else:
                answer = f"the grammar did not compile within {CHECK_TIMEOUT_S:g} s"
        except (EOFError, OSError):
            answer = "the grammar checker failed on this grammar (out of memory?)"
        self.kill()
        return answer

    def kill(self) -> None:
        self.alive = False
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class GrammarChecker:
    def __init__(self, checkers: int = CHECKERS) -> None:
        self._pool = ThreadPoolExecutor(checkers, thread_name_prefix="cde-grammar")
        self._children: queue.SimpleQueue[_Child | None] = queue.SimpleQueue()
        for _ in range(checkers):  # one per pool thread, started on first use
            self._children.put(None)

    async def error(self, grammar: str, instruct: bool, vocab_size: int) -> str:
        """Why the grammar cannot be used ("" when it can), within CHECK_TIMEOUT_S of a checker."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._check, grammar, instruct, vocab_size)

    def _check(self, grammar: str, instruct: bool, vocab_size: int) -> str:
        child = self._children.get()
        try:
            child = child or _Child()
            return child.ask(grammar, instruct, vocab_size)
        finally:  # the slot goes back whatever happened (a start that failed: None, started again)
            self._children.put(child if child is not None and child.alive else None)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        while not self._children.empty():
            child = self._children.get()
            if child is not None:
                child.kill()
