"""One request that makes its pass fail fails alone (worker/isolation.py), in the engine: with a
planted fault in the launch of any pass holding its step (tests/faulty_worker.py's fault), the
requests decoding beside it finish with the official generator's tokens, and the faulty one ends
with an error. The same path through real processes: test_worker_step_failure.py."""

import pytest
import torch
from cde.shared.protocol import BlockResult, GenerateRequest
from cde.worker.engine import REQUEST_FAILED, Engine, EngineArgs
from cde.worker.logprobs import LogprobsRunner
from cde.worker.model_runner import ModelRunner
from cde.worker.outputs import OutputStage

from tests.faulty_worker import LAUNCH_FAULT

N_NEW, PER_STEP = 64, 8
PROMPT = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def official_tokens(tiny_dir) -> list[int]:
    from tests.oracle import greedy_config, official_generator

    cfg = greedy_config(N_NEW, PER_STEP)
    return official_generator(tiny_dir).generate_full(torch.tensor([PROMPT]), cfg).tokens[len(PROMPT) :].tolist()


def _tokens_and_ends(engine: Engine) -> tuple[dict[str, list[int]], dict[str, list[BlockResult]]]:
    """Every request's tokens and its finished results (one each, when all is well), run to the end."""
    tokens: dict[str, list[int]] = {}
    ends: dict[str, list[BlockResult]] = {}
    while engine.has_work():
        for res in engine.step():
            if isinstance(res, BlockResult):
                tokens.setdefault(res.request_id, []).extend(res.token_ids)
                if res.finished:
                    ends.setdefault(res.request_id, []).append(res)
    return tokens, ends


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
    tokens, ends = _tokens_and_ends(engine)
    assert [(r.finish_reason, r.error) for r in ends["faulty"]] == [("error", REQUEST_FAILED)]
    assert tokens["a"] == tokens["b"] == official_tokens
    assert [r.finish_reason for r in ends["a"] + ends["b"]] == ["length", "length"]
    assert engine.stats().pages_used == 0


def _penalized() -> GenerateRequest:
    return GenerateRequest(
        "a", PROMPT[:10], max_tokens=60, tokens_per_step=2, frequency_penalty=1.5, presence_penalty=1.0, seed=0
    )


def test_a_pass_that_fails_late_counts_no_pick_twice(tiny_dir, monkeypatch):
    """A launch that raises after sampling (here in its logprobs, for b's third step) and the
    probes that find b: a's frequency and presence penalties count each of its picks once, so a
    decodes as it does alone."""
    alone = Engine(EngineArgs(str(tiny_dir), max_running=2))
    alone.add_request(_penalized())
    expected, _ = _tokens_and_ends(alone)
    launch, logprobs_launch = ModelRunner.launch, LogprobsRunner.launch
    holds_b_step_3 = []

    def noting_launch(self, plan, after=None):
        holds_b_step_3[:] = [any(it.request.request_id == "b" and it.step == 3 for it in plan.step_items)]
        return launch(self, plan, after)

    def failing_logprobs(self, *args):
        if holds_b_step_3[0]:
            raise RuntimeError("planted fault after the picks were sampled")
        return logprobs_launch(self, *args)

    monkeypatch.setattr(ModelRunner, "launch", noting_launch)
    monkeypatch.setattr(LogprobsRunner, "launch", failing_logprobs)
    engine = Engine(EngineArgs(str(tiny_dir), max_running=2))
    engine.add_request(_penalized())
    engine.add_request(GenerateRequest("b", PROMPT[:12], max_tokens=60, logprobs=1))
    tokens, ends = _tokens_and_ends(engine)
    assert [r.finish_reason for r in ends["b"]] == ["error"]
    assert tokens["a"] == expected["a"]


def test_a_request_ended_by_its_block_is_not_failed_after_its_end(tiny_dir, monkeypatch):
    """Its block held a stop string, found once the next pass was launched; that launch failed for
    it alone: one end, the stop's."""
    probe = Engine(EngineArgs(str(tiny_dir), max_running=1))
    probe.add_request(GenerateRequest("s", PROMPT[:10], max_tokens=120, tokens_per_step=8))
    first, _ = _tokens_and_ends(probe)
    text = probe.tokenizer.decode(first["s"][:64])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    launch = ModelRunner.launch

    def failing_launch(self, plan, after=None):
        if any(it.request.request_id == "s" and it.block == 1 for it in plan.step_items):
            raise RuntimeError("planted fault in s's second block")
        return launch(self, plan, after)

    monkeypatch.setattr(ModelRunner, "launch", failing_launch)
    engine = Engine(EngineArgs(str(tiny_dir), max_running=2))
    engine.add_request(GenerateRequest("s", PROMPT[:10], max_tokens=120, tokens_per_step=8, stop=[stop]))
    engine.add_request(GenerateRequest("t", PROMPT[:20], max_tokens=120, tokens_per_step=8))
    _, ends = _tokens_and_ends(engine)
    assert [r.finish_reason for r in ends["s"]] == ["stop"]
    assert [r.finish_reason for r in ends["t"]] == ["length"]


def test_a_request_refused_while_it_queues_leaves_nothing_queued(tiny_dir, monkeypatch):
    """Its output stage failed to take it (say, out of memory): the client heard an error, so the
    engine keeps nothing of it, and the same id sent again runs as any other."""
    track = OutputStage.track

    def failing_track(self, seq):
        raise RuntimeError("planted fault while the request queues")

    engine = Engine(EngineArgs(str(tiny_dir), max_running=2))
    monkeypatch.setattr(OutputStage, "track", failing_track)
    with pytest.raises(RuntimeError, match="planted fault"):
        engine.add_request(GenerateRequest("a", PROMPT[:10], max_tokens=70))
    assert not engine.has_work()
    monkeypatch.setattr(OutputStage, "track", track)
    for rid in ("a", "b"):
        engine.add_request(GenerateRequest(rid, PROMPT[:10], max_tokens=70))
    tokens, ends = _tokens_and_ends(engine)
    assert {rid: [r.finish_reason for r in e] for rid, e in ends.items()} == {"a": ["length"], "b": ["length"]}
    assert tokens["a"] == tokens["b"] and engine.stats().pages_used == 0


def test_a_step_that_raises_leaves_no_error_due_later(tiny_dir, monkeypatch):
    """A step failed b alone, then raised (the worker then fails every request in flight): a new
    request under b's id gets none of the old one's results."""
    launch, finish = ModelRunner.launch, OutputStage.finish
    planted = []

    def failing_launch(self, plan, after=None):
        if not planted and any(it.request.request_id == "b" and it.step == 2 for it in plan.step_items):
            raise RuntimeError("planted fault for b alone")
        return launch(self, plan, after)

    def failing_finish(self, placed, records):
        if not planted and engine._failed:
            planted.append(True)
            raise RuntimeError("planted fault in the same step")
        return finish(self, placed, records)

    monkeypatch.setattr(ModelRunner, "launch", failing_launch)
    monkeypatch.setattr(OutputStage, "finish", failing_finish)
    engine = Engine(EngineArgs(str(tiny_dir), max_running=2))
    for rid in ("a", "b"):
        engine.add_request(GenerateRequest(rid, PROMPT[:10], max_tokens=60))
    with pytest.raises(RuntimeError, match="in the same step"):
        for _ in range(20):
            engine.step()
    assert engine.abort("a") and not engine.abort("b")  # as the worker fails what is in flight
    engine.add_request(GenerateRequest("b", PROMPT[:12], max_tokens=60))
    _, ends = _tokens_and_ends(engine)
    assert {rid: [r.finish_reason for r in e] for rid, e in ends.items()} == {"b": ["length"]}
