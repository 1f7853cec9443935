"""`cde bench engine --watch S`: a run that does not finish says why.

Every S seconds a daemon thread prints one JSON line to stderr: the engine's forward passes so
far, its running and waiting requests, and the least advanced running ones (block, steps,
committed tokens). Passes that keep counting while no request advances are a scheduling
livelock; passes that stop counting are a wait that never ends (the host on the GPU, or the GPU
on a kernel), and then the thread also dumps every Python thread's stack. Should a C call hold
the GIL so that the thread itself cannot run, faulthandler's own watchdog (C, no GIL) dumps the
stacks after three periods. The thread only reads (racily, for a report), so it cannot change
what it watches.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cde.worker.engine import Engine


class Watch:
    def __init__(self, engine: Engine, every_s: float):
        self.engine, self.every_s = engine, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        faulthandler.cancel_dump_traceback_later()

    def report(self) -> dict:
        s = self.engine.scheduler
        running = sorted(list(s.running), key=lambda q: (q.block, q.committed))
        return {
            "watch": "bench",
            "forward_passes": self.engine.forward_passes,
            "running": len(running),
            "waiting": len(s.waiting),
            "least_advanced": [
                {"id": q.id, "block": q.block, "steps": q.step, "committed": q.committed} for q in running[:4]
            ],
        }

    def _loop(self) -> None:
        start, passes = time.monotonic(), -1
        # re-armed every period: it fires only when this thread could not run for three of them
        faulthandler.dump_traceback_later(3 * self.every_s)
        while not self._stop.wait(self.every_s):
            faulthandler.dump_traceback_later(3 * self.every_s)
            report = self.report()
            report["s"] = round(time.monotonic() - start, 1)
            print(json.dumps(report), file=sys.stderr, flush=True)
            if report["forward_passes"] == passes:  # nothing moved for a whole period
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            passes = report["forward_passes"]
