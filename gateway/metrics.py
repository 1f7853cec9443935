"""Prometheus metrics. Worker gauges are filled from the latest heartbeats at scrape time; the
latency histograms and token counters are observed by the gateway as blocks arrive.
One registry per app, so several gateways can live in one process (tests)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        w = ["worker"]
        self.worker_up = Gauge("cde_worker_up", "1 while the worker answers heartbeats", w, registry=r)
        self.outstanding = Gauge(
            "cde_gateway_outstanding_requests", "Requests the gateway has in flight", w, registry=r
        )
        self.pages_free = Gauge("cde_kv_pages_free", "KV cache pages (64 tokens) free", w, registry=r)
        self.steps = Gauge("cde_steps_per_second", "Forward passes per second", w, registry=r)
        # Since the worker started (gauges, as the prefix cache's: a restarted worker starts at 0).
        self.passes = Gauge("cde_worker_forward_passes", "Forward passes since the worker started", w, registry=r)
        self.device_idle = Gauge(
            "cde_worker_device_idle_seconds",
            "Of them, the device's waits for the host's next launch between back-to-back passes",
            w,
            registry=r,
        )
        self.worker_rss = Gauge(
            "cde_worker_resident_memory_bytes", "Resident memory of the worker process", w, registry=r
        )
        ProcessCollector(registry=r)  # the gateway's own process_resident_memory_bytes, CPU, fds
        self.waiting = Gauge("cde_worker_waiting_requests", "Requests queued in the worker", w, registry=r)
        self.running = Gauge("cde_worker_running_requests", "Requests the worker is decoding", w, registry=r)
        self.pages_used = Gauge("cde_worker_kv_pages_used", "KV cache pages (64 tokens) in use", w, registry=r)
        self.refused_frames = Gauge(
            "cde_worker_refused_frames", "Frames the worker dropped unread past its inbox budget", w, registry=r
        )
        self.pages_total = Gauge("cde_worker_kv_pages_total", "KV cache pages (64 tokens) in all", w, registry=r)
        # The prefix cache (worker/prefix_cache.py): counts since the worker started, and pages now.
        self.cache = {
            "cache_query_tokens": Gauge(
                "cde_worker_prefix_cache_query_tokens", "Tokens of full prompt pages looked up", w, registry=r
            ),
            "cache_hit_tokens": Gauge(
                "cde_worker_prefix_cache_hit_tokens", "Of them, found cached instead of prefilled", w, registry=r
            ),
            "cache_evictions": Gauge(
                "cde_worker_prefix_cache_evictions", "Cached pages taken back for other requests", w, registry=r
            ),
            "cache_pages": Gauge(
                "cde_worker_prefix_cache_pages", "Pages the prefix cache holds, in use or not", w, registry=r
            ),
        }
        self.ttfb = Histogram(
            "cde_time_to_first_block_seconds", "Request arrival to its first block", buckets=LATENCY_BUCKETS, registry=r
        )
        self.inter_block = Histogram(
            "cde_inter_block_latency_seconds",
            "Between consecutive blocks of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "cde_e2e_request_latency_seconds", "Request arrival to its last block", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("cde_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("cde_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("cde_requests_finished", "Finished generations", ["finish_reason"], registry=r)
        # Every HTTP response by status code (counted by middleware.RequestLog), errors included:
        # a 500 or a burst of 429s shows here even when no generation finished.
        self.http_responses = Counter("cde_http_responses", "HTTP responses by status code", ["status"], registry=r)

    def render(self, links: list) -> bytes:
        for link in links:
            hb = link.heartbeat if link.alive else None
            self.worker_up.labels(link.name).set(1 if hb else 0)
            self.outstanding.labels(link.name).set(len(link.inflight))
            # A dead worker holds nothing any more: report zeros, not its last words.
            self.running.labels(link.name).set(hb.running if hb else 0)
            self.waiting.labels(link.name).set(hb.waiting if hb else 0)
            self.pages_used.labels(link.name).set(hb.pages_used if hb else 0)
            self.pages_free.labels(link.name).set(hb.pages_free if hb else 0)
            self.steps.labels(link.name).set(hb.steps_per_s if hb else 0)
            self.passes.labels(link.name).set(hb.forward_passes if hb else 0)
            self.device_idle.labels(link.name).set(hb.device_idle_ms / 1e3 if hb else 0)
            self.worker_rss.labels(link.name).set(hb.rss_bytes if hb else 0)
            self.refused_frames.labels(link.name).set(hb.refused_frames if hb else 0)
            self.pages_total.labels(link.name).set(hb.pages_used + hb.pages_free if hb else 0)
            for field, gauge in self.cache.items():
                gauge.labels(link.name).set(getattr(hb, field) if hb else 0)
        return generate_latest(self.registry)
