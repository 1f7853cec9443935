"""One request that makes its pass fail fails alone (worker/isolation.py), in the engine: with a
planted fault in the launch of any pass holding its step (tests/faulty_worker.py's fault), the
requests decoding beside it finish with the official generator's tokens, and the faulty one ends
with an error. The same path through real processes: test_worker_step_failure.py."""

import pytest
import torch
from cde.shared.protocol import BlockResult, GenerateRequest
from cde.worker.engine import REQUEST_FAILED, Engine, EngineArgs
from cde.worker.model_runner import ModelRunner

from tests.faulty_worker import LAUNCH_FAULT

N_NEW, PER_STEP = 64, 8
PROMPT = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def official_tokens(tiny_dir) -> list[int]:
    from tests.oracle import greedy_config, official_generator

    cfg = greedy_config(N_NEW, PER_STEP)
    return official_generator(tiny_dir).generate_full(torch.tensor([PROMPT]), cfg).tokens[len(PROMPT) :].tolist()


def test_a_request_that_fails_its_pass_fails_alone(tiny_dir, official_tokens, monkeypatch):
    start, launch = ModelRunner.start, ModelRunner.launch
    marked: set[int] = set()  # the slot of the request whose prompt starts with LAUNCH_FAULT

    def marking_start(self, new):
        (marked.add if new.prompt_ids[:1] == (LAUNCH_FAULT,) else marked.discard)(new.slot)
        return start(self, new)

    def failing_launch(self, plan, after=None):  # the planted fault: any pass that holds the marked request's step
        if any(it.is_step and it.slot in marked for it in plan.items):
            raise RuntimeError("planted fault while launching a pass")
        return launch(self, plan, after)

    monkeypatch.setattr(ModelRunner, "start", marking_start)
    monkeypatch.setattr(ModelRunner, "launch", failing_launch)
    engine = Engine(EngineArgs(str(tiny_dir), max_running=4))
    for rid in ("a", "b"):
        engine.add_request(GenerateRequest(rid, PROMPT, max_tokens=N_NEW, tokens_per_step=PER_STEP))
    engine.step()  # a and b decode, then the faulty one joins them
    engine.add_request(GenerateRequest("faulty", [LAUNCH_FAULT, 1, 2], max_tokens=16))
    tokens: dict[str, list[int]] = {"a": [], "b": [], "faulty": []}
    ends: dict[str, BlockResult] = {}
    while engine.has_work():
        for res in engine.step():
            if isinstance(res, BlockResult):
                tokens[res.request_id] += res.token_ids
                if res.finished:
                    ends[res.request_id] = res
    assert (ends["faulty"].finish_reason, ends["faulty"].error) == ("error", REQUEST_FAILED)
    assert tokens["a"] == tokens["b"] == official_tokens
    assert ends["a"].finish_reason == ends["b"].finish_reason == "length"
    assert engine.stats().pages_used == 0
