"""The worker process: one engine behind a ZeroMQ ROUTER socket.

Engine thread: `receive (drain new requests/aborts without blocking) -> engine.step() -> send
BlockResults`, blocking only while idle. An I/O thread owns the sockets and answers Pings with a
heartbeat frame the engine thread prepared, so liveness does not depend on how long one forward
pass takes (a big batch on a busy CPU, or a first CUDA-graph capture, can take seconds). The
ROUTER side lets several gateways share a worker: each request remembers which peer sent it.

Nothing of the serving path may stand between a pass's picks and the next launch (`engine.step`
launches the next pass before it returns): the engine thread encodes a step's results after
that, and hands them to the I/O thread in one message; the I/O thread's own Python work (a
forward, a heartbeat) is a few socket calls, with no encoding. Automatic garbage collection is
off while the worker serves: the objects alive after warm-up are frozen out of it, and the engine
thread collects between steps (after a launch, while the device computes) or while idle, so no
collection (a full one stops every thread holding the GIL) lands at that moment.

A peer on the worker port need not be our gateway: no frame may end either thread. The I/O thread
decodes only small frames (a Ping is ~30 bytes) and hands large ones undecoded to the engine
thread, so that no request, however heavy, delays a heartbeat; every frame and message is
handled under its own `except`, and a request is checked against the model's bounds (and for a
request id already in flight) before it queues.
"""

from __future__ import annotations

import collections
import gc
import logging
import queue
import signal
import threading
import time
import traceback
import uuid
from pathlib import Path

import zmq
from cde.shared.catalog_file import CatalogFile
from cde.shared.curve import CurveServer
from cde.shared.limits import clip
from cde.shared.protocol import (
    AbortRequest,
    BlockResult,
    CatalogPart,
    CatalogQuery,
    ConceptInfo,
    ConceptQuery,
    GenerateRequest,
    Heartbeat,
    Ping,
)
from cde.shared.settings import GATEWAY_TIMEOUT_S
from cde.shared.wire import MAX_FRAME_BYTES, WireError, decode, encode, encode_all
from cde.worker.engine import Engine
from cde.worker.inbox_budget import DECODE_BYTES_PER_STEP, InboxBudget
from cde.worker.process_memory import collect_garbage, release_free_memory, resident_bytes

log = logging.getLogger("cde.worker")

# Each query is a [vocabulary, D] product on the engine thread (~1 ms on the 8B's GPU).
CONCEPT_QUERIES_PER_STEP = 2
IDLE_WAIT_S = 0.1  # how often an idle engine thread checks for shutdown
SMALL_FRAME_BYTES = 4096  # decoded on the I/O thread; larger frames are decoded by the engine thread
LOG_CHARS = 300  # of an error text quoting a peer's frame
HEARTBEAT_REFRESH_S = 0.1  # how stale the load a heartbeat reports may be


def _log_finished(request_id: str, finish_reason: str | None) -> None:
    """Every admitted request's last line, however it ends: a block that finished it, the abort of
    its sender (a hang-up, a rolled-back `n`), or a failed pass."""
    log.info("request finished", extra={"request_id": clip(request_id, 100), "finish_reason": finish_reason})


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
        self.catalog = catalog  # sent in parts to gateways that ask (CatalogQuery)
        self.model_name = model_name or Path(engine.args.model).resolve().name
        self.boot_id = uuid.uuid4().hex
        self.listener = bind if isinstance(bind, Listener) else Listener(bind)
        self.ctx, self.sock = self.listener.ctx, self.listener.sock
        # Engine thread -> I/O thread: [peer, frame] to forward (zmq sockets are single-threaded).
        outbox = f"inproc://outbox-{self.boot_id}"
        self._out_pull = self.ctx.socket(zmq.PULL)
        self._out_pull.bind(outbox)
        self._out_push = self.ctx.socket(zmq.PUSH)
        self._out_push.connect(outbox)
        # [peer, message], or [peer, frame] still to decode (a large one, within `inbox_budget`)
        self.inbox: queue.SimpleQueue[tuple[bytes, object]] = queue.SimpleQueue()
        self.inbox_budget = InboxBudget()
        # Concept queries past a step's share, answered in order at the next steps.
        self.deferred: collections.deque[tuple[bytes, object]] = collections.deque()
        self.owner: dict[str, bytes] = {}  # request id -> identity of the gateway that sent it
        # Peer -> when its last frame came (the I/O thread writes, the engine thread reads and prunes).
        self.heard: dict[bytes, float] = {}
        self.gateway_timeout = gateway_timeout
        self._silence_checked_at = 0.0
        # When the I/O thread last began to wait: every frame that came before was read by then.
        self._listening_since = time.monotonic()
        self.stopping = False
        self._io_done = False
        self._rate_at = (time.monotonic(), 0)
        self._steps_per_s = 0.0
        self._heartbeat_at = 0.0
        self._heartbeat_frame = b""  # the reply to a Ping, encoded by the engine thread
        self._beats = 0  # of them (Heartbeat.engine_beats)
        self._refresh_heartbeat(force=True)

    def request_stop(self, *_: object) -> None:
        self.stopping = True

    # ---- engine thread ------------------------------------------------------------------------
    def serve_forever(self) -> None:
        io = threading.Thread(target=self._io_loop, name="cde-worker-io", daemon=True)
        io.start()
        collecting = gc.isenabled()
        gc.collect()
        gc.freeze()  # the model, the engine and the modules: never scanned again
        gc.disable()
        busy = False
        try:
            while not self.stopping:
                if not io.is_alive():  # deaf and mute, yet holding the device: exit, so it is seen
                    self._close_sockets(linger=0)  # all ours now; open, they hang the exit
                    raise RuntimeError("the worker's I/O thread failed (its error is logged above)")
                self._receive(block=not self.engine.has_work())
                if self.engine.has_work():
                    self._step()
                    busy = True
                elif busy:  # the last request finished and no other came within IDLE_WAIT_S
                    busy = False
                    release_free_memory()
                    self._refresh_heartbeat(force=True)
                collect_garbage()
                self._refresh_heartbeat()
                self._drop_silent_peers()
            self._fail_all("worker is shutting down")
        finally:
            gc.unfreeze()
            if collecting:
                gc.enable()
        self._io_done = True
        io.join()  # it closes the sockets
        if self.listener.auth is not None:
            self.listener.auth.stop()
        self.ctx.term()

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
            item = self.inbox.get(timeout=IDLE_WAIT_S) if block and not self.deferred else self.inbox.get_nowait()
            while True:
                busy = self.engine.has_work()
                if busy and isinstance(item[1], ConceptQuery) and answered >= CONCEPT_QUERIES_PER_STEP:
                    self.deferred.append(item)  # small: decoded by the I/O thread
                else:
                    answered += isinstance(item[1], ConceptQuery)
                    decoded += self._handle(*item)
                    if busy and decoded >= DECODE_BYTES_PER_STEP:
                        return
                item = self.inbox.get_nowait()
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
                self.inbox_budget.give_back(peer, size)
        self._refresh_heartbeat(force=True)  # admitted or aborted: the load changed
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
            self._send(peer, self._concept_info(msg))

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
            self._send(peer, BlockResult(req.request_id, [], True, "error", error=error))
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
        heard_by = self._listening_since - self.gateway_timeout
        silent = {peer for peer, at in list(self.heard.items()) if at < heard_by}
        for peer in silent:
            self.heard.pop(peer, None)
        error = f"dropped: no frame from its gateway for {self.gateway_timeout:g}s"
        for rid, peer in list(self.owner.items()):
            if peer in silent:
                self.engine.abort(rid)
                del self.owner[rid]
                self._send(peer, BlockResult(rid, [], True, "error", error=error))
                log.warning("request dropped: its gateway went silent", extra={"request_id": clip(rid, 100)})
                _log_finished(rid, "abort")
        if silent:
            self._refresh_heartbeat(force=True)

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
        peers, msgs, finished = [], [], False
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
            self._refresh_heartbeat(force=True)
        if msgs:
            frames = encode_all(msgs)
            self._out_push.send_multipart([part for pair in zip(peers, frames) for part in pair])

    def _fail_all(self, message: str) -> None:
        for rid, peer in list(self.owner.items()):
            self.engine.abort(rid)
            self._send(peer, BlockResult(rid, [], True, "error", error=message))
            _log_finished(rid, "error")
        self.owner.clear()
        self._refresh_heartbeat(force=True)

    def _send(self, peer: bytes, msg: object) -> None:
        self._out_push.send_multipart([peer, encode(msg)])

    def _refresh_heartbeat(self, force: bool = False) -> None:
        """The next Ping's reply, encoded here (at most every HEARTBEAT_REFRESH_S unless the load
        changed), so that the I/O thread only sends bytes."""
        now = time.monotonic()
        if force or now - self._heartbeat_at >= HEARTBEAT_REFRESH_S:
            self._heartbeat_at = now
            self._beats += 1
            self._heartbeat_frame = encode(self._heartbeat())

    # ---- I/O thread ---------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._out_pull, zmq.POLLIN)
        try:
            while not self._io_done:
                self._listening_since = time.monotonic()
                events = dict(poller.poll(100))
                if self.sock in events:
                    self._read_requests()
                if self._out_pull in events:
                    self._forward_results()
            self._forward_results()  # the shutdown errors
        except Exception:
            # The engine thread sees this thread gone, closes the sockets and ends the process
            # (serve_forever): it may be sending on _out_push now, and ZeroMQ sockets are not
            # thread-safe; the outbox's room (1000 messages) outlasts its step.
            log.critical("the I/O thread failed:\n%s", traceback.format_exc())
            return
        self._close_sockets()  # the engine thread waits in join()

    def _close_sockets(self, linger: int | None = None) -> None:
        for s in (self.sock, self._out_pull, self._out_push):
            s.close(linger=linger)

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
            self.sock.send_multipart([peer, self._heartbeat_frame])
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

    def _heartbeat(self) -> Heartbeat:
        """On the engine thread (it owns the engine's state)."""
        stats = self.engine.stats()
        now = time.monotonic()
        t0, n0 = self._rate_at
        if now - t0 >= 0.5:
            self._steps_per_s = (stats.forward_passes - n0) / (now - t0)
            self._rate_at = (now, stats.forward_passes)
        cfg = self.engine.cfg
        return Heartbeat(
            boot_id=self.boot_id,
            model=self.model_name,
            context_len=cfg.context_len,
            vocab_size=cfg.vocab_size,
            instruct=cfg.instruct,
            n_layers=cfg.n_layers,
            n_concepts=cfg.n_concepts,
            max_running=self.engine.args.max_running,
            running=stats.running,
            waiting=stats.waiting,
            pages_used=stats.pages_used,
            pages_free=stats.pages_free,
            steps_per_s=round(self._steps_per_s, 2),
            forward_passes=stats.forward_passes,
            device_idle_ms=round(stats.device_idle_ms, 3),
            cache_query_tokens=stats.cache_query_tokens,
            cache_hit_tokens=stats.cache_hit_tokens,
            cache_evictions=stats.cache_evictions,
            cache_pages=stats.cache_pages,
            rss_bytes=resident_bytes(),
            refused_frames=self.inbox_budget.refused,
            catalog_digest=self.catalog.digest if self.catalog else "",
            catalog_bytes=len(self.catalog.data) if self.catalog else 0,
            engine_beats=self._beats,
        )


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
    print(f"CDE worker ready on {listener.endpoint} ({server.model_name}{curve})", flush=True)
    server.serve_forever()
