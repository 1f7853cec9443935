"""Input attribution inside the engine: a completed block's result leaves with its
`input_attribution` (per token the top inputs of the IG that tests/parity/test_input_attribution.py
compares with the official attributor; per chunk the official `aggregate_chunk`, run here on the
same attributions), sliced between decoding passes so that other requests keep decoding, dropped
on abort, and nothing for requests that do not ask."""

from __future__ import annotations

import pytest
import torch
from cde.shared.config import ENDOFCHUNK_ID, MASK_ID
from cde.shared.protocol import AttributionSpec, BlockResult, GenerateRequest, InputAttributionSpec
from cde.worker.engine import Engine, EngineArgs
from cde.worker.input_attribution import attribute, build_targets

PROMPT = [(7919 * i) % 100000 for i in range(64)]


@pytest.fixture(scope="module")
def engine(tiny_dir) -> Engine:
    return Engine(EngineArgs(str(tiny_dir)))


def asking(rid: str, max_tokens: int, steps: int = 1, top_k: int = 5, scope: str = "prompt") -> GenerateRequest:
    spec = AttributionSpec(inputs=InputAttributionSpec(top_k=top_k, steps=steps, scope=scope))
    return GenerateRequest(rid, PROMPT, max_tokens=max_tokens, attribution=spec)


def drain(engine: Engine) -> list:
    out = []
    while engine.has_work():
        out += engine.step()
    return out


def official_aggregate(commits, attrs: list[torch.Tensor], n_new: int, start: int, end: int, scope: str) -> list:
    """The official FaithfulOutputToInputAttribution.aggregate_chunk over CDE's attributions."""
    from steerling.attribution.input_attribution import FaithfulOutputToInputAttribution
    from steerling.attribution.trace import CommitRecord, DiffusionTrace

    steps = sorted({s for _, _, s in commits})
    groups = []
    for order, step in enumerate(steps):
        pos = [p for p, _, s in commits if s == step]
        tok = [t for _, t, s in commits if s == step]
        groups.append(CommitRecord(order, step, torch.tensor(pos), torch.tensor(tok), torch.zeros(len(pos))))
    seq_len = len(PROMPT) + n_new
    trace = DiffusionTrace(torch.tensor(PROMPT), len(PROMPT), seq_len, MASK_ID, None, torch.device("cpu"), groups)
    positions = torch.tensor([p for g in groups for p in g.positions.tolist()])
    full = torch.stack([torch.nn.functional.pad(attrs[int(p)], (0, seq_len - len(attrs[int(p)]))) for p in positions])
    res = FaithfulOutputToInputAttribution(
        trace, torch.zeros_like(positions), positions, positions, torch.zeros(len(positions)), full
    )
    return res.aggregate_chunk(start, end, scope=scope)


@pytest.mark.parametrize("scope", ["prompt", "all"])
def test_block_results_carry_input_attribution(engine, scope):
    n_new, top_k = 128, 5
    engine.add_request(asking("a", n_new, top_k=top_k, scope=scope))
    seq = engine.scheduler.waiting[-1]
    engine.add_request(GenerateRequest("plain", PROMPT, max_tokens=64))
    results = [r for r in drain(engine) if isinstance(r, BlockResult)]
    assert all(r.input_attribution is None for r in results if r.request_id == "plain")
    mine = [r for r in results if r.request_id == "a"]
    assert [len(r.token_ids) for r in mine] == [64, 64]
    targets = build_targets(PROMPT, seq.commits, [p for p, _, _ in seq.commits])
    attrs = {t.position: a for t, a in zip(targets, attribute(engine.runner.model, targets, 1))}
    for block, res in enumerate(mine, start=1):
        ia = res.input_attribution
        assert ia.positions == list(range(block * 64, block * 64 + 64))
        assert ia.token_ids == res.token_ids
        for p, tops, scores, ids in zip(ia.positions, ia.top_positions, ia.top_scores, ia.top_token_ids):
            a = attrs[p]
            snap = next(t.snapshot for t in targets if t.position == p)
            allowed = [q for q in range(len(a)) if q < 64 or (scope == "all" and snap[q] != MASK_ID)]
            expect = sorted(allowed, key=lambda q: -abs(float(a[q])))[:top_k]
            assert tops == expect
            assert scores == pytest.approx([float(a[q]) for q in expect], rel=1e-6)
            assert ids == [snap[q] for q in expect]
        # One chunk per block: the official aggregate over the same attributions.
        (span,) = ia.chunk_spans
        assert span == [block * 64, block * 64 + 64]
        ref = official_aggregate(seq.commits, [attrs.get(p) for p in range(192)], n_new, *span, scope=scope)
        assert ia.chunk_positions[0] == [d["input_position"] for d in ref[:top_k]]
        assert ia.chunk_scores[0] == pytest.approx([d["score"] for d in ref[:top_k]], rel=1e-5)
        assert ia.chunk_token_ids[0] == [d["input_token_id"] for d in ref[:top_k]]
    assert not engine.outputs.input_attribution.requests  # released with the request


def test_chunks_ending_mid_block_rank_every_generated_input_the_official_way(engine):
    """<|endofchunk|> chunks (made frequent by a logit bias) end mid-block, and diffusion commits
    out of order: a chunk's tokens saw positions after it already generated. The official
    aggregate_chunk with scope "all" ranks every generated position, those too."""
    top_k = 40
    spec = AttributionSpec(chunking="endofchunk", inputs=InputAttributionSpec(top_k=top_k, steps=1, scope="all"))
    engine.add_request(GenerateRequest("e", PROMPT, max_tokens=64, logit_bias={ENDOFCHUNK_ID: 3.0}, attribution=spec))
    seq = engine.scheduler.waiting[-1]
    (res,) = [r for r in drain(engine) if isinstance(r, BlockResult)]
    ia = res.input_attribution
    assert len(ia.chunk_spans) >= 3 and ia.chunk_spans[0][1] < 128  # the first chunk ends mid-block
    targets = build_targets(PROMPT, seq.commits, [p for p, _, _ in seq.commits])
    attrs = {t.position: a for t, a in zip(targets, attribute(engine.runner.model, targets, 1))}
    for span, positions, scores in zip(ia.chunk_spans, ia.chunk_positions, ia.chunk_scores):
        ref = official_aggregate(seq.commits, [attrs.get(p) for p in range(128)], 64, *span, scope="all")
        assert positions == [d["input_position"] for d in ref[:top_k]], span
        assert scores == pytest.approx([d["score"] for d in ref[:top_k]], rel=1e-5)


def test_other_requests_decode_while_attribution_runs(engine):
    engine.add_request(asking("a", 64, steps=8))  # 512 rows of IG after its only block
    engine.add_request(GenerateRequest("plain", PROMPT, max_tokens=192))
    order = []
    while engine.has_work():
        pending = engine.outputs.input_attribution.has_work()
        for r in engine.step():
            if isinstance(r, BlockResult):
                order.append((r.request_id, pending))
    # The plain request's blocks came out while the attribution was pending, the attributed
    # request's block after (held back until its attribution was done).
    assert ("plain", True) in order
    assert order[-1][0] == "plain" or order.index(("a", True)) > order.index(("plain", True))
    assert [r for r, _ in order].count("a") == 1


def test_abort_drops_the_attribution(engine):
    engine.add_request(asking("a", 64, steps=8))
    while not engine.outputs.input_attribution.has_work():
        engine.step()
    assert engine.abort("a")
    assert not engine.outputs.input_attribution.requests
    assert all(r.request_id != "a" for r in drain(engine))


def test_requests_that_do_not_ask_are_not_tracked(engine):
    engine.add_request(GenerateRequest("p", PROMPT, max_tokens=64, attribution=AttributionSpec()))
    assert not engine.outputs.input_attribution.requests
    results = drain(engine)
    assert results and all(getattr(r, "input_attribution", None) is None for r in results)


def test_bad_specs_are_refused(engine):
    for spec, word in ((InputAttributionSpec(steps=0), "steps"), (InputAttributionSpec(scope="x"), "scope")):
        with pytest.raises(ValueError, match=word):
            engine.add_request(GenerateRequest("b", PROMPT, attribution=AttributionSpec(inputs=spec)))
    assert not engine.has_work()


def test_quantized_models_refuse_input_attribution(tiny_dir):
    """worker/fp8.py's linear layers have no backward on their scaled GEMM (emulated on the CPU)."""
    engine = Engine(EngineArgs(str(tiny_dir), quantization="fp8", max_running=1))
    with pytest.raises(ValueError, match="unquantized"):
        engine.add_request(asking("q", 8))
    engine.add_request(GenerateRequest("p", PROMPT, max_tokens=8))


def test_attribution_yields_to_waiting_requests(tiny_dir, monkeypatch):
    """Issue 32: with the only slot held by the attributed request itself (still decoding its
    second block) and another request waiting for it, the attribution runs in yielding chunks
    (quarter size, a share of the time), never a full chunk per step: counting only the running
    others, it ran full chunks and the waiting request was admitted 7x later."""
    from cde.worker.input_attribution import InputAttributionJob

    engine = Engine(EngineArgs(str(tiny_dir), max_running=1))
    chunks: list[tuple[bool, int | None]] = []  # (someone waiting, the chunk's token budget)
    step = InputAttributionJob.step

    def recording(job: InputAttributionJob, token_budget: int | None = None) -> bool:
        chunks.append((bool(engine.scheduler.waiting), token_budget))
        return step(job, token_budget)

    monkeypatch.setattr(InputAttributionJob, "step", recording)
    engine.add_request(asking("a", 128, steps=8))
    engine.add_request(GenerateRequest("w", PROMPT, max_tokens=64))
    drain(engine)
    while_waiting = [budget for waiting, budget in chunks if waiting]
    assert while_waiting, "the attribution never ran while a request waited"
    assert all(budget is not None for budget in while_waiting)


def test_scope_all_ranks_the_positions_generated_when_the_block_completed(engine):
    """A chunk's ranking with scope "all" spans the positions generated when its block completed
    (docs/api.md), however long its IG then waits behind other requests' decoding: the same
    request alone and beside another gives the same chunks."""

    def chunks(companion: bool) -> list:
        engine.add_request(asking("s", 192, top_k=256, scope="all"))
        if companion:
            engine.add_request(GenerateRequest("o", PROMPT[::-1], max_tokens=192))
        mine = [r for r in drain(engine) if isinstance(r, BlockResult) and r.request_id == "s"]
        ia = [r.input_attribution for r in mine]
        return [(i.chunk_spans, i.chunk_positions, i.chunk_scores) for i in ia]

    alone = chunks(False)
    assert [spans for spans, _, _ in alone] == [[[64, 128]], [[128, 192]], [[192, 256]]]
    assert chunks(True) == alone
