"""Engine behaviour: independent per-request progress, batch invariance, stops, instruct EOT."""

import random

import pytest
from cde.shared.config import EOT_ID, PAGE
from cde.shared.protocol import AttributionSpec, BlockResult, GenerateRequest, InputAttributionSpec
from cde.worker.engine import Engine, EngineArgs

PROMPT_LENS = [1, 17, 64, 70, 127, 128, 150, 200]
MAX_TOKENS = [40, 5, 70, 20, 66, 1, 30, 12]


def _requests(sampled: bool) -> list[GenerateRequest]:
    rng = random.Random(0)
    reqs = []
    for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS)):
        reqs.append(
            GenerateRequest(
                f"r{i}",
                [rng.randrange(100000) for _ in range(n)],
                max_tokens=m,
                temperature=0.9 if sampled else 0.0,
                top_p=0.9,
                seed=i,
                tokens_per_step=2 + i % 3,
                repetition_penalty=1.0 + 0.1 * (i % 2),
            )
        )
    return reqs


def _clone(r: GenerateRequest) -> GenerateRequest:
    return GenerateRequest(**{**r.__dict__, "prompt_ids": list(r.prompt_ids)})


@pytest.mark.parametrize("sampled", [False, True])
def test_batch_invariance_with_staggered_arrivals(tiny_dir, sampled):
    reqs = _requests(sampled)
    alone = {}
    for r in reqs:
        e = Engine(EngineArgs(str(tiny_dir), max_running=1))
        alone.update(e.generate([_clone(r)]))
    engine = Engine(EngineArgs(str(tiny_dir), max_running=8))
    together = {r.request_id: [] for r in reqs}
    pending = [_clone(r) for r in reqs]
    step = 0
    while pending or engine.has_work():
        if pending and step % 3 == 0:  # a new request joins every third step
            engine.add_request(pending.pop(0))
        for res in engine.step():
            together[res.request_id].extend(res.token_ids)
        step += 1
    assert together == alone
    for r in reqs:
        assert len(alone[r.request_id]) == r.max_tokens
    assert engine.stats().pages_used == 0 and engine.stats().running == 0


def test_requests_progress_independently(tiny_dir):
    """A short request finishes while a long one keeps going; nobody waits at a block barrier."""
    engine = Engine(EngineArgs(str(tiny_dir)))
    engine.add_request(GenerateRequest("long", [5] * 64, max_tokens=256, tokens_per_step=4))
    engine.add_request(GenerateRequest("short", [6] * 10, max_tokens=20, tokens_per_step=4))
    finished_at = {}
    step = 0
    while engine.has_work():
        step += 1
        for res in engine.step():
            if res.finished:
                finished_at[res.request_id] = step
    # short: 20 eligible positions in its first block at 4 per step -> 5 steps
    assert finished_at["short"] == 5
    # long: 4 blocks x 16 steps each, commits fused into the next block's first step
    assert finished_at["long"] == 4 * PAGE // 4


def test_stop_token_ids_and_stop_strings(tiny_dir):
    engine = Engine(EngineArgs(str(tiny_dir)))
    prompt = [11, 12, 13]
    base = engine.generate([GenerateRequest("a", prompt, max_tokens=128)])["a"]
    stop_tok = base[70]
    first = base.index(stop_tok)
    out = engine.generate([GenerateRequest("b", prompt, max_tokens=128, stop_token_ids=[stop_tok])])["b"]
    assert out == base[:first]
    text = engine.tokenizer.decode(base)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    res = []
    engine.add_request(GenerateRequest("c", prompt, max_tokens=128, stop=[stop]))
    while engine.has_work():
        res += engine.step()
    assert res[-1].finish_reason == "stop" and res[-1].stop_str == stop
    got = [t for r in res for t in r.token_ids]
    assert stop in engine.tokenizer.decode(got) and stop not in engine.tokenizer.decode(got[:-1])
    assert engine.stats().pages_used == 0


@pytest.mark.reference
def test_instruct_eot_ends_the_request_like_the_reference(tiny_instruct_dir, tmp_path):
    """Make <|eot_id|> the greedy choice mid-block (its output row copies a token the model picks
    there, slightly scaled), then compare with the official generator's EOT handling."""
    import torch
    from cde.worker.checkpoint import load_checkpoint, save_checkpoint

    from tests.oracle import official_generator

    prompt = list(range(1000, 1064))
    base = Engine(EngineArgs(str(tiny_instruct_dir))).generate([GenerateRequest("b", prompt, max_tokens=128)])["b"]
    cfg, model = load_checkpoint(tiny_instruct_dir)
    with torch.no_grad():
        w = model.transformer.lm_head.weight
        w[EOT_ID] = w[base[80]] * 1.05
    save_checkpoint(model, cfg, tmp_path)
    engine = Engine(EngineArgs(str(tmp_path)))
    res = []
    engine.add_request(GenerateRequest("e", prompt, max_tokens=128))
    while engine.has_work():
        res += engine.step()
    ours = [t for r in res for t in r.token_ids]
    assert res[-1].finish_reason == "stop" and len(ours) < 128 and EOT_ID not in ours
    from steerling.configs.generation import GenerationConfig

    ref = official_generator(tmp_path).generate_full(
        torch.tensor([prompt]),
        GenerationConfig(
            max_new_tokens=128, steps=128, temperature=0, use_entropy_sampling=False, top_p=0, repetition_penalty=1
        ),
    )
    gen = ref.tokens[len(prompt) :].tolist()
    expected = []
    for t in gen:  # the reference's own extraction: skip masks/EOS, stop at EOT
        if t == EOT_ID:
            break
        if t not in (engine.tokenizer.mask_id, engine.tokenizer.eos_id):
            expected.append(t)
    assert EOT_ID in gen and ours == expected


def test_bad_requests_are_rejected(tiny_dir):
    engine = Engine(EngineArgs(str(tiny_dir)))
    with pytest.raises(ValueError, match="context"):
        engine.add_request(GenerateRequest("x", [1] * 1000, max_tokens=100))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request(GenerateRequest("y", [10**6], max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(GenerateRequest("z", [1], max_tokens=0))
    assert not engine.has_work()


def test_waiting_requests_queue_when_pages_run_out(tiny_dir):
    engine = Engine(EngineArgs(str(tiny_dir), num_pages=3, max_running=4))
    for i in range(3):
        engine.add_request(GenerateRequest(f"q{i}", [1] * 10, max_tokens=100))  # 2 pages each
    engine.step()
    st = engine.stats()
    assert st.running == 1 and st.waiting == 2 and st.pages_used == 2
    done = set()
    while engine.has_work():
        done |= {r.request_id for r in engine.step() if r.finished}
    assert done == {"q0", "q1", "q2"} and engine.stats().pages_free == 3


def test_startup_freezes_what_it_leaves_behind(tiny_dir):
    """The weights, modules and compiled code alive after startup are moved out of the garbage
    collector's reach, so no full collection re-scans them in the middle of a step."""
    import gc

    gc.unfreeze()
    engine = Engine(EngineArgs(str(tiny_dir)))
    assert gc.get_freeze_count() > 10_000
    assert engine.generate([GenerateRequest("g", [5] * 64, max_tokens=8)])["g"]


def test_abort_while_its_next_pass_is_in_flight(tiny_dir):
    """step() launches the next pass before it returns, so an abort between two steps lands on a
    request whose step is already running: the request sends nothing more, its pages come back,
    and the other request's tokens and attribution records are those it gets alone."""

    def requests():
        return [
            GenerateRequest(rid, [40 + k] * 30, max_tokens=150, tokens_per_step=2, attribution=AttributionSpec())
            for k, rid in enumerate(("keep", "drop"))
        ]

    alone = Engine(EngineArgs(str(tiny_dir)))
    alone.add_request(requests()[0])
    expected = []
    while alone.has_work():
        expected += alone.step()
    engine = Engine(EngineArgs(str(tiny_dir)))
    for r in requests():
        engine.add_request(r)
    got, aborted = [], False
    while engine.has_work():
        results = engine.step()
        got += [r for r in results if r.request_id == "keep"]
        if aborted:
            assert all(r.request_id == "keep" for r in results)
        elif any(r.request_id == "drop" for r in results):  # its first block is out, its next step in flight
            assert engine.abort("drop")
            aborted = True
    assert aborted
    assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in expected]
    for ours, ref in zip(got, expected):  # the LM head's rounding varies with the batch: values to 1e-5
        assert [_ids(r) for r in ours.attribution] == [_ids(r) for r in ref.attribution]
        for a, b in zip(ours.attribution, ref.attribution):
            assert _values(a) == pytest.approx(_values(b), rel=1e-5, abs=1e-6)
    assert engine.stats().pages_used == 0 and engine.stats().running == 0


def _ids(record: dict) -> tuple:
    return (
        record["token_id"],
        record["position"],
        record["step"],
        [[c[0] for c in record[h]] for h in ("known", "discovered")],
    )


def _values(record: dict) -> list[float]:
    return [record["target_logit"], record["epsilon"]] + [
        x for h in ("known", "discovered") for c in record[h] for x in c[1:]
    ]


def test_an_id_is_refused_until_its_last_result_is_out(tiny_dir):
    """Waiting, running, and ended but for its input attribution (its final block held back):
    a second request under its id is refused alone, and the first gets its one end."""
    engine = Engine(EngineArgs(str(tiny_dir), max_running=1))
    prompt = [(7919 * i) % 100000 for i in range(64)]
    spec = AttributionSpec(inputs=InputAttributionSpec(top_k=5, steps=8))
    engine.add_request(GenerateRequest("a", prompt, max_tokens=64, attribution=spec))
    engine.add_request(GenerateRequest("w", [1, 2], max_tokens=8))
    refused, ends = set(), []
    while engine.has_work():
        for rid in ("a", "w"):
            held = engine.scheduler.in_flight(rid) or engine.outputs.holds(rid)
            if held and rid not in {r.request_id for r in ends}:
                with pytest.raises(ValueError, match=f"request id '{rid}' is already in flight"):
                    engine.add_request(GenerateRequest(rid, [5, 6, 7], max_tokens=8))
                if not engine.scheduler.in_flight(rid):
                    refused.add(rid)  # only its results were held
        ends += [r for r in engine.step() if isinstance(r, BlockResult) and r.finished]
    assert "a" in refused  # the gap that matters was seen
    assert sorted((r.request_id, r.finish_reason) for r in ends) == [("a", "length"), ("w", "length")]
    assert ends[[r.request_id for r in ends].index("a")].input_attribution is not None
