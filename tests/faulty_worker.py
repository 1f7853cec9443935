"""`python -m tests.faulty_worker ARGS`: `cde worker ARGS` with one planted fault, for the test of
the worker's engine-failure path (tests/worker/test_worker_step_failure.py); `python -m
tests.faulty_worker generate ARGS`: `cde generate ARGS` with the same faults (tests/cli/test_cli_errors.py).

A request whose prompt starts with LAUNCH_FAULT makes the launch of any pass holding one of its
steps raise (a bug in building the pass); one whose prompt starts with SYNC_FAULT makes reading
the picks of such a pass raise, where a CUDA device error surfaces (the first wait on the pass);
one whose prompt starts with ADMIT_FAULT makes its admission raise a KeyError (a bug in checking
a field, not a ValueError refusal); the first launch of a pass holding a step of one whose prompt
starts with STALL_FAULT holds the engine thread for STALL_S (a hung device), while the I/O thread
answers Pings.
Nothing else differs from `cde worker`: real engine, real ZeroMQ server, real process.
"""

import sys
import time

from cde.worker.engine import Engine
from cde.worker.model_runner import ModelRunner

LAUNCH_FAULT, SYNC_FAULT, ADMIT_FAULT, STALL_FAULT = 99_991, 99_992, 99_993, 99_994
STALL_S = 10.0


# The runner sees plans, not prompts: the slots whose request's prompt starts with a fault token,
# noted when the request takes its slot.
_marked: dict[int, int] = {}
_stalled: list[bool] = []  # once per process


def _faulty(plan, token: int) -> bool:
    return any(it.is_step and _marked.get(it.slot) == token for it in plan.items)


def _plant() -> None:
    start, launch, picks, add = ModelRunner.start, ModelRunner.launch, ModelRunner.picks, Engine.add_request

    def marking_start(self, new):
        _marked[new.slot] = new.prompt_ids[0] if new.prompt_ids else None
        return start(self, new)

    def failing_launch(self, plan, after=None):
        if _faulty(plan, LAUNCH_FAULT):
            raise RuntimeError("planted fault while launching a pass")
        if _faulty(plan, STALL_FAULT) and not _stalled:
            _stalled.append(True)
            time.sleep(STALL_S)
        return launch(self, plan, after)

    def failing_picks(self, p):
        if _faulty(p.plan, SYNC_FAULT):
            raise RuntimeError("planted fault while reading a pass's picks")
        return picks(self, p)

    def failing_add(self, req):
        if req.prompt_ids[:1] == [ADMIT_FAULT]:
            raise KeyError("planted fault while checking a request")
        return add(self, req)

    ModelRunner.start, ModelRunner.launch, ModelRunner.picks = marking_start, failing_launch, failing_picks
    Engine.add_request = failing_add


if __name__ == "__main__":
    from cde.cli import main

    _plant()
    args = sys.argv[1:]
    sys.exit(main(args if args[:1] == ["generate"] else ["worker", *args]))
