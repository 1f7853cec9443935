"""The router's tie-break: between equally loaded workers it takes turns, so that one after another
requests (each done before the next) spread over every worker instead of all landing on the
first. A real Router in front of two real `cde worker` processes (tiny model)."""

import asyncio

from cde.gateway.router import Router
from cde.shared.protocol import GenerateRequest
from cde.shared.wire import encode

from tests.cde_procs import TinyWorker


async def collect(handle) -> list:
    return [r async for r in handle.results()]


async def test_equally_loaded_workers_take_turns(tiny_dir):
    workers = [TinyWorker(tiny_dir, "--max-running", "2") for _ in range(2)]
    router = Router([w.endpoint for w in workers])
    try:
        for w in workers:
            w.wait_for("worker ready")
        await router.start()
        await router.wait_ready(60)
        served_by = []
        for i in range(4):
            req = GenerateRequest(f"r{i}", [1, 2, 3], max_tokens=1)
            handle = router.submit(req, encode(req))
            served_by.append(handle.link.name)
            results = await asyncio.wait_for(collect(handle), 60)
            assert results[-1].finish_reason == "length"
        assert served_by in (["worker-0", "worker-1"] * 2, ["worker-1", "worker-0"] * 2)
    finally:
        await router.stop()
        for w in workers:
            w.stop()
