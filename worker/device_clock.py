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


class DeviceClock:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._last_queued: Mark = None  # after the last launched pass's work; None: the chain is broken
        self._starting: Mark = None  # marked before the launch under way
        self._gaps: deque[tuple[Mark, Mark]] = deque()  # (queued mark of one pass, start mark of the next), unread
        self._idle_ms = 0.0  # the gaps read so far

    def launching(self) -> None:
        self._starting = self._mark()

    def launched(self) -> None:
        """The launch begun by `launching` has queued its pass (a launch that raised never gets here)."""
        if self._last_queued is not None:
            self._gaps.append((self._last_queued, self._starting))
        self._last_queued = self._mark()
        self._read()  # what the device has passed: at most a pass or two stay unread

    def pause(self) -> None:
        """No pass follows the last one for now: the device's next wait is for work, not the host."""
        self._last_queued = None

    def idle_ms(self) -> float:
        """The gaps between back-to-back passes the device has passed, in all, ms."""
        self._read()
        return self._idle_ms

    def _mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _read(self) -> None:
        while self._gaps:
            queued, start = self._gaps[0]
            if self.cuda:
                if not start.query():
                    return
                gap = queued.elapsed_time(start)
            else:
                gap = (start - queued) * 1e3
            self._idle_ms += max(0.0, gap)
            self._gaps.popleft()
