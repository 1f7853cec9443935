"""The worker process's memory: when its Python garbage is collected (automatic collection is
off while it serves; `worker.zmq_server` says why) and when its free heap goes back to the OS."""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# Young objects allocated before the engine thread collects (the automatic default is 700: a
# collection every few steps). Between steps or while idle; 10 young collections make one of the
# middle generation, 10 of those a full one, as the automatic collector does.
GC_YOUNG = 20_000
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only


def release_free_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing). Called
    when the worker goes idle: without it, the buffers of the largest batches stay resident after
    they finished, so an idle worker's resident memory (the heartbeat's, which operators and
    `cde bench soak` watch for leaks) would be its high-water mark, not what it holds. No garbage
    collection here: finalizers would run at whatever moment a request ends, and
    `collect_garbage` already collects at its own moments."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def resident_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def collect_garbage() -> None:
    """What the automatic collector would do by now, at a moment the engine thread chooses."""
    young, middle, old = gc.get_count()
    if young >= GC_YOUNG:
        gc.collect(2 if old >= 10 else 1 if middle >= 10 else 0)
