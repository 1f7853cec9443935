"""Async scheduling (worker/plan_ahead.py): a pass planned before the picks of the one in flight
is the pass planned after them, and the engine's results are the same either way."""

import random

import pytest
from cde.shared.config import EOT_ID, MASK_ID, PAGE
from cde.shared.grammar import json_schema_grammar
from cde.shared.protocol import AttributionSpec, FlashBlockSpec, GenerateRequest, SteeringSpec
from cde.worker.engine import Engine, EngineArgs
from cde.worker.logprobs import LogprobsRunner
from cde.worker.model_runner import ModelRunner
from cde.worker.plan import Picks
from cde.worker.plan_ahead import plan_ahead
from cde.worker.scheduler import Scheduler

from tests.worker.test_engine import _ids, _values

# r4 (prompt 127, one token a step, streamed steps, logprobs, attribution) generates its first
# block's one token, whole blocks, then one token of a last block: two whole blocks by default
# (tests/gpu), one in the CPU tests, where r4 set the number of passes (130 -> 66 without stagger)
# and had 44% of the logit rows.
CPU_R4_TOKENS = 66


def _mixed(n: int = 8, r4_tokens: int = 130) -> list[GenerateRequest]:
    """Every per-request feature that plans ahead, at block edges, mid-block ends and 64 tokens a step."""
    rng = random.Random(0)
    prompts = [1, 17, 64, 70, 127, 128, 150, 200, 33, 90]
    lengths = [40, 5, 70, 20, r4_tokens, 1, 140, 12, 64, 100]
    return [
        GenerateRequest(
            f"r{i}",
            [rng.randrange(1000, 100000) for _ in range(prompts[i])],
            max_tokens=lengths[i],
            temperature=0.9 if i % 2 else 0.0,
            top_p=0.9,
            seed=i,
            tokens_per_step=(1, 2, 3, 64)[i % 4],
            repetition_penalty=1.2 if i % 3 == 1 else 1.0,
            frequency_penalty=0.3 if i % 3 == 0 else 0.0,
            presence_penalty=0.2 if i == 6 else 0.0,
            logit_bias={500: 2.0} if i == 2 else {},
            steering=SteeringSpec(concepts=[3, 5], inject_layer=1, cutoff_tokens=20) if i in (0, 5, 9) else None,
            attribution=AttributionSpec() if i % 3 else None,
            stream_denoise=i in (4, 7),
            stream_tokens=i in (1, 8),
            logprobs=2 if i in (3, 4) else None,
            stop_token_ids=[777] if i == 9 else [],
        )
        for i in range(n)
    ]


def _run(model, requests, ahead: bool, stagger: int = 0, abort: str | None = None, **args) -> tuple[list, Engine]:
    """Every result of the requests, in order; `stagger`: a request joins every that many steps
    (0: all at once); `abort`: that request is aborted once its first result is out."""
    engine = Engine(EngineArgs(str(model), async_scheduling=ahead, **args))
    pending, results, step = list(requests), [], 0
    if not stagger:
        for r in pending:
            engine.add_request(r)
        pending = []
    while pending or engine.has_work():
        if pending and step % stagger == 0:
            engine.add_request(pending.pop(0))
        out = engine.step()
        results += out
        if abort is not None and any(r.request_id == abort for r in out):
            assert engine.abort(abort)
            abort = None
        step += 1
        assert step < 2000, "the requests never end"
    assert engine.stats().pages_used == 0 and engine.stats().running == 0
    return results, engine


def _same(ours: list, ref: list, rel: float = 1e-5) -> None:
    def key(r):
        lp = getattr(r, "logprobs", None)
        return (
            type(r).__name__,
            r.request_id,
            r.token_ids,
            getattr(r, "positions", None),
            getattr(r, "finish_reason", None),
            getattr(r, "stop_str", None),
            None if lp is None else lp.top_ids,
        )

    # Per request: a waiting request may be admitted a pass later ahead (a slot that EOT frees is
    # seen after the next pass is launched), so results of different requests may interleave otherwise.
    ours, ref = (sorted(rs, key=lambda r: r.request_id) for rs in (ours, ref))
    assert [key(r) for r in ours] == [key(r) for r in ref]
    for a, b in zip(ours, ref):
        attribution = getattr(a, "attribution", None)
        assert (attribution is None) == (getattr(b, "attribution", None) is None)
        if attribution is not None:  # the LM head's rows differ (ahead: picked rows too): values to 1e-5
            assert [_ids(r) for r in attribution] == [_ids(r) for r in b.attribution]
            for x, y in zip(attribution, b.attribution):
                assert _values(x) == pytest.approx(_values(y), rel=rel, abs=rel / 10)
        if getattr(a, "logprobs", None) is not None:
            assert a.logprobs.logprobs == pytest.approx(b.logprobs.logprobs, rel=rel, abs=rel / 10)


@pytest.mark.parametrize("stagger", [0, 3])
def test_results_match_planning_after_the_picks(tiny_dir, stagger):
    reqs = _mixed(10, CPU_R4_TOKENS)
    ref, sync = _run(tiny_dir, _mixed(10, CPU_R4_TOKENS), ahead=False, stagger=stagger, max_running=8)
    ours, engine = _run(tiny_dir, _mixed(10, CPU_R4_TOKENS), ahead=True, stagger=stagger, max_running=8)
    _same(ours, ref)
    assert sync.passes_planned_ahead == 0
    assert engine.forward_passes == sync.forward_passes
    assert engine.passes_planned_ahead > engine.forward_passes // 2  # nothing vacuous: most passes went ahead
    for r in reqs:  # and the run was a real one: every request produced its tokens
        assert sum(len(x.token_ids) for x in ours if x.request_id == r.request_id and hasattr(x, "finished")) > 0


def test_stop_strings_eot_and_aborts_while_a_pass_is_ahead(tiny_instruct_dir):
    """Requests that the picks end (EOT, a stop string, an abort): their items of the pass already
    planned ahead are dropped, and the others go on as they would."""

    def requests():
        reqs = _mixed(6, CPU_R4_TOKENS)
        reqs[1].logit_bias = {EOT_ID: 30.0}  # ends at its first step, its next pass in flight
        reqs[2].stop = ["e"]
        reqs[3].max_tokens = 200
        return reqs

    ref, _ = _run(tiny_instruct_dir, requests(), ahead=False, abort="r3")
    ours, engine = _run(tiny_instruct_dir, requests(), ahead=True, abort="r3")
    _same(ours, ref)
    assert engine.passes_planned_ahead > 0
    ends = {r.request_id: r.finish_reason for r in ours if getattr(r, "finished", False)}
    assert ends["r1"] == "stop" and "r3" not in ends


@pytest.mark.parametrize(
    "feature",
    [
        {"confidence_threshold": 0.99},
        {"min_tokens": 4},
        {"flashblock": FlashBlockSpec(tau=2, max_reuse=4)},
        {"grammar": json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}})},
    ],
    ids=["threshold", "min_tokens", "flashblock", "grammar"],
)
def test_requests_that_need_the_picks_plan_after_them(tiny_dir, feature):
    """A pass holding such a request is planned after the picks; the others' passes go ahead."""

    def requests():
        reqs = _mixed(4)
        reqs[0].__dict__.update(feature, max_tokens=6, stream_denoise=True)  # a StepResult per pass it is in
        return reqs

    ref, _ = _run(tiny_dir, requests(), ahead=False)
    ours, engine = _run(tiny_dir, requests(), ahead=True)
    _same(ours, ref)
    # no pass holding r0 went ahead; once it is done the others' passes do
    r0_passes = sum(type(r).__name__ == "StepResult" and r.request_id == "r0" for r in ours)
    assert r0_passes > 0
    assert 0 < engine.passes_planned_ahead <= engine.forward_passes - r0_passes


def _fake_picks(plan, rng: random.Random) -> list[Picks]:
    """What a pass could pick: tokens_per_step eligible positions per step item, random tokens (no EOT)."""
    out = []
    for it in plan.step_items:
        free = [p for p, ok in enumerate(it.eligible) if ok]
        chosen = rng.sample(free, min(it.request.tokens_per_step, len(free)))
        out.append(Picks(chosen, [rng.randrange(1000, 2000) for _ in chosen]))
    return out


def test_the_plan_ahead_is_the_plan_after_the_picks():
    """Driven alone (no device): the plan made ahead, its carried items completed with the picks,
    is the plan `schedule()` makes after placing them."""
    s = Scheduler(num_pages=64, max_running=4, max_items=16, eot_id=None)
    rng = random.Random(1)
    for i, (n, m, k) in enumerate([(10, 70, 1), (64, 64, 4), (100, 200, 64), (3, 40, 7)]):
        s.add(GenerateRequest(f"q{i}", [5] * n, max_tokens=m, tokens_per_step=k))
    current, compared = s.schedule(), 0
    while current.items:
        ahead = plan_ahead(s, current)
        picks = _fake_picks(current, rng)
        s.place(current, picks)
        after = s.schedule()
        if ahead is not None:
            assert _completed(ahead, current, picks) == [it._replace(carry=-1) for it in after.items]
            compared += 1
        current = after
    assert compared > 20


def _completed(ahead, current, picks) -> list:
    """The plan's items with what the device fills in from the picks: tokens, and (steps) eligibility."""
    out = []
    for it in ahead.items:
        if it.carry >= 0:
            tokens, eligible = list(it.tokens), list(it.eligible)
            for p, t in zip(picks[it.carry].positions, picks[it.carry].tokens):
                tokens[p] = t
                if eligible:
                    eligible[p] = False
            assert current.step_items[it.carry].slot == it.slot
            # a step counts the picks it carries (its selection packs the positions left)
            assert it.carried_picks == (len(picks[it.carry].positions) if it.is_step else 0)
            it = it._replace(tokens=tuple(tokens), eligible=tuple(eligible), carry=-1, carried_picks=0)
        assert MASK_ID in it.tokens or not it.is_step
        out.append(it)
    return out


def test_a_block_completed_ahead_keeps_its_attribution_rows(tiny_dir):
    """64 tokens a step: every pass completes a block and the pass ahead writes the next block's
    picks before the completed block's rows are gathered (worker/block_attribution.py's two sets)."""

    def requests():
        return [
            GenerateRequest(
                f"b{i}", [9 + i] * (20 + 50 * i), max_tokens=4 * PAGE, tokens_per_step=64, attribution=AttributionSpec()
            )
            for i in range(3)
        ]

    ref, _ = _run(tiny_dir, requests(), ahead=False)
    ours, engine = _run(tiny_dir, requests(), ahead=True)
    _same(ours, ref)
    assert engine.passes_planned_ahead >= engine.forward_passes - 2


def test_a_pass_ahead_that_fails_to_launch_is_planned_again_after_the_picks(tiny_dir, monkeypatch):
    """A planted fault in the launches planned ahead that hold a fifth step: each is dropped, the
    pass planned again after the picks launches, and every request gets what it gets without it."""
    ref, _ = _run(tiny_dir, _mixed(4), ahead=False)
    launch, planted = ModelRunner.launch, []

    def failing_ahead(self, plan, after=None):
        if after is not None and any(it.step == 5 for it in plan.step_items):
            planted.append(plan)
            raise RuntimeError("planted fault in a pass planned ahead")
        return launch(self, plan, after)

    monkeypatch.setattr(ModelRunner, "launch", failing_ahead)
    ours, engine = _run(tiny_dir, _mixed(4), ahead=True)
    _same(ours, ref)
    assert planted and engine.passes_planned_ahead > 0
    # The first pass and each one dropped (once, or twice when it was planned ahead of the pass in
    # flight too, at a step that completed attributed blocks) went after the picks.
    assert engine.passes_planned_ahead == engine.forward_passes - 1 - len(set(planted))


def test_a_pass_ahead_that_fails_after_sampling_counts_no_pick_twice(tiny_dir, monkeypatch):
    """Planted in the logprobs of the first launch planned ahead at a fifth step (after the picks
    were sampled): the pass planned again counts its picks once, so the frequency penalty leaves
    the tokens as they are without the fault."""
    request = GenerateRequest(
        "a", list(range(1000, 1010)), max_tokens=60, tokens_per_step=2, frequency_penalty=1.5, logprobs=0
    )
    ref, _ = _run(tiny_dir, [request], ahead=True)
    launch, logprobs_launch = ModelRunner.launch, LogprobsRunner.launch
    ahead_at_5, planted = [], []

    def noting_launch(self, plan, after=None):
        ahead_at_5[:] = [after is not None and any(it.step == 5 for it in plan.step_items)]
        return launch(self, plan, after)

    def failing_logprobs(self, *args):
        if ahead_at_5[0] and not planted:
            planted.append(True)
            raise RuntimeError("planted fault after the picks were sampled")
        return logprobs_launch(self, *args)

    monkeypatch.setattr(ModelRunner, "launch", noting_launch)
    monkeypatch.setattr(LogprobsRunner, "launch", failing_logprobs)
    ours, _ = _run(tiny_dir, [request], ahead=True)
    assert planted
    _same(ours, ref)


def test_the_pass_after_next_is_queued_while_completed_blocks_are_attributed(tiny_dir, monkeypatch):
    """When blocks complete with attribution, the output stage waits for it (on CUDA it runs beside
    the pass in flight) and packs it; the pass after the next one is launched before that, so the
    device has two passes queued through the wait. The results stay those of planning after the picks."""

    def requests():
        return [
            GenerateRequest(
                f"a{i}", [9 + i] * PAGE, max_tokens=3 * PAGE, tokens_per_step=8, attribution=AttributionSpec()
            )
            for i in range(3)
        ]

    ref, _ = _run(tiny_dir, requests(), ahead=False)
    launch, picks, block_records = ModelRunner.launch, ModelRunner.picks, ModelRunner.block_records
    count = {"launched": 0, "read": 0}
    queued_at_wait = []

    def counted_launch(self, plan, after=None):
        p = launch(self, plan, after)
        count["launched"] += 1
        return p

    def counted_picks(self, p):
        count["read"] += 1
        return picks(self, p)

    def waited(self, rows, blocks):
        queued_at_wait.append(count["launched"] - count["read"])
        return block_records(self, rows, blocks)

    monkeypatch.setattr(ModelRunner, "launch", counted_launch)
    monkeypatch.setattr(ModelRunner, "picks", counted_picks)
    monkeypatch.setattr(ModelRunner, "block_records", waited)
    ours, _ = _run(tiny_dir, requests(), ahead=True)
    _same(ours, ref)
    # Three blocks in step: the first two ends have the next block's first passes queued; the last
    # ends the requests, with nothing after it.
    assert queued_at_wait == [2, 2, 0]
