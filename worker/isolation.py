"""Which request of a pass made its launch fail.

Building a pass walks every request's values (staging them into one tensor, sampling over one
batch), so one request the engine cannot serve makes the whole launch raise. Rather than fail
every request in flight, the engine launches each request's items alone: the ones whose solo
launch raises are the culprits, failed alone, and the pass is launched again without them. The
probes cost one solo pass per request of the batch, only on a failure; a culprit does not come
back. Nothing a probe changes outlives it: the K/V it writes are the values the real pass writes
again (the same inputs), and the penalties' rows it marks (repetition, frequency, presence) are
restored.
"""

from __future__ import annotations

import logging
import traceback

import torch
from cde.worker.model_runner import ModelRunner
from cde.worker.plan import StepPlan

log = logging.getLogger("cde.worker")


def culprits(runner: ModelRunner, plan: StepPlan) -> set[int]:
    """The slots of the requests of `plan` whose items alone fail to launch (an empty set: the
    failure is not one request's, and the caller fails them all as before)."""
    slots = {it.slot: it.request.request_id for it in plan.items}
    if len(slots) < 2:  # alone already
        _failed_alone(next(iter(slots.values()), ""))  # called while the launch's exception is handled
        return set(slots)
    seen = runner.seen.clone()
    counts = runner.rules.counts.clone() if runner.rules.counts is not None else None
    found = set()
    try:
        for slot, request_id in slots.items():
            try:
                runner.picks(runner.launch(plan.without(set(slots) - {slot})))
            except Exception:
                _failed_alone(request_id)
                found.add(slot)
    finally:
        with torch.inference_mode():  # the counts were made in it (the runner's start)
            runner.seen.copy_(seen)
            if counts is not None and runner.rules.counts is not None:
                runner.rules.counts.copy_(counts)
    return found


def _failed_alone(request_id: str) -> None:
    """Logged while the exception is handled: its traceback says why."""
    log.error("request %s fails its pass alone:\n%s", request_id[:100], traceback.format_exc())
