"""Grammar checks in child processes, each killed once it overruns its time bound.

llguidance compiles a long forced literal in time quadratic in its length, outside its fuel limits
(a regex `a{300000}`: 21 s). On a thread such a compile would run on after its request got its
400, holding a core and an executor thread; a child process that overruns is killed and replaced,
so one request costs at most CHECK_TIMEOUT_S of one checker. CHECKERS children, started when the
first grammar comes, on threads of their own, never on the event loop's default executor (concept
search, tokenizing).

Checks beyond the checkers wait their turn on the event loop, one line per client taken in turn, so
one client's slow grammars delay another's check by the checks running, not by its whole line.
The lines are bounded (MAX_PENDING in all, MAX_PENDING_PER_CLIENT from one client; more are
refused at once: CheckersBusy), and a check whose requester stopped waiting (its task cancelled:
the client hung up) leaves its line without ever being run.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import signal
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from cde.shared.grammar import grammar_error, ll_tokenizer

CHECKERS = 2
# A schema's compile and first mask take ~1-20 ms; a grammar still compiling after this is
# refused, which also bounds what the worker's own compile of it costs the engine thread.
CHECK_TIMEOUT_S = 2.0
START_TIMEOUT_S = 60.0  # a child's start and its tokenizer's tables (~0.7 s), not the grammar's time
STARTED = ""  # the child's word that its tokenizer is ready and the compile begins
# Checks waiting or running. One client may hold half of them: a batch of 32 requests with
# schemas, sent at once, is taken whole even while the checkers start (~1.4 s, when every check
# waits). The turns between clients, not these bounds, keep one client's slow grammars from
# delaying another's check; the bounds cap what the line holds, and so the longest wait in it.
MAX_PENDING = 32 * CHECKERS
MAX_PENDING_PER_CLIENT = MAX_PENDING // 2


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


class CheckersBusy(Exception):
    """A check refused at once, without waiting: too many pending, in all or from its client.
    `code`: the OpenAI error code (the router's, for its own queue bounds)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class GrammarChecker:
    def __init__(
        self,
        checkers: int = CHECKERS,
        max_pending: int = MAX_PENDING,
        max_pending_per_client: int = MAX_PENDING_PER_CLIENT,
    ) -> None:
        self._pool = ThreadPoolExecutor(checkers, thread_name_prefix="cde-grammar")
        self._children: queue.SimpleQueue[_Child | None] = queue.SimpleQueue()
        for _ in range(checkers):  # one per pool thread, started on first use
            self._children.put(None)
        self._max_pending, self._max_per_client = max_pending, max_pending_per_client
        self._idle = checkers  # checkers without a check (touched on the event loop only)
        self._pending: Counter[str] = Counter()  # checks waiting or running, by client
        # A line of turns per client, in the order the clients are served (dicts keep insertion order).
        self._lines: dict[str, deque[asyncio.Future[None]]] = {}

    async def error(self, grammar: str, instruct: bool, vocab_size: int, client: str = "") -> str:
        """Why the grammar cannot be used ("" when it can), within CHECK_TIMEOUT_S of a checker once
        its turn comes. `client`: whose share of the line the check takes (gateway/client_identity.py).
        Raises CheckersBusy when the line is full."""
        self._admit(client)
        self._pending[client] += 1
        try:
            await self._turn(client)
        except asyncio.CancelledError:
            self._done(client)
            raise
        return await self._run(grammar, instruct, vocab_size, client)

    def _admit(self, client: str) -> None:
        if self._pending[client] >= self._max_per_client:
            raise CheckersBusy(
                f"too many grammars from this client waiting for a check (at most {self._max_per_client}): "
                "wait for some to be answered",
                "client_overloaded",
            )
        if self._pending.total() >= self._max_pending:
            raise CheckersBusy(
                f"server overloaded: {self._max_pending} grammars are waiting for a check, retry later",
                "overloaded",
            )

    async def _turn(self, client: str) -> None:
        """Until a checker is this check's; a cancelled wait gives up its place, or the turn it got."""
        if self._idle:  # then no line waits
            self._idle -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._lines.setdefault(client, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.cancelled():
                self._leave(client, turn)
            else:  # given the turn as its requester left: the next one takes it
                self._pass_turn()
            raise

    def _leave(self, client: str, turn: asyncio.Future[None]) -> None:
        line = self._lines.get(client)
        if line is not None and turn in line:
            line.remove(turn)
            if not line:
                del self._lines[client]

    def _pass_turn(self) -> None:
        """A checker is free: the oldest turn of the next client in line gets it; that client goes to
        the back. Turns cancelled since (their task not run yet to leave) are passed over."""
        while self._lines:
            client, line = next(iter(self._lines.items()))
            turn = line.popleft()
            del self._lines[client]
            if line:
                self._lines[client] = line
            if not turn.done():
                turn.set_result(None)
                return
        self._idle += 1

    def _finished(self, client: str) -> None:
        self._done(client)
        self._pass_turn()

    def _done(self, client: str) -> None:
        self._pending[client] -= 1
        if not self._pending[client]:
            del self._pending[client]

    async def _run(self, grammar: str, instruct: bool, vocab_size: int, client: str) -> str:
        job = self._pool.submit(self._check, grammar, instruct, vocab_size)
        loop = asyncio.get_running_loop()
        # The checker is free when its check ends, not when its requester stops waiting for it.
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, client))
        return await asyncio.wrap_future(job)

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
