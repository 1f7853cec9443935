"""Which request of a pass made its launch fail.

Building a pass walks every request's values (staging them into one tensor, sampling over one
batch), so one request the engine cannot serve makes the whole launch raise. Rather than fail
every request in flight, the engine launches each request's items alone: the ones whose solo
launch raises are the culprits, failed alone, and the pass is launched again without them. The
probes cost one solo pass per request of the batch, only on a failure; a culprit does not come
back. Nothing a probe changes outlives it: the K/V it writes are the values the real pass writes
again (the same inputs), and the repetition-penalty rows it marks are restored.
"""

from __future__ import annotations

import logging
import traceback

from cde.worker.model_runner import ModelRunner
from cde.worker.scheduler import Batch
from cde.worker.sequence import Sequence

log = logging.getLogger("cde.worker")


def without(batch: Batch, dropped: list[Sequence]) -> Batch:
    """The batch without any item of `dropped`."""
    ids = {id(s) for s in dropped}
    return Batch([it for it in batch.items if id(it.seq) not in ids])


def culprits(runner: ModelRunner, batch: Batch) -> list[Sequence]:
    """The requests of `batch` whose items alone fail to launch (an empty list: the failure is
    not one request's, and the caller fails them all as before)."""
    seqs = list({id(it.seq): it.seq for it in batch.items}.values())
    if len(seqs) < 2:  # alone already
        log.error("request %s fails its pass alone", seqs[0].id[:100] if seqs else None)
        return seqs
    seen = runner.seen.clone()
    found = []
    try:
        for seq in seqs:
            try:
                runner.picks(runner.launch(Batch([it for it in batch.items if it.seq is seq])))
            except Exception:
                log.error("request %s fails its pass alone:\n%s", seq.id[:100], traceback.format_exc())
                found.append(seq)
    finally:
        runner.seen.copy_(seen)
    return found
