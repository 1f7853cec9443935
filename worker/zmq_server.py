"""The worker process: one engine behind a ZeroMQ ROUTER socket.

Engine thread (here): `receive (drain new requests/aborts without blocking) -> engine.step() ->
send BlockResults`, blocking only while idle. An I/O thread (worker/worker_io.py) owns the
sockets and answers Pings with a heartbeat frame the engine thread prepared
(worker/heartbeats.py), so liveness does not depend on how long one forward pass takes (a big
batch on a busy CPU, or a first CUDA-graph capture, can take seconds). The ROUTER side lets
several gateways share a worker: each request remembers which peer sent it.

Nothing of the serving path may stand between a pass's picks and the next launch (`engine.step`
launches the next pass before it returns): the engine thread encodes a step's results after
that, and hands them to the I/O thread in one message; the I/O thread's own Python work (a
forward, a heartbeat) is a few socket calls, with no encoding. Automatic garbage collection is
off while the worker serves: the objects alive after warm-up are frozen out of it, and the engine
thread collects between steps (after a launch, while the device computes) or while idle, so no
collection (a full one stops every thread holding the GIL) lands at that moment.

A peer on the worker port need not be our gateway: no frame may end either thread. Every frame
and message is handled under its own `except`, and a request is checked against the model's
bounds (and for a request id already in flight) before it queues.
"""

from __future__ import annotations

import collections
import gc
import logging
import queue
import signal
import time
import traceback

from cde.shared.catalog_file import CatalogFile
from cde.shared.limits import clip
from cde.shared.protocol import AbortRequest, BlockResult, ConceptInfo, ConceptQuery, GenerateRequest
from cde.shared.settings import GATEWAY_TIMEOUT_S
from cde.shared.wire import WireError, decode
from cde.worker.engine import Engine
from cde.worker.heartbeats import Heartbeats
from cde.worker.inbox_budget import DECODE_BYTES_PER_STEP
from cde.worker.process_memory import collect_garbage, release_free_memory
from cde.worker.worker_io import LOG_CHARS, Listener, WorkerIO

log = logging.getLogger("cde.worker")

# Each query is a [vocabulary, D] product on the engine thread (~1 ms on the 8B's GPU).
CONCEPT_QUERIES_PER_STEP = 2
IDLE_WAIT_S = 0.1  # how often an idle engine thread checks for shutdown


def _log_finished(request_id: str, finish_reason: str | None) -> None:
    """Every admitted request's last line, however it ends: a block that finished it, the abort of
    its sender (a hang-up, a rolled-back `n`), or a failed pass."""
    log.info("request finished", extra={"request_id": clip(request_id, 100), "finish_reason": finish_reason})


class WorkerServer:
    def __init__(
        self,
        engine: Engine,
        bind: str | Listener,
        model_name: str | None = None,
        catalog: CatalogFile | None = None,
        gateway_timeout: float = GATEWAY_TIMEOUT_S,
    ):
        """`bind`: an endpoint to bind now (no CURVE), or a Listener bound before the engine loaded;
        `gateway_timeout`: how long a peer with requests here may be silent before they are dropped."""
        self.engine = engine
        self.io = WorkerIO(bind if isinstance(bind, Listener) else Listener(bind), catalog)
        self.heartbeats = Heartbeats(engine, self.io, model_name)
        # Concept queries past a step's share, answered in order at the next steps.
        self.deferred: collections.deque[tuple[bytes, object]] = collections.deque()
        self.owner: dict[str, bytes] = {}  # request id -> identity of the gateway that sent it
        self.gateway_timeout = gateway_timeout
        self._silence_checked_at = 0.0
        self.stopping = False

    def request_stop(self, *_: object) -> None:
        self.stopping = True

    # ---- engine thread ------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self.io.thread.start()
        collecting = gc.isenabled()
        gc.collect()
        gc.freeze()  # the model, the engine and the modules: never scanned again
        gc.disable()
        busy = False
        try:
            while not self.stopping:
                if not self.io.thread.is_alive():  # deaf and mute, yet holding the device: exit, so it is seen
                    self.io.close_sockets(linger=0)  # all ours now; open, they hang the exit
                    raise RuntimeError("the worker's I/O thread failed (its error is logged above)")
                self._receive(block=not self.engine.has_work())
                if self.engine.has_work():
                    self._step()
                    busy = True
                elif busy:  # the last request finished and no other came within IDLE_WAIT_S
                    busy = False
                    release_free_memory()
                    self.heartbeats.refresh(force=True)
                collect_garbage()
                self.heartbeats.refresh()
                self._drop_silent_peers()
            self._fail_all("worker is shutting down")
        finally:
            gc.unfreeze()
            if collecting:
                gc.enable()
        self.io.stop()

    def _receive(self, block: bool) -> None:
        """Handle what arrived; while there are requests to run, decode at most
        DECODE_BYTES_PER_STEP of large frames and answer at most CONCEPT_QUERIES_PER_STEP concept
        queries before the next step. Further queries wait their turn in `deferred`, behind no
        other message: a client looping on /v1/concepts/{id} must stop neither the decoding nor
        the requests and aborts that come after its queries."""
        decoded = answered = 0
        while self.deferred and (answered < CONCEPT_QUERIES_PER_STEP or not self.engine.has_work()):
            self._handle(*self.deferred.popleft())
            answered += 1
        try:
            item = self.io.inbox.get(timeout=IDLE_WAIT_S) if block and not self.deferred else self.io.inbox.get_nowait()
            while True:
                busy = self.engine.has_work()
                if busy and isinstance(item[1], ConceptQuery) and answered >= CONCEPT_QUERIES_PER_STEP:
                    self.deferred.append(item)  # small: decoded by the I/O thread
                else:
                    answered += isinstance(item[1], ConceptQuery)
                    decoded += self._handle(*item)
                    if busy and decoded >= DECODE_BYTES_PER_STEP:
                        return
                item = self.io.inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, peer: bytes, msg: object) -> int:
        """Decode (a large frame) and dispatch one message: the bytes decoded."""
        size = len(msg) if isinstance(msg, bytes) else 0
        try:
            if isinstance(msg, bytes):
                msg = decode(msg)
            self._dispatch(peer, msg)
        except WireError as exc:
            log.warning("dropped bad frame: %s", exc)
        except Exception as exc:  # a bug on one message must not stop the engine thread
            log.error("message failed: %s", clip(repr(exc), LOG_CHARS))
        finally:
            if size:
                self.io.inbox_budget.give_back(peer, size)
        self.heartbeats.refresh(force=True)  # admitted or aborted: the load changed
        return size

    def _dispatch(self, peer: bytes, msg: object) -> None:
        if isinstance(msg, GenerateRequest):
            self._admit(peer, msg)
        elif isinstance(msg, AbortRequest):
            if self.owner.get(msg.request_id) == peer:  # only its sender stops a request
                self.engine.abort(msg.request_id)
                del self.owner[msg.request_id]
                _log_finished(msg.request_id, "abort")
        elif isinstance(msg, ConceptQuery):
            self.io.send(peer, self._concept_info(msg))

    def _admit(self, peer: bytes, req: GenerateRequest) -> None:
        rid = clip(req.request_id, 100)
        try:
            # Checks every field first (shared/request_bounds.py), and refuses an id in flight.
            self.engine.add_request(req)
        except Exception as exc:
            if isinstance(exc, ValueError):
                error = clip(str(exc), LOG_CHARS)
                log.warning("request refused", extra={"request_id": rid, "error": error})
            else:  # a bug in admitting it: the request still gets its answer, never a silent hang
                error = "the worker failed to admit this request"
                log.error("admission failed", extra={"request_id": rid, "error": clip(repr(exc), LOG_CHARS)})
            # Its error goes only to its sender; a duplicate's never reaches the original's owner.
            self.io.send(peer, BlockResult(req.request_id, [], True, "error", error=error))
            return
        log.info(
            "request admitted",
            extra={"request_id": rid, "prompt_tokens": len(req.prompt_ids), "max_tokens": req.max_tokens},
        )
        self.owner[req.request_id] = peer

    def _drop_silent_peers(self) -> None:
        """Abort the requests of peers silent past `gateway_timeout` (a gateway Pings twice a
        second: one that crashed or restarted leaves no client to read them), and forget every
        silent peer. Silence counts up to the I/O thread's last wait, not to now: frames queued
        while this process was paused (SIGSTOP) are not silence. Each request still gets its end,
        for a gateway that was only paused. Checked once a second."""
        now = time.monotonic()
        if now - self._silence_checked_at < 1.0:
            return
        self._silence_checked_at = now
        heard_by = self.io.listening_since - self.gateway_timeout
        silent = {peer for peer, at in list(self.io.heard.items()) if at < heard_by}
        for peer in silent:
            self.io.heard.pop(peer, None)
        error = f"dropped: no frame from its gateway for {self.gateway_timeout:g}s"
        for rid, peer in list(self.owner.items()):
            if peer in silent:
                self.engine.abort(rid)
                del self.owner[rid]
                self.io.send(peer, BlockResult(rid, [], True, "error", error=error))
                log.warning("request dropped: its gateway went silent", extra={"request_id": clip(rid, 100)})
                _log_finished(rid, "abort")
        if silent:
            self.heartbeats.refresh(force=True)

    def _concept_info(self, query: ConceptQuery) -> ConceptInfo:
        # On the engine thread: it owns the model and the device.
        try:
            token_ids, scores = self.engine.concept_top_tokens(query.concept_id, query.k)
        except ValueError as exc:
            return ConceptInfo(query.query_id, error=str(exc))
        return ConceptInfo(query.query_id, token_ids, scores)

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception:  # a bug or device error: fail these requests, keep the worker serving
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_all("engine error during generation")
            return
        # The next pass is running: the results are encoded now and go to the I/O thread in one
        # message (one wake-up of it per step, however many requests finished a block).
        peers: list[bytes] = []
        msgs: list[object] = []
        finished = False
        for res in results:
            peer = self.owner.get(res.request_id)
            if isinstance(res, BlockResult) and res.finished:
                finished = True
                self.owner.pop(res.request_id, None)
                _log_finished(res.request_id, res.finish_reason)
            if peer is not None:
                peers.append(peer)
                msgs.append(res)
        if finished:  # the load changed: a Ping answered after the last result must show it
            self.heartbeats.refresh(force=True)
        if msgs:
            self.io.send_all(peers, msgs)

    def _fail_all(self, message: str) -> None:
        for rid, peer in list(self.owner.items()):
            self.engine.abort(rid)
            self.io.send(peer, BlockResult(rid, [], True, "error", error=message))
            _log_finished(rid, "error")
        self.owner.clear()
        self.heartbeats.refresh(force=True)


def run_worker(
    engine: Engine,
    listener: Listener,
    model_name: str | None = None,
    catalog: CatalogFile | None = None,
    gateway_timeout: float = GATEWAY_TIMEOUT_S,
) -> None:
    server = WorkerServer(engine, listener, model_name, catalog, gateway_timeout)
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    curve = ", CURVE" if listener.auth else ""
    print(f"CDE worker ready on {listener.endpoint} ({server.heartbeats.model_name}{curve})", flush=True)
    server.serve_forever()
