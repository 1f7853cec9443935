"""How long the device sat idle between forward passes, waiting for the host's next launch.

A pass's launch is marked on the stream before and after its work is queued. The device idles
from the end of one pass's queued work to the start of the next pass's when the host launched the
next one late: a mark on the stream reads the time the stream reached it, so the gap between the
two marks is the host's lateness (zero when the next pass was queued before the last one ended,
as async scheduling does). Only back-to-back passes count: when the engine runs out of work, the
chain breaks and the wait for the next request is not the host's.

On CUDA the marks are timing events, read once the stream has passed them (never waited for);
on the CPU a launch computes its pass, so the marks are host times and the gap is the host's
time between two passes.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

Mark = Any  # a timing torch.cuda.Event, or a host time (float) on the CPU


def mark(cuda: bool) -> Mark:
    """The time the current stream reaches this point (CUDA), or now (host)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed_ms(a: Mark, b: Mark) -> float:
    """From mark a to mark b (both passed by the stream, on CUDA)."""
    return (b - a) * 1e3 if isinstance(a, float) else a.elapsed_time(b)


class DeviceClock:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._last_queued: Mark = None  # after the last launched pass's work; None: the chain is broken
        self._starting: Mark = None  # marked before the launch under way
        self._gaps: deque[tuple[Mark, Mark]] = deque()  # (queued mark of one pass, start mark of the next), unread
        self._idle_ms = 0.0  # the gaps read so far

    def launching(self) -> None:
        self._starting = mark(self.cuda)

    def launched(self) -> None:
        """The launch begun by `launching` has queued its pass (a launch that raised never gets here)."""
        if self._last_queued is not None:
            self._gaps.append((self._last_queued, self._starting))
        self._last_queued = mark(self.cuda)
        self._read()  # what the device has passed: at most a pass or two stay unread

    def pause(self) -> None:
        """No pass follows the last one for now: the device's next wait is for work, not the host."""
        self._last_queued = None

    def idle_ms(self) -> float:
        """The gaps between back-to-back passes the device has passed, in all, ms."""
        self._read()
        return self._idle_ms

    def _read(self) -> None:
        while self._gaps:
            queued, start = self._gaps[0]
            if self.cuda and not start.query():
                return
            self._idle_ms += max(0.0, elapsed_ms(queued, start))
            self._gaps.popleft()
