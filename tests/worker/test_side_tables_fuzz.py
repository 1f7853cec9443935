"""State keyed by request never outlives the request: a fuzz of the engine (tiny model) with
requests that use every per-request feature, arriving and being aborted at random, checks after
every step that each side table holds only live requests:
- the output stage's attribution of active blocks: running requests only;
- input-attribution jobs: waiting or running requests, or finished ones whose results still wait
  for their IG;
- steering state: a running request's slot has it exactly when the request steers;
- nothing of an aborted request anywhere.
At the end every table is empty and every page free."""

import random

from cde.shared.config import PAGE
from cde.shared.protocol import (
    AttributionSpec,
    FlashBlockSpec,
    GenerateRequest,
    InputAttributionSpec,
    SteeringSpec,
)
from cde.worker.engine import Engine, EngineArgs


def random_request(rng: random.Random, i: int) -> GenerateRequest:
    attribution = None
    if rng.random() < 0.6:
        inputs = InputAttributionSpec(top_k=2, steps=1) if rng.random() < 0.3 else None
        attribution = AttributionSpec(top_k=2, inputs=inputs)
    steering = None
    if rng.random() < 0.4:
        steering = SteeringSpec(
            [rng.randrange(96)], strength=rng.uniform(-8, 8), inject_layer=1, relu_logit_mask={1: 2.0}
        )
    return GenerateRequest(
        f"r{i}",
        [rng.randrange(100000) for _ in range(rng.randint(1, 2 * PAGE))],
        max_tokens=rng.randint(1, PAGE + 16),
        temperature=rng.choice([0.0, 0.8]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 40]),
        entropy_sampling=rng.random() < 0.2,
        confidence_threshold=rng.choice([None, 0.5]),
        seed=i,
        tokens_per_step=rng.choice([8, 16, 32]),
        repetition_penalty=rng.choice([1.0, 1.3]),
        stop_token_ids=[rng.randrange(100000)] if rng.random() < 0.2 else [],
        stop=["e"] if rng.random() < 0.2 else [],
        steering=steering,
        attribution=attribution,
        flashblock=FlashBlockSpec(tau=2, max_reuse=4) if rng.random() < 0.3 else None,
        stream_denoise=rng.random() < 0.2,
    )


def check_side_tables(engine: Engine, aborted: set[str]) -> None:
    s, outputs, inputs = engine.scheduler, engine.outputs, engine.outputs.input_attribution
    running = {seq.id: seq for seq in s.running}
    waiting = {seq.id for seq in s.waiting}
    assert set(outputs.block_attribution) <= set(running), "attribution of a request that is not running"
    for rid, job in inputs.requests.items():
        assert rid in running or rid in waiting or job.queue, f"input-attribution job of {rid} with nothing to do"
    for seq in running.values():
        assert (seq.slot in engine.runner.steering) == (seq.req.steering is not None), seq.id
    left = aborted & (set(outputs.block_attribution) | set(inputs.requests) | set(running) | waiting)
    assert not left, f"aborted requests still held: {left}"


def test_side_tables_hold_only_live_requests(tiny_dir):
    rng = random.Random(0)
    engine = Engine(EngineArgs(str(tiny_dir), max_running=3, num_pages=8))
    pending = [random_request(rng, i) for i in range(14)]
    aborted: set[str] = set()
    held_attribution_when_aborted = 0
    while pending or engine.has_work():
        if pending and rng.random() < 0.5:
            engine.add_request(pending.pop(0))
        live = [seq.id for seq in engine.scheduler.running + list(engine.scheduler.waiting)]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            held_attribution_when_aborted += victim in engine.outputs.block_attribution
            engine.abort(victim)
            aborted.add(victim)
        engine.step()
        check_side_tables(engine, aborted)
    assert held_attribution_when_aborted > 0  # the fuzz aborted a request in the middle of a block
    assert not engine.outputs.block_attribution and not engine.outputs.input_attribution.requests
    assert engine.stats().pages_used == 0
