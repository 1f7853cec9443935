"""The worker's sockets and the I/O thread that owns them (worker/zmq_server.py runs the engine
thread beside it).

ZeroMQ sockets are single-threaded, so one thread does all the socket work: it reads every frame
from the ROUTER socket, answers Pings (with a heartbeat frame the engine thread prepared) and
catalog queries at once, queues the rest for the engine thread, and forwards what the engine
thread pushes into its outbox. Its own Python work per frame is a few socket calls and no
encoding, so liveness does not depend on how long one forward pass takes.

A peer on the worker port need not be our gateway: no frame may end this thread. It decodes
only small frames (a Ping is ~30 bytes) and hands large ones undecoded to the engine thread,
within their inbox budget, so that no request, however heavy, delays a heartbeat.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
import uuid

import zmq
from cde.shared.catalog_file import CatalogFile
from cde.shared.curve import CurveServer
from cde.shared.limits import clip
from cde.shared.protocol import CatalogPart, CatalogQuery, Ping
from cde.shared.wire import MAX_FRAME_BYTES, WireError, decode, encode, encode_all
from cde.worker.inbox_budget import InboxBudget

log = logging.getLogger("cde.worker")

SMALL_FRAME_BYTES = 4096  # decoded on the I/O thread; larger frames are decoded by the engine thread
LOG_CHARS = 300  # of an error text quoting a peer's frame


class Listener:
    """The worker's ROUTER socket, bound (`cde worker` tries its endpoint with one before the model
    loads: `cde.commands.worker.listen`)."""

    def __init__(self, bind: str, curve: CurveServer | None = None):
        self.endpoint = bind
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a larger frame disconnects its sender
        self.auth = curve.secure(self.ctx, self.sock) if curve is not None else None
        try:
            self.sock.bind(bind)
        except zmq.ZMQError:
            self.close()
            raise

    def close(self) -> None:
        self.sock.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class WorkerIO:
    """What the two threads share: the inbox ([peer, message], or [peer, frame] still to decode),
    the peers heard from, the next Ping's reply, and the outbox the engine thread sends through."""

    def __init__(self, listener: Listener, catalog: CatalogFile | None):
        self.listener, self.sock, self.catalog = listener, listener.sock, catalog
        outbox = f"inproc://outbox-{uuid.uuid4().hex}"
        self._out_pull = listener.ctx.socket(zmq.PULL)
        self._out_pull.bind(outbox)
        self._out_push = listener.ctx.socket(zmq.PUSH)  # the engine thread's end
        self._out_push.connect(outbox)
        self.inbox: queue.SimpleQueue[tuple[bytes, object]] = queue.SimpleQueue()
        self.inbox_budget = InboxBudget()
        # Peer -> when its last frame came (this thread writes, the engine thread reads and prunes).
        self.heard: dict[bytes, float] = {}
        # When this thread last began to wait: every frame that came before was read by then.
        self.listening_since = time.monotonic()
        self.heartbeat_frame = b""  # the reply to a Ping, encoded by the engine thread
        self._done = False
        self.thread = threading.Thread(target=self._io_loop, name="cde-worker-io", daemon=True)

    # ---- the engine thread's side ---------------------------------------------------------------
    def send(self, peer: bytes, msg: object) -> None:
        self._out_push.send_multipart([peer, encode(msg)])

    def send_all(self, peers: list[bytes], msgs: list[object]) -> None:
        """One message to this thread (one wake-up of it), however many results."""
        frames = encode_all(msgs)
        self._out_push.send_multipart([part for pair in zip(peers, frames) for part in pair])

    def close_sockets(self, linger: int | None = None) -> None:
        """Also the engine thread's, once this thread has failed: the sockets are all its then."""
        for s in (self.sock, self._out_pull, self._out_push):
            s.close(linger=linger)

    def stop(self) -> None:
        """Forward what was sent, close the sockets, and end the context."""
        self._done = True
        self.thread.join()  # it closes the sockets
        self.listener.close()  # closing its socket again is a no-op

    # ---- the I/O thread ---------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._out_pull, zmq.POLLIN)
        try:
            while not self._done:
                self.listening_since = time.monotonic()
                events = dict(poller.poll(100))
                if self.sock in events:
                    self._read_requests()
                if self._out_pull in events:
                    self._forward_results()
            self._forward_results()  # the shutdown errors
        except Exception:
            # The engine thread sees this thread gone, closes the sockets and ends the process
            # (WorkerServer.serve_forever): it may be sending on _out_push now, and ZeroMQ sockets
            # are not thread-safe; the outbox's room (1000 messages) outlasts its step.
            log.critical("the I/O thread failed:\n%s", traceback.format_exc())
            return
        self.close_sockets()  # the engine thread waits in stop()

    def _read_requests(self) -> None:
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.heard[parts[0]] = time.monotonic()
            try:
                self._route(*parts)
            except WireError as exc:
                log.warning("dropped bad frame: %s", exc)
            except Exception as exc:  # not a [peer, frame] message, or a bug: the next frame still comes
                log.error("frame failed: %s", clip(repr(exc), LOG_CHARS))

    def _route(self, peer: bytes, frame: bytes) -> None:
        if len(frame) > SMALL_FRAME_BYTES:
            if self.inbox_budget.take(peer, len(frame)):
                self.inbox.put((peer, frame))
            elif self.inbox_budget.refused in (1, 10, 100, 1000) or self.inbox_budget.refused % 10_000 == 0:
                log.warning("refused frames past the inbox budget: %d so far", self.inbox_budget.refused)
            return
        msg = decode(frame)
        if isinstance(msg, Ping):
            self.sock.send_multipart([peer, self.heartbeat_frame])
        elif isinstance(msg, CatalogQuery):  # static bytes: answered here, never waits for a step
            part = self.catalog.part(msg.offset) if self.catalog else CatalogPart("", msg.offset, 0, "")
            self.sock.send_multipart([peer, encode(part)])
        else:
            self.inbox.put((peer, msg))

    def _forward_results(self) -> None:
        while True:
            try:
                parts = self._out_pull.recv_multipart(zmq.NOBLOCK)  # [peer, frame] pairs
            except zmq.Again:
                return
            for i in range(0, len(parts), 2):
                # ROUTER drops messages to peers that went away instead of blocking: what we want.
                self.sock.send_multipart(parts[i : i + 2])
