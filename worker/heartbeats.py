"""The worker's heartbeat: what it serves and its load, the reply to every gateway Ping.

Built and encoded on the engine thread (it owns the engine's state), at most every
HEARTBEAT_REFRESH_S unless the load changed, and handed to the I/O thread as bytes: a Ping is
answered at once, however long a pass takes, and the I/O thread never encodes.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from cde.shared.protocol import Heartbeat
from cde.shared.wire import encode
from cde.worker.engine import Engine
from cde.worker.process_memory import resident_bytes
from cde.worker.worker_io import WorkerIO

HEARTBEAT_REFRESH_S = 0.1  # how stale the load a heartbeat reports may be


class Heartbeats:
    def __init__(self, engine: Engine, io: WorkerIO, model_name: str | None = None):
        self.engine, self.io = engine, io
        self.model_name = model_name or Path(engine.args.model).resolve().name
        self.boot_id = uuid.uuid4().hex  # a restarted worker is told apart from the one before
        self._rate_at = (time.monotonic(), 0)
        self._steps_per_s = 0.0
        self._refreshed_at = 0.0
        self._beats = 0  # of them (Heartbeat.engine_beats)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """The next Ping's reply: now if `force` (the load changed), else if the last is stale."""
        now = time.monotonic()
        if force or now - self._refreshed_at >= HEARTBEAT_REFRESH_S:
            self._refreshed_at = now
            self._beats += 1
            self.io.heartbeat_frame = encode(self._heartbeat())

    def _heartbeat(self) -> Heartbeat:
        stats = self.engine.stats()
        now = time.monotonic()
        t0, n0 = self._rate_at
        if now - t0 >= 0.5:
            self._steps_per_s = (stats.forward_passes - n0) / (now - t0)
            self._rate_at = (now, stats.forward_passes)
        cfg, catalog = self.engine.cfg, self.io.catalog
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
            refused_frames=self.io.inbox_budget.refused,
            catalog_digest=catalog.digest if catalog else "",
            catalog_bytes=len(catalog.data) if catalog else 0,
            engine_beats=self._beats,
        )
