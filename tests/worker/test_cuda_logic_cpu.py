"""The CUDA path's logic that is not CUDA-specific, run on the CPU (test_gpu.py runs the real
thing on an H200):

- the LM head padded to a multiple of 128 rows with the padding columns banned: a model whose
  every real logit is negative (so a padding column's 0 would win) decodes exactly as unpadded;
- CUDA-graph buckets: a real pass packed into a larger bucket (padding items on the scratch
  page and slot) and run from the packed buffer through the block-mask attention, with split-KV
  as an engine with `kv_splits` sets it per bucket, gives the eager path's outputs (the last
  block's input and attention output, the steering inputs, and so the final hidden states that
  `finish` computes from them) and cache writes, and touches no page or FlashBlock row but its
  own and the scratch ones;
- attribution replayed through row buckets in turns (the side-stream graphs' loop) gives the
  rows of one eager call.
"""

import warnings

import numpy as np
import pytest
import torch
from cde.kernels.flex_paged_attention import PACKED_OPTIONS, SINGLE_TILE_OPTIONS
from cde.shared.config import preset
from cde.shared.protocol import AttributionSpec, FlashBlockSpec, GenerateRequest, SteeringSpec
from cde.worker.attribution_runner import AttributionRunner, _Graph
from cde.worker.concept_contributions import attribute, width
from cde.worker.cuda_graphs import (
    AUTO_SPLITS,
    BUCKETS,
    LONG_CONTEXT_PAGES,
    bucket_forward,
    bucket_mask,
    bucket_split_choices,
    bucket_splits,
    pack,
)
from cde.worker.engine import Engine, EngineArgs
from cde.worker.model_runner import ModelRunner
from cde.worker.step_inputs import eligible_rows

from tests.worker.test_sampler import crafted_engine


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 100000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the padded LM head ----------------------------------------------------------------------------
def run(engine: Engine, reqs: list[GenerateRequest]) -> dict:
    out = {r.request_id: ([], []) for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for res in engine.step():
            out[res.request_id][0].extend(res.token_ids)
            out[res.request_id][1].extend(res.attribution or [])
    return out


def test_padded_lm_head_never_changes_a_pick(tmp_path):
    engine = crafted_engine(tmp_path / "negative", lnf0=-1.0, banned_extra=0.0)  # every real logit < 0
    vocab = engine.cfg.vocab_size
    reqs = lambda: [
        GenerateRequest("g", prompt(70, 1), max_tokens=20, tokens_per_step=2),
        GenerateRequest("s", prompt(10, 2), max_tokens=4, tokens_per_step=2, temperature=1.0, top_p=0.95, seed=3),
        GenerateRequest("r", prompt(64, 3) * 2, max_tokens=12, repetition_penalty=1.5),
        GenerateRequest(
            "m",
            prompt(30, 4),
            max_tokens=12,
            attribution=AttributionSpec(),
            steering=SteeringSpec(
                [3, 5], strength=-4.0, normalize=False, inject_layer=1, schedule="fixed", relu_logit_mask={3: 20.0}
            ),
        ),
    ]
    plain = run(engine, reqs())
    assert engine.runner.lm_head.shape[0] == vocab
    # A fresh engine on the same checkpoint: the first one's prefix cache names pages of the
    # runner it computed them with, so its runner cannot be swapped under it.
    engine = Engine(EngineArgs(engine.args.model, max_running=4))
    engine.runner = ModelRunner(
        engine.runner.model, engine.cfg, engine.scheduler.pages.num_pages, engine.args.max_running, vocab_align=128
    )
    assert engine.runner.lm_head.shape[0] % 128 == 0 and engine.runner.lm_head.shape[0] > vocab
    padded = run(engine, reqs())
    for rid, (tokens, records) in plain.items():
        assert padded[rid][0] == tokens and max(tokens) < vocab, rid
        for a, b in zip(padded[rid][1], records):
            assert a["token_id"] == b["token_id"]
            np.testing.assert_allclose(np.array(a["known"]), np.array(b["known"]), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(a["target_logit"], b["target_logit"], rtol=1e-5, atol=1e-6)


# ---- CUDA-graph buckets ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_dir):
    # A small cache (the graphs need one of at least max_blocks pages): eager FlexAttention
    # evaluates every query against every page of it.
    return Engine(EngineArgs(str(tiny_dir), max_running=4, num_pages=16))


def live_pass(engine: Engine, flashblock):
    """A real pass in flight (prefill, commits and steps at several blocks; one request steered),
    with the cache as the engine left it: rerunning the pass rewrites the same K/V."""
    fb = FlashBlockSpec(tau=2, max_reuse=4) if flashblock else False
    for i, (n, m) in enumerate([(150, 40), (10, 100), (64, 70)]):
        steer = SteeringSpec([3], strength=6.0, inject_layer=1, schedule="fixed") if i == 1 else None
        engine.add_request(
            GenerateRequest(
                f"{flashblock}{i}", prompt(n, i), max_tokens=m, tokens_per_step=3, steering=steer, flashblock=fb
            )
        )
    for _ in range(4):
        engine.step()
    plan = engine._in_flight.plan
    assert len(plan.items) >= 3 and any(it.is_step for it in plan.items) and len({it.block for it in plan.items}) > 1
    return plan.items


def test_split_kv_is_chosen_per_pass_from_the_longest_item():
    long = LONG_CONTEXT_PAGES
    assert AUTO_SPLITS == {1: 8, 2: 4}  # the measured choice (docs/benchmarks.md's kernel table)
    for size in BUCKETS:  # auto: split only small batches, only from a long context on
        assert bucket_splits(0, size, long - 1) == 1
        assert bucket_splits(0, size, long) == AUTO_SPLITS.get(size, 1)
        assert bucket_split_choices(0, size, 2048) == sorted({1, AUTO_SPLITS.get(size, 1)})
        assert bucket_split_choices(0, size, long - 1) == [1]  # a model whose context never gets long
    for size, want in ((1, 16), (2, 8), (4, 4), (32, 1), (64, 1)):  # the override, at any context
        assert bucket_splits(16, size, 1) == bucket_splits(16, size, 2048) == want
        assert bucket_split_choices(16, size, 2048) == [want]


def test_every_bucket_packs_the_query_heads_of_a_kv_head():
    """One grouping for all of a model's passes (one compiled block serves them, and FlexAttention
    cannot lower a grouping that varies); 128-row tiles except for one unsplit item."""
    cfg = preset("8b")
    for size in BUCKETS:
        for ways in bucket_split_choices(0, size, 2048):
            mask = bucket_mask(cfg, size, 8, "cpu", ways)
            assert mask.group == cfg.n_head // cfg.n_kv_heads == 8
            assert mask.options == (SINGLE_TILE_OPTIONS if size * ways == 1 else PACKED_OPTIONS), (size, ways)


def clone(caches):
    return [tuple(t.clone() for t in layer) for layer in caches]


@pytest.mark.parametrize("flashblock", [False, True], ids=["exact", "flashblock"])
@pytest.mark.parametrize("kv_splits", [1, 16])  # 16: the 4- and 8-item buckets split 4 and 2 ways
def test_a_padded_bucket_is_the_eager_pass(engine, flashblock, kv_splits):
    runner, cfg = engine.runner, engine.cfg
    items = live_pass(engine, flashblock)
    steer_vec, steer_from = runner._steering_inputs(items)
    split = runner.forward.split_inputs(items)
    assert (split is not None) == flashblock
    before_kv, before_fb = clone(runner.forward.kv), clone(runner.forward.flashblock_cache or [])
    with torch.inference_mode():
        want = runner.forward.eager(items, steer_vec, steer_from, split)
    steps = [i for i, it in enumerate(items) if it.is_step]
    read = torch.tensor(eligible_rows(steps, [items[i] for i in steps])[0])  # the rows that get logits
    assert read.numel() > 0
    want_kv, want_fb = runner.forward.kv, runner.forward.flashblock_cache
    # One page and one FlashBlock row past what the allocator hands out: the scratch ones.
    scratch_page, scratch_slot = runner.forward.kv[0][0].shape[1] - 1, runner.max_running
    for size in (next(b for b in BUCKETS if b >= len(items)), 8):
        kv, fb_cache = clone(before_kv), clone(before_fb) if flashblock else None
        ints = torch.tensor(
            pack(
                size,
                [it.tokens for it in items],
                [it.block for it in items],
                [it.page for it in items],
                [it.pages for it in items],
                steer_from,
                split,
                scratch_page=scratch_page,
                scratch_slot=scratch_slot,
                width=cfg.max_blocks,
                no_injection=cfg.n_layers + 1,
            )
        )
        vec = torch.zeros(size, cfg.n_embd)
        vec[: len(items)] = steer_vec
        ways = bucket_splits(kv_splits, size, max(len(it.pages) for it in items))
        mask = bucket_mask(cfg, size, kv[0][0].shape[1], "cpu", ways)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
            got = bucket_forward(
                runner.model,
                ints,
                size,
                cfg.max_blocks,
                vec,
                mask,
                kv,
                fb_cache,
                runner.forward.cos,
                runner.forward.sin,
            )
        real = got.first(len(items))
        for name in ("x", "a", "inject", "gate"):
            ours, eager = getattr(real, name), getattr(want, name)
            assert ours.shape == eager.shape and torch.allclose(ours, eager, atol=1e-4), (size, name)
        with torch.inference_mode():
            ours, eager = runner.forward.finish(real, read), runner.forward.finish(want, read)
        assert torch.allclose(ours, eager, atol=1e-4), (size, (ours - eager).abs().max())
        written = {it.page for it in items}
        for layer, (k, v) in enumerate(kv):
            for page in range(k.shape[1]):
                if page in written:  # this pass's K/V, as the eager path wrote them
                    assert torch.allclose(k[:, page], want_kv[layer][0][:, page], atol=1e-4), (layer, page)
                elif page != scratch_page:  # everything else untouched, bit for bit
                    assert torch.equal(k[:, page], before_kv[layer][0][:, page]), (layer, page)
                    assert torch.equal(v[:, page], before_kv[layer][1][:, page]), (layer, page)
        if flashblock:
            refreshed = {it.slot for it, w in zip(items, split.writes) if w != scratch_slot}
            for layer, rows in enumerate(fb_cache):
                for slot in range(scratch_slot):
                    for ours, eager, old in zip(rows, want_fb[layer], before_fb[layer]):
                        if slot in refreshed:
                            assert torch.allclose(ours[slot], eager[slot], atol=1e-4), (layer, slot)
                        else:
                            assert torch.equal(ours[slot], old[slot]), (layer, slot)
    for it in items:  # the eager rerun rewrote what the pass had written: the engine carries on
        engine.abort(it.request.request_id)
    while engine.has_work():
        engine.step()


# ---- attribution through row buckets -----------------------------------------------------------------
class EagerGraph:
    """What a captured CUDA graph does on replay, on the CPU: the same computation on the same
    static buffers (the graphs only exist on CUDA)."""

    def __init__(self, fn):
        self.replay = fn


def eager_graphs(model, cfg, sizes) -> dict:
    graphs = {}
    for size in sizes:
        h, tok, target = torch.zeros(size, cfg.n_embd), torch.zeros(size, dtype=torch.long), torch.zeros(size)
        out = torch.zeros(size, width(cfg), dtype=torch.float64)
        graph = EagerGraph(
            lambda h=h, tok=tok, target=target, out=out: out.copy_(attribute(model, cfg, h, tok, target))
        )
        graphs[size] = _Graph(h, tok, target, graph, out)
    return graphs


@pytest.mark.parametrize("n", [1, 8, 9, 45, 64, 70])
def test_attribution_in_bucket_turns_equals_one_call(engine, n):
    model, cfg = engine.runner.model, engine.cfg
    g = torch.Generator().manual_seed(n)
    hidden, tokens, target = (
        torch.randn(n, cfg.n_embd, generator=g),
        torch.randint(0, 1000, (n,), generator=g),
        torch.randn(n, generator=g),
    )
    runner = AttributionRunner(model, cfg, max_rows=32)
    runner.graphs = eager_graphs(model, cfg, (8, 32))  # as capture_all leaves them for max_rows 32
    with torch.inference_mode():
        got = torch.full((n, runner.width), float("nan"), dtype=torch.float64)
        runner.compute(hidden, tokens, target, into=got)
        want = attribute(model, cfg, hidden, tokens, target)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-9)
