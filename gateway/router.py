"""The worker pool: liveness (heartbeats + process exit), and routing: by prompt prefix
(gateway/prefix_routing.py), least outstanding requests, or round robin."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq.asyncio
from cde.gateway.errors import ApiError
from cde.gateway.model_info import ModelInfo
from cde.gateway.prefix_routing import PrefixAffinity
from cde.gateway.worker_catalogs import WorkerCatalogs
from cde.gateway.worker_link import RequestHandle, WorkerLink
from cde.shared.config import PAGE
from cde.shared.curve import CurveClient
from cde.shared.prefix_hash import page_keys
from cde.shared.protocol import ConceptInfo, GenerateRequest

if TYPE_CHECKING:
    from cde.gateway.discovery import DnsDiscovery

log = logging.getLogger("cde.gateway")

QUERY_TIMEOUT_S = 60.0  # a query waits for the engine thread to finish its current step
ROUTING = ("prefix", "least-loaded", "round-robin")  # --routing


class Router:
    def __init__(
        self,
        endpoints: list[str],
        processes: list[subprocess.Popen] | None = None,
        *,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 5.0,
        engine_stall_timeout: float = 60.0,
        max_queue: int = 256,
        max_queued_per_client: int = 128,
        curve: CurveClient | None = None,
        discovery: DnsDiscovery | None = None,
        fetch_catalogs: bool = True,
        routing: str = "prefix",
    ) -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {', '.join(ROUTING)}, not {routing!r}")
        self.routing = routing
        self.affinity = PrefixAffinity()
        self.endpoints = endpoints
        self.processes = processes or [None] * len(endpoints)
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.engine_stall_timeout = engine_stall_timeout
        self.max_queue = max_queue  # requests a worker may hold beyond max_running before we shed load
        self.max_queued_per_client = max_queued_per_client  # in flight, over all workers: no client fills the queue
        self.curve = curve
        self.discovery = discovery  # e.g. gateway.discovery.DnsDiscovery: adds workers while serving
        self.links: list[WorkerLink] = []
        # The workers' concept catalogs, for a gateway without its own (None: it has one).
        self.catalogs = WorkerCatalogs() if fetch_catalogs else None
        self._ctx: zmq.asyncio.Context | None = None
        self._identity = f"gateway-{uuid.uuid4().hex[:12]}".encode()
        self._monitor: asyncio.Task | None = None
        self._turn = 0
        self._ready = False  # every worker answered once (`wait_ready`)
        self.workers_gone: str | None = None  # why every worker process we started has exited
        # Set by the HTTP server: begins its drain; False while it cannot (not yet serving, or
        # draining already).
        self.stop_serving: Callable[[], bool] | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        for i, (ep, proc) in enumerate(zip(self.endpoints, self.processes)):
            self.add_worker(f"worker-{i}", ep, proc)
        self._monitor = asyncio.create_task(self._monitor_loop())
        if self.discovery is not None:
            self.discovery.start(self)

    def add_worker(self, name: str, endpoint: str, process: subprocess.Popen | None = None) -> WorkerLink:
        link = WorkerLink(name, endpoint, self._ctx, self._identity, process, self.curve)
        self.links.append(link)
        link.start()
        link.ping()
        return link

    async def remove_worker(self, link: WorkerLink) -> None:
        self.links.remove(link)
        link.fail_all(f"{link.name} was removed")
        await link.close()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        if self._monitor is not None:
            self._monitor.cancel()
        if self.catalogs is not None:
            self.catalogs.close()
        self.fail_all("server is shutting down")
        await asyncio.sleep(0.05)  # let the aborts reach the workers
        for link in self.links:
            await link.close()
        self._ctx.term()

    def fail_all(self, message: str) -> None:
        """Ends every request in flight with an explicit error and aborts it in its worker."""
        for link in self.links:
            link.fail_all(message, abort=True)

    async def wait_ready(self, timeout: float) -> None:
        """Until every worker has answered; fails fast when one of our worker processes exits."""
        deadline = time.monotonic() + timeout
        # Ready: every worker answered, and the concept catalogs they announced have arrived.
        while not all(link.alive for link in self.links) or (self.catalogs and self.catalogs.pending(self.links)):
            for link in self.links:
                if link.exit_code() is not None:
                    raise RuntimeError(f"{link.name} exited with code {link.exit_code()} during startup")
            if time.monotonic() > deadline:
                late = [link.name for link in self.links if not link.alive] or ["their concept catalogs"]
                raise RuntimeError(f"workers not ready after {timeout:g}s: {', '.join(late)}")
            await asyncio.sleep(0.05)
        self._ready = True

    async def _monitor_loop(self) -> None:
        while True:
            slept = time.monotonic()
            await asyncio.sleep(self.heartbeat_interval)
            # Woken late, the event loop was busy (a long request, a GC pause): the heartbeats
            # that came meanwhile wait unread in the sockets. The time it could not listen does
            # not count as the workers' silence.
            late = max(time.monotonic() - slept - self.heartbeat_interval, 0.0)
            for link in self.links:
                link.last_seen += late
                link.progress_seen += late
                link.check(self.heartbeat_timeout, self.engine_stall_timeout)
                if link.exit_code() is None:
                    link.ping()
            if self.catalogs is not None:
                self.catalogs.refresh(self.links)
            self._stop_when_every_worker_is_gone()

    def _stop_when_every_worker_is_gone(self) -> None:
        """A `cde serve` whose worker processes have all exited (an OOM, a crashed device) could
        only answer 503 from then on: it drains and stops instead, as vLLM's server stops with its
        engine, for the process manager to restart it (`cde serve` then exits 1)."""
        ours = [link for link in self.links if link.process is not None]
        if not self._ready or self.stop_serving is None or not ours or any(link.exit_code() is None for link in ours):
            return
        if self.stop_serving():  # else asked again at the next beat
            self._ready = False  # once
            self.workers_gone = ", ".join(f"{link.name} exited with code {link.exit_code()}" for link in ours)
            log.error("every worker has exited (%s): stopping", self.workers_gone)

    # ---- routing ------------------------------------------------------------------------------
    @property
    def alive(self) -> list[WorkerLink]:
        return [link for link in self.links if link.alive]

    @property
    def model_info(self) -> ModelInfo | None:
        """What the served model accepts, from any live worker (None: no worker is alive)."""
        alive = self.alive
        return alive[0].model if alive else None

    def live(self) -> list[WorkerLink]:
        """The live workers, or the API's 503 `no_worker` when none is: the one place it is raised."""
        alive = self.alive
        if not alive:
            raise ApiError(503, "no worker is available", code="no_worker")
        return alive

    def _least_loaded(self) -> WorkerLink:
        alive = self.live()
        # Rotate the start so that equally loaded workers take turns.
        self._turn = (self._turn + 1) % len(alive)
        order = alive[self._turn :] + alive[: self._turn]
        return min(order, key=lambda w: len(w.inflight))

    def _route(self, req: GenerateRequest) -> WorkerLink:
        if self.routing == "round-robin":
            alive = self.live()
            self._turn = (self._turn + 1) % len(alive)
            return alive[self._turn]
        if self.routing == "least-loaded" or len(req.prompt_ids) < PAGE:  # no full page to find cached
            return self._least_loaded()
        alive = self.live()
        key = page_keys(req.prompt_ids, 1)[0]  # one hash of 256 bytes: nothing to take off the event loop
        slack = alive[0].heartbeat.max_running  # busy: a whole batch more outstanding than the least loaded
        return self.affinity.choose(key, alive, lambda w: w.endpoint, lambda w: len(w.inflight), slack)

    def submit(self, req: GenerateRequest, frame: bytes) -> RequestHandle:
        """`frame`: `req` encoded (`shared.wire.encode_all`)."""
        link = self._route(req)
        if self._in_flight_of(req.client) >= self.max_queued_per_client:
            raise ApiError(
                429,
                f"too many requests in flight from this client (at most {self.max_queued_per_client} "
                "choices): wait for some to finish",
                code="client_overloaded",
                headers={"Retry-After": "1"},
            )
        if len(link.inflight) >= link.heartbeat.max_running + self.max_queue:
            raise ApiError(
                429,
                "server overloaded: the request queue is full, retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        return link.submit(req, frame)

    def _in_flight_of(self, client: str) -> int:
        return sum(h.client == client for link in self.links for h in link.inflight.values())

    async def concept_top_tokens(self, concept_id: int, k: int) -> ConceptInfo:
        """Only a worker holds the weights, so it computes what a concept promotes."""
        link = self._least_loaded()
        try:
            info = await link.query_concept(concept_id, k, QUERY_TIMEOUT_S)
        except TimeoutError:
            raise ApiError(503, f"{link.name} did not answer the concept query", code="worker_timeout") from None
        if info.error is not None:
            raise ApiError(500, info.error, code="concept_query_failed")
        return info
