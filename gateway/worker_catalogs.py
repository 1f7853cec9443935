"""The concept catalogs the workers send (`shared.catalog_file`), for a gateway that has none of
its own (`cde gateway --worker ...` on another host, without --model): each worker's heartbeat
names its catalog by sha256; a catalog not yet held is fetched in parts from one worker that has
it, checked against its digest and size, and parsed off the event loop.

Per model (the name the workers report): the catalog its live workers agree on. Workers that
name different catalogs for one model disagree on what a name means: the gateway logs it once
and refuses steering by name, groups and search for that model (ids still work) until they
agree again. A worker without a catalog has no say."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from cde.gateway.concepts import ConceptLabels
from cde.gateway.errors import invalid
from cde.gateway.worker_link import WorkerLink
from cde.shared.catalog import CatalogError
from cde.shared.catalog_file import MAX_CATALOG_BYTES, CatalogFile

log = logging.getLogger("cde.gateway")

PART_TIMEOUT_S = 30.0  # per part: the worker's I/O thread answers at once
RETRY_S = 30.0  # after a failed fetch, before trying that catalog again


class DisagreeingLabels(ConceptLabels):
    """No names: the model's workers hold different catalogs. Ids work as without a catalog."""

    def __init__(self, model: str, digests: list[str]):
        super().__init__()
        short = ", ".join(d[:12] for d in digests)
        self.message = (
            f"the workers serving {model!r} hold different concept catalogs (sha256 {short}), so a concept "
            "name could mean different concepts: steer by concept id, or give every worker the same catalog"
        )

    def _by_name(self, label: str, param: str) -> int:
        raise invalid(self.message, param)

    def expand_groups(self, concepts: list[int], n_concepts: int, param: str = "steering.group") -> list[int]:
        raise invalid(self.message, param)

    def search(self, query: str, n_concepts: int, *, limit: int, steerable_only: bool, head: str | None) -> list[dict]:
        raise invalid(self.message, "search")


class WorkerCatalogs:
    def __init__(self) -> None:
        self._held: dict[str, ConceptLabels] = {}  # digest -> the parsed catalog
        self._fetching: dict[str, asyncio.Task] = {}
        self._failed_at: dict[str, float] = {}
        self._disagreeing: dict[str, list[str]] = {}  # model -> the digests last logged

    def refresh(self, links: list[WorkerLink]) -> None:
        """From the router's monitor loop: fetch what is new, log what disagrees."""
        by_model: dict[str, set[str]] = {}
        for link in links:
            hb = link.heartbeat
            if not link.alive or hb is None or not hb.catalog_digest:
                continue
            by_model.setdefault(hb.model, set()).add(hb.catalog_digest)
            digest = hb.catalog_digest
            recently_failed = time.monotonic() - self._failed_at.get(digest, -math.inf) < RETRY_S
            if digest not in self._held and digest not in self._fetching and not recently_failed:
                self._fetching[digest] = asyncio.create_task(self._fetch(link, digest, hb.catalog_bytes))
        for model, digests in by_model.items():
            ordered = sorted(digests)
            if len(ordered) > 1 and self._disagreeing.get(model) != ordered:
                log.error("%s", DisagreeingLabels(model, ordered).message)
            self._disagreeing[model] = ordered if len(ordered) > 1 else []

    def labels(self, model: str, links: list[WorkerLink]) -> ConceptLabels:
        beats = [link.heartbeat for link in links if link.alive and link.heartbeat is not None]
        digests = sorted({hb.catalog_digest for hb in beats if hb.model == model and hb.catalog_digest})
        if len(digests) > 1:
            return DisagreeingLabels(model, digests)
        return self._held.get(digests[0], _NONE) if digests else _NONE

    def pending(self, links: list[WorkerLink]) -> bool:
        """Whether a live worker's catalog is still to come (for a gateway waiting at startup)."""
        return any(
            link.alive and link.heartbeat and link.heartbeat.catalog_digest not in (*self._held, *self._failed_at, "")
            for link in links
        )

    def close(self) -> None:
        for task in self._fetching.values():
            task.cancel()

    async def _fetch(self, link: WorkerLink, digest: str, size: int) -> None:
        try:
            if not 0 < size <= MAX_CATALOG_BYTES:
                raise CatalogError(f"{size} bytes is outside (0, {MAX_CATALOG_BYTES}]")
            data, suffix = bytearray(), ""
            while len(data) < size:
                part = await link.fetch_catalog_part(len(data), PART_TIMEOUT_S)
                if (part.digest, part.total, part.offset) != (digest, size, len(data)) or not part.data:
                    raise CatalogError("the worker's answer is not the catalog it announced (it changed?)")
                data += part.data[: size - len(data)]
                suffix = part.suffix
            received = CatalogFile.of(bytes(data), suffix)
            if received.digest != digest:
                raise CatalogError(f"its sha256 is {received.digest[:12]}, not the announced {digest[:12]}")
            # Parsing a large parquet takes seconds: never on the event loop.
            labels = await asyncio.to_thread(lambda: ConceptLabels(received.catalog()))
        except (CatalogError, TimeoutError) as exc:
            self._failed_at[digest] = time.monotonic()
            log.warning("%s: could not fetch its concept catalog %s: %s", link.name, digest[:12], exc)
        else:
            self._held[digest] = labels
            log.info("%s: concept catalog %s (%d concepts)", link.name, digest[:12], len(labels.catalog))
        finally:
            self._fetching.pop(digest, None)


_NONE = ConceptLabels()
