"""`python -m tests.faulty_worker ARGS`: `cde worker ARGS` with one planted fault, for the test of
the worker's engine-failure path (tests/worker/test_worker_step_failure.py).

A request whose prompt starts with LAUNCH_FAULT makes the launch of any pass holding one of its
steps raise (a bug in building the pass); one whose prompt starts with SYNC_FAULT makes reading
the picks of such a pass raise, where a CUDA device error surfaces (the first wait on the pass);
one whose prompt starts with ADMIT_FAULT makes its admission raise a KeyError (a bug in checking
a field, not a ValueError refusal).
Nothing else differs from `cde worker`: real engine, real ZeroMQ server, real process.
"""

import sys

from cde.worker.engine import Engine
from cde.worker.model_runner import ModelRunner

LAUNCH_FAULT, SYNC_FAULT, ADMIT_FAULT = 99_991, 99_992, 99_993


def _faulty(pass_or_batch, token: int) -> bool:
    return any(it.is_step and it.seq.req.prompt_ids[:1] == [token] for it in pass_or_batch.items)


def _plant() -> None:
    launch, picks, validate = ModelRunner.launch, ModelRunner.picks, Engine.validate

    def failing_launch(self, batch):
        if _faulty(batch, LAUNCH_FAULT):
            raise RuntimeError("planted fault while launching a pass")
        return launch(self, batch)

    def failing_picks(self, p):
        if _faulty(p.batch, SYNC_FAULT):
            raise RuntimeError("planted fault while reading a pass's picks")
        return picks(self, p)

    def failing_validate(self, req):
        if req.prompt_ids[:1] == [ADMIT_FAULT]:
            raise KeyError("planted fault while checking a request")
        return validate(self, req)

    ModelRunner.launch, ModelRunner.picks, Engine.validate = failing_launch, failing_picks, failing_validate


if __name__ == "__main__":
    from cde.cli import main

    _plant()
    sys.exit(main(["worker", *sys.argv[1:]]))
