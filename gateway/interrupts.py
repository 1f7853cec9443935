"""SIGINT and SIGTERM for `cde serve`, outside uvicorn's own handlers (which drain once serving).

Raised where it lands, a KeyboardInterrupt can be lost: inside a weakref callback or a `__del__`
Python prints it and drops it. A SIGTERM that met the import machinery's weakref callback while
the worker loaded was dropped so, and `cde serve` went on to serve. So a signal is recorded
first. It is raised where it lands only until the workers start (`defer`), so that a slow step
before them (a Hub download, the GPU probe) is cut short and nothing is left to stop. From then
on a first signal is only recorded, and acted on at the command's own checks: `serve_http`'s
start-up loop and `raise_if_received`, as asyncio.Runner treats SIGINT. A second one is raised at
once: it cuts the workers' stop short (they still end with us, by PR_SET_PDEATHSIG)."""

from __future__ import annotations

import signal
from types import FrameType


class Interrupts:
    def __init__(self) -> None:
        self.received = False
        self._deferring = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        first = not self.received
        self.received = True
        if not (first and self._deferring):
            raise KeyboardInterrupt

    def defer(self) -> None:
        """From here a first signal is only recorded; one that was lost before is raised now."""
        self._deferring = True
        self.raise_if_received()

    def raise_if_received(self) -> None:
        if self.received:
            raise KeyboardInterrupt
