"""Prefix-aware routing: a request goes to the worker most likely to hold its first prompt pages in
its prefix cache (worker/prefix_cache.py), unless that worker is busy.

The gateway remembers where it sent each prompt's first page (its key, shared/prefix_hash.py; a
bounded LRU table, so memory stays bounded whatever clients send):
- a first page seen before goes to the least loaded worker it was sent to;
- a new one becomes the home of the live worker that is home to the fewest remembered first pages
  (so that prefixes, not only requests, spread evenly), ties broken by rendezvous hashing (the
  highest digest of key and worker endpoint: gateways that restart or run side by side agree);
- a worker is busy when it has a full batch (its max_running) more requests outstanding than the
  least loaded one: the request then goes to the least loaded worker, which is remembered as a
  holder too (a hot prefix ends up on several workers).
Requests whose prompt has no full page, or when the table forgot the key, are placed as new.

Why the fewest homes and not plain rendezvous hashing: with 8 prefixes on 2 workers, hashing puts
5 or more on one worker more than half the time, and moving load back then costs a cold prefix
per spill (a simulation over 300 random prefix sets: hit rate and balance of docs/benchmarks.md's
routing bench met in 300 of 300 with homes counted, 0 of 300 with rendezvous and a load fallback).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

W = TypeVar("W")

MAX_REMEMBERED = 65_536  # first-page keys (32 bytes each, with a short list of workers): a few MB at most


class PrefixAffinity:
    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self.max_remembered = max_remembered
        self._holders: OrderedDict[bytes, list[str]] = OrderedDict()  # key -> worker endpoints, home first
        self._homes: dict[str, int] = {}  # endpoint -> keys it is home to

    def choose(
        self, key: bytes, workers: Sequence[W], endpoint: Callable[[W], str], load: Callable[[W], int], slack: int
    ) -> W:
        """The worker for a request whose first page is `key` (workers: the live ones, not empty)."""
        least = min(load(w) for w in workers)
        idle = [w for w in workers if load(w) <= least + slack]  # not busy
        holders = self._holders.get(key)
        if holders is not None:
            self._holders.move_to_end(key)
            held = [w for w in idle if endpoint(w) in holders]
            if held:
                return min(held, key=load)
        else:
            homes = {endpoint(w): self._homes.get(endpoint(w), 0) for w in workers}
            fewest = min(homes.values())
            candidates = [w for w in idle if homes[endpoint(w)] == fewest]
            if candidates:
                chosen = max(candidates, key=lambda w: _rendezvous(key, endpoint(w)))
                self._remember(key, endpoint(chosen))
                return chosen
        chosen = min(workers, key=load)  # every likely holder is busy
        self._remember(key, endpoint(chosen))
        return chosen

    def _remember(self, key: bytes, endpoint: str) -> None:
        holders = self._holders.setdefault(key, [])
        self._holders.move_to_end(key)
        if endpoint in holders:
            return
        holders.append(endpoint)
        if len(holders) == 1:
            self._homes[endpoint] = self._homes.get(endpoint, 0) + 1
        if len(self._holders) > self.max_remembered:
            _, forgotten = self._holders.popitem(last=False)
            self._homes[forgotten[0]] -= 1


def _rendezvous(key: bytes, endpoint: str) -> bytes:
    return hashlib.blake2b(key + endpoint.encode(), digest_size=8).digest()
