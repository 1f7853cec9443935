"""The ZeroMQ worker loop, driven over a real socket by a DEALER like the gateway's."""

import threading
import time

import pytest
import zmq
from cde.shared.protocol import (
    AbortRequest,
    BlockResult,
    ConceptInfo,
    ConceptQuery,
    GenerateRequest,
    Heartbeat,
    Ping,
)
from cde.shared.wire import decode, encode
from cde.worker.engine import Engine, EngineArgs
from cde.worker.zmq_server import WorkerServer


@pytest.fixture(scope="module")
def worker(tiny_dir, tmp_path_factory):
    endpoint = f"ipc://{tmp_path_factory.mktemp('zmq')}/w"
    server = WorkerServer(Engine(EngineArgs(str(tiny_dir), max_running=4)), endpoint, "tiny")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield endpoint
    server.request_stop()
    thread.join(10)


@pytest.fixture
def dealer(worker):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker)
    yield sock
    sock.close()


def recv(sock, timeout=30.0):
    assert sock.poll(int(timeout * 1000)), "no reply from the worker"
    return decode(sock.recv())


def results_until_finished(sock, rid):
    out = []
    while True:
        msg = recv(sock)
        if isinstance(msg, BlockResult) and msg.request_id == rid:
            out.append(msg)
            if msg.finished:
                return out


def heartbeat(sock) -> Heartbeat:
    sock.send(encode(Ping(time.time())))
    while not isinstance(msg := recv(sock), Heartbeat):
        pass
    return msg


def test_ping_answers_with_model_and_load(dealer):
    hb = heartbeat(dealer)
    assert (hb.model, hb.context_len, hb.max_running, hb.instruct) == ("tiny", 1024, 4, False)
    assert hb.running == hb.waiting == hb.pages_used == 0


def test_generate_streams_blocks_then_finishes(dealer):
    dealer.send(encode(GenerateRequest("g1", [1, 2, 3], max_tokens=70, temperature=0.0, tokens_per_step=16)))
    results = results_until_finished(dealer, "g1")
    assert [r.finished for r in results] == [False, True]
    assert results[-1].finish_reason == "length"
    assert sum(len(r.token_ids) for r in results) == 70
    assert len(results[0].token_ids) == 61  # the first block holds the 3 prompt tokens


def test_invalid_request_gets_an_error_result(dealer):
    dealer.send(encode(GenerateRequest("bad", [1], max_tokens=5000)))
    (res,) = results_until_finished(dealer, "bad")
    assert res.finish_reason == "error" and "exceeds the context" in res.error


def concept_info(sock, query: ConceptQuery) -> ConceptInfo:
    sock.send(encode(query))
    while not isinstance(msg := recv(sock), ConceptInfo):
        pass
    assert msg.query_id == query.query_id
    return msg


def test_concept_query_answers_top_tokens_best_first(dealer):
    info = concept_info(dealer, ConceptQuery("q1", 3, k=5))
    assert info.error is None and len(info.token_ids) == len(info.scores) == 5
    assert info.scores == sorted(info.scores, reverse=True)


def test_unknown_concept_query_gets_an_error(dealer):
    info = concept_info(dealer, ConceptQuery("q2", 10_000, k=5))
    assert info.token_ids == [] and "unknown concept id" in info.error


def test_abort_frees_pages(dealer):
    dealer.send(encode(GenerateRequest("long", [1, 2], max_tokens=900)))
    deadline = time.monotonic() + 30
    while heartbeat(dealer).pages_used == 0:
        assert time.monotonic() < deadline
    dealer.send(encode(AbortRequest("long")))
    while (hb := heartbeat(dealer)).pages_used:
        assert time.monotonic() < deadline
    assert (hb.running, hb.waiting) == (0, 0)


def test_garbage_frames_are_dropped(dealer):
    dealer.send(b"\xc1not msgpack")
    assert heartbeat(dealer).running == 0


def test_a_failed_io_thread_ends_the_worker_instead_of_leaving_it_deaf(tiny_dir, tmp_path, monkeypatch):
    """A bug in the I/O thread closes its sockets and the engine thread raises at once: the
    process exits (seen by `cde serve` and probes) rather than holding the device, deaf."""
    endpoint = f"ipc://{tmp_path}/w"
    server = WorkerServer(Engine(EngineArgs(str(tiny_dir), max_running=4)), endpoint, "tiny")

    def bug() -> None:
        raise RuntimeError("a bug in reading")

    monkeypatch.setattr(server.io, "_read_requests", bug)
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            server.serve_forever()
        except RuntimeError as exc:
            failed.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(encode(Ping(time.time())))
    thread.join(30)
    sock.close()
    assert not thread.is_alive() and "I/O thread failed" in str(failed[0])
