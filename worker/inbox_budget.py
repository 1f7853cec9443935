"""The bytes of frames a worker holds undecoded, bounded per peer and in all.

The I/O thread hands frames over 4 KiB to the engine thread undecoded (a Ping must never wait
behind them). Unbounded, a peer sending frames just under the 4 MiB limit grew the worker's
memory by half a gigabyte and, as the engine decoded and refused each one, delayed every step:
a 16-token request took 38 s instead of 1.3 s. Past the budget a frame is refused on arrival
(dropped unread, counted, reported in the heartbeat as `refused_frames`, which the gateway's
`/metrics` shows); the engine decodes at most DECODE_BYTES_PER_STEP between two steps while it
has requests to run, so what is queued costs each step a bounded delay.

The per-peer budget holds ~100 of the largest requests a gateway builds (~0.6 MB each, a full
8B context with a ReLU mask over every concept): a legitimate burst fits, a hostile peer can
hold no more than it, and the total bounds what many peers together can.
"""

from __future__ import annotations

import threading
from collections import Counter

PEER_BYTES = 64 << 20
TOTAL_BYTES = 256 << 20
DECODE_BYTES_PER_STEP = 8 << 20


class InboxBudget:
    def __init__(self, peer_bytes: int = PEER_BYTES, total_bytes: int = TOTAL_BYTES) -> None:
        self.peer_bytes, self.total_bytes = peer_bytes, total_bytes
        self._held: Counter[bytes] = Counter()
        self._total = 0
        self.refused = 0  # frames dropped unread since the worker started
        self._lock = threading.Lock()

    def take(self, peer: bytes, size: int) -> bool:
        """On the I/O thread: room for a frame of `size` bytes from `peer`, or False (refused)."""
        with self._lock:
            if self._held[peer] + size > self.peer_bytes or self._total + size > self.total_bytes:
                self.refused += 1
                return False
            self._held[peer] += size
            self._total += size
            return True

    def give_back(self, peer: bytes, size: int) -> None:
        """On the engine thread, once the frame is decoded (or failed to)."""
        with self._lock:
            self._held[peer] -= size
            self._total -= size
            if self._held[peer] <= 0:
                del self._held[peer]
