"""Worker discovery through DNS: one link per A record of NAME, re-resolved every few seconds.

Made for a Kubernetes headless Service, whose name resolves to the IPs of the ready worker pods:
new pods are connected as they become ready, and a link whose IP left the record set is dropped
once it is down (a pod that is only leaving keeps serving what it has in flight)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cde.gateway.router import Router
    from cde.gateway.worker_link import WorkerLink

log = logging.getLogger("cde.gateway")


def dns_target(text: str) -> tuple[str, int]:
    """argparse type for NAME:PORT."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(
            f"expected NAME:PORT, e.g. cde-worker.default.svc.cluster.local:5555, got {text!r}"
        )
    return host, int(port)


class DnsDiscovery:
    def __init__(self, targets: list[tuple[str, int]], interval: float = 5.0):
        self.targets, self.interval = targets, interval
        self.links: dict[str, WorkerLink] = {}  # endpoint -> the WorkerLink made for it
        self._seen: dict[str, set[str]] = {}  # host -> endpoints of its last successful resolution
        self._errors: dict[str, str] = {}  # host -> last resolution error, logged once
        self._task: asyncio.Task | None = None

    def start(self, router: Router) -> None:
        self._task = asyncio.create_task(self._loop(router))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self, router: Router) -> None:
        while True:
            await self.refresh(router)
            await asyncio.sleep(self.interval)

    async def refresh(self, router: Router) -> None:
        found: set[str] = set()
        for host, port in self.targets:
            try:
                ips = await self._resolve(host, port)
            except OSError as exc:
                # No ready pod yet, or DNS is down: keep the links we have.
                if self._errors.get(host) != str(exc):
                    log.warning("cannot resolve workers at %s: %s", host, exc)
                self._errors[host] = str(exc)
                found |= self._seen.get(host, set())
                continue
            self._errors.pop(host, None)
            self._seen[host] = {f"tcp://{ip}:{port}" for ip in ips}
            found |= self._seen[host]
            for ip in ips:
                endpoint = f"tcp://{ip}:{port}"
                if endpoint not in self.links:
                    log.info("discovered worker %s (%s)", endpoint, host)
                    self.links[endpoint] = router.add_worker(f"{ip}:{port}", endpoint)
        for endpoint in [ep for ep in self.links if ep not in found and not self.links[ep].alive]:
            log.info("dropping worker %s: no longer in DNS and down", endpoint)
            await router.remove_worker(self.links.pop(endpoint))

    @staticmethod
    async def _resolve(host: str, port: int) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
        return sorted({info[4][0] for info in infos})  # type: ignore[misc]  # AF_INET: the host is a str
