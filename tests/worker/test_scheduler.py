"""worker/scheduler.py, alone (no model, no tokenizer, no torch): thousands of random admit /
step / finish / abort sequences over the real page allocator, admission that waits for pages,
and the plan each pass gets."""

import random

import pytest
from cde.shared.config import MASK_ID, PAGE
from cde.shared.protocol import BlockResult, FlashBlockSpec, GenerateRequest
from cde.worker.kv_pages import PageAllocator
from cde.worker.plan import Picks, StepPlan
from cde.worker.scheduler import Scheduler
from cde.worker.sequence import Status

STOP_ID = 13


def check_allocator(alloc: PageAllocator):
    free = list(alloc._free)
    assert len(free) == len(set(free)), "a page is twice in the free list"
    owned = [p for pages in alloc._by_owner.values() for p in pages]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert not set(free) & set(owned), "a page is both free and owned"
    assert set(free) | set(owned) == set(range(alloc.num_pages)), "a page leaked"


def check_scheduler(s: Scheduler, max_running: int):
    check_allocator(s.pages)
    assert len(s.running) <= max_running
    running_ids = {q.id for q in s.running}
    assert set(s.pages._by_owner) == running_ids, "pages held by a request that is not running"
    for q in s.running:
        assert q.status is Status.RUNNING and s.running_in(q.slot) is q
        assert s.pages._by_owner[q.id] == q.pages and len(q.pages) == q.n_blocks
    slots = [q.slot for q in s.running]
    assert len(slots) == len(set(slots)) and all(0 <= x < max_running for x in slots)
    assert sorted(slots + s._free_slots) == list(range(max_running))
    for q in s.waiting:
        assert q.status is Status.WAITING and q.pages == [] and q.id not in s.pages._by_owner


def fake_picks(plan: StepPlan, rng, eot_id):
    picks = []
    for it in plan.step_items:
        eligible = [i for i, ok in enumerate(it.eligible) if ok]
        assert eligible, "a step item with nothing to unmask"
        k = min(rng.choice([1, 1, 2, 5, 64]), len(eligible))
        pool = [STOP_ID] * 1 + list(range(20, 40)) + ([eot_id] if eot_id is not None else [])
        toks = [rng.choice(pool) if rng.random() < 0.02 else rng.randrange(20, 1000) for _ in range(k)]
        picks.append(Picks(eligible[:k], toks))
    return picks


def results(placed) -> list:
    return [r for p in placed for r in p.results]


def run_fuzz(seed: int, n_ops: int):
    rng = random.Random(seed)
    num_pages = rng.randint(3, 40)
    max_running = rng.randint(1, 6)
    max_items = rng.randint(2, 12)
    eot_id = rng.choice([None, 100283])
    s = Scheduler(num_pages, max_running, max_items, eot_id=eot_id)
    live: dict[str, object] = {}  # id -> Sequence, not yet finished
    emitted: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    counter = 0
    stats = {"admitted": 0, "finished": 0, "aborted": 0, "steps": 0, "blocked": 0}
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.25:
            prompt_len = rng.choice([0, 1, 63, 64, 65, 127, 128, rng.randint(0, 300)])
            max_tokens = rng.choice([1, 8, 63, 64, 65, rng.randint(1, 400)])
            req = GenerateRequest(
                f"r{counter}",
                [rng.randrange(20, 1000) for _ in range(prompt_len)],
                max_tokens=max_tokens,
                stop_token_ids=[STOP_ID] if rng.random() < 0.5 else [],
            )
            counter += 1
            need = -(-(prompt_len + max_tokens) // PAGE)
            if need > num_pages:
                with pytest.raises(ValueError, match="KV pages"):
                    s.add(req)
                continue
            live[req.request_id] = s.add(req)
            emitted[req.request_id] = []
        elif op < 0.32 and live:
            rid = rng.choice(sorted(live) + ["nope"])
            was = live.get(rid)
            assert s.abort(rid) is (rid in live)
            if was is not None:
                assert was.status is Status.FINISHED
                finished[rid] = "abort"
                del live[rid]
                stats["aborted"] += 1
        else:
            running_before = {q.id for q in s.running}
            waiting_before = [q.id for q in s.waiting]
            free_before = s.pages.num_free
            plan = s.schedule()
            check_scheduler(s, max_running)
            admitted = [s.running_in(new.slot) for new in plan.new]
            stats["admitted"] += len(admitted)
            # FIFO admission; nothing running was evicted to make room
            assert [q.id for q in admitted] == waiting_before[: len(admitted)]
            assert [new.params for new in plan.new] == [q.params for q in admitted]
            assert running_before <= {q.id for q in s.running}
            assert free_before - s.pages.num_free == sum(q.n_blocks for q in admitted)
            if s.waiting and s._free_slots:
                # the head could not get its pages: it waits, nothing else jumps the queue
                assert s.waiting[0].n_blocks > s.pages.num_free
                stats["blocked"] += 1
            # the plan only touches pages of its own requests
            writes = [it.page for it in plan.items]
            assert len(writes) == len(set(writes)), "two items write the same page"
            assert len(plan.items) <= max(max_items, 2)
            for it in plan.items:
                seq = s.running_in(it.slot)
                assert seq is not None and seq.params is it.request
                assert it.page == seq.pages[it.block] and list(it.pages) == seq.pages[: it.block + 1]
                assert set(it.pages) <= set(s.pages._by_owner[seq.id]) and len(it.tokens) == PAGE
                if it.is_step:
                    # the masked positions before the request's end, from the block's tokens
                    # (the sequence keeps them up to date as picks land instead)
                    base = it.block * PAGE
                    masked = [t == MASK_ID and base + i < seq.end for i, t in enumerate(seq.tokens)]
                    assert list(it.tokens) == seq.tokens and list(it.eligible) == masked == seq.eligible()
            step_ids = [it.request.request_id for it in plan.step_items]
            assert len(step_ids) == len(set(step_ids)), "two steps of one request in one pass"
            picks = fake_picks(plan, rng, eot_id)
            # sometimes a request is aborted while its step is in flight
            if plan.step_items and rng.random() < 0.1:
                rid = rng.choice(step_ids)
                assert s.abort(rid)
                finished[rid] = "abort"
                del live[rid]
                stats["aborted"] += 1
            for res in results(s.place(plan, picks)):
                assert res.request_id in live and res.request_id not in finished
                emitted[res.request_id].extend(res.token_ids)
                assert MASK_ID not in res.token_ids
                if res.finished:
                    seq = live.pop(res.request_id)
                    finished[res.request_id] = res.finish_reason
                    stats["finished"] += 1
                    out = emitted[res.request_id]
                    if res.finish_reason == "length":
                        assert len(out) == seq.req.max_tokens
                        assert STOP_ID not in out or not seq.req.stop_token_ids
                    else:
                        assert res.finish_reason == "stop" and len(out) < seq.req.max_tokens
                    assert eot_id not in out
            stats["steps"] += 1
        check_scheduler(s, max_running)
        # a live request is either waiting or running, never silently dropped
        assert {q.id for q in s.running} | {q.id for q in s.waiting} == set(live)
    # drain: finish some by running to completion, abort the rest
    for _ in range(50):
        if not s.running:
            break
        plan = s.schedule()
        for res in results(s.place(plan, fake_picks(plan, rng, eot_id))):
            if res.finished:
                live.pop(res.request_id)
    for rid in sorted(live):
        assert s.abort(rid)
    assert not s.has_work() and not s.running and not s.waiting
    check_allocator(s.pages)
    assert s.pages.num_free == num_pages and sorted(s.pages._free) == list(range(num_pages))
    assert sorted(s._free_slots) == list(range(max_running))
    return stats


def test_scheduler_fuzz_pages_never_double_owned():
    total = {"admitted": 0, "finished": 0, "aborted": 0, "steps": 0, "blocked": 0}
    for seed in range(40):
        for k, v in run_fuzz(seed, 400).items():
            total[k] += v
    # the fuzz really exercised every path
    assert total["admitted"] > 500 and total["finished"] > 200 and total["aborted"] > 100
    assert total["blocked"] > 100 and total["steps"] > 5000


def first_eligible(plan: StepPlan, token: int = 5) -> list[Picks]:
    return [Picks([i for i, ok in enumerate(it.eligible) if ok][:1], [token]) for it in plan.step_items]


def test_waiting_request_waits_for_pages_without_eviction():
    s = Scheduler(num_pages=4, max_running=4, max_items=16, eot_id=None)
    big = s.add(GenerateRequest("big", [1] * 64, max_tokens=128))  # 3 pages
    s.schedule()
    late = s.add(GenerateRequest("late", [], max_tokens=65))  # 2 pages: only 1 free
    small = s.add(GenerateRequest("small", [], max_tokens=1))  # 1 page, but behind "late" (FIFO)
    for _ in range(3):
        plan = s.schedule()
        assert plan.new == () and [q.id for q in s.running] == ["big"]
        assert list(s.waiting) == [late, small] and big.pages == s.pages._by_owner["big"]
        s.place(plan, first_eligible(plan))
    assert s.abort("big") and s.pages.num_free == 4
    plan = s.schedule()
    assert [new.params.request_id for new in plan.new] == ["late", "small"] and s.pages.num_free == 1


def test_add_rejects_request_larger_than_cache():
    s = Scheduler(num_pages=2, max_running=1, max_items=4, eot_id=None)
    with pytest.raises(ValueError, match="needs 3 KV pages, the cache has 2"):
        s.add(GenerateRequest("x", [1] * 100, max_tokens=50))
    assert not s.has_work()


def test_the_scheduler_leaves_stop_strings_to_the_output_stage():
    """No tokenizer anywhere: a request with a stop string runs to its length through the
    scheduler alone, its blocks uncut (the output stage, worker/outputs.py, decodes and cuts)."""
    s = Scheduler(num_pages=4, max_running=1, max_items=4, eot_id=None)
    s.add(GenerateRequest("r", [1] * 10, max_tokens=70, stop=["a"], tokens_per_step=64))
    blocks = []
    while s.has_work():
        plan = s.schedule()
        picks = [Picks([i for i, ok in enumerate(it.eligible) if ok], [97] * 64) for it in plan.step_items]
        blocks += [r for r in results(s.place(plan, picks)) if isinstance(r, BlockResult)]
    assert [len(b.token_ids) for b in blocks] == [54, 16]
    assert (blocks[-1].finished, blocks[-1].finish_reason, blocks[-1].stop_str) == (True, "length", None)


def test_an_ended_requests_step_in_flight_is_dropped():
    """A request ended after its next pass was planned (a stop string found while that pass runs)
    gets nothing from that pass, and its slot is free for the next admission."""
    s = Scheduler(num_pages=4, max_running=1, max_items=4, eot_id=None)
    s.add(GenerateRequest("r", [1] * 10, max_tokens=100))
    first = s.schedule()
    s.place(first, [Picks([i for i, ok in enumerate(it.eligible) if ok], [7] * 64) for it in first.step_items])
    in_flight = s.schedule()  # the commit of block 0 and the first step of block 1
    seq = s.running_in(0)
    assert s.end(seq, "stop") and not s.end(seq, "stop")  # once
    assert seq.finish_reason == "stop" and s.pages.num_free == 4
    assert s.place(in_flight, first_eligible(in_flight)) == []
    s.add(GenerateRequest("next", [2] * 10, max_tokens=8))
    assert [new.slot for new in s.schedule().new] == [0]


def test_flashblock_modes_follow_the_reuse_rule_through_the_plans():
    """The scheduler consults FlashBlock's policy once per planned step and tells it what each
    step kept and when a block completes (the rule alone: tests/kernels/test_flashblock.py)."""
    s = Scheduler(num_pages=4, max_running=2, max_items=8, eot_id=None)
    s.add(GenerateRequest("fb", [1] * 62, max_tokens=10, flashblock=FlashBlockSpec(tau=2, max_reuse=3)))
    s.add(GenerateRequest("exact", [1] * 62, max_tokens=10, flashblock=False))
    modes: dict[str, str] = {"fb": "", "exact": ""}
    per_step = [1, 1, 2, 1, 1, 1, 1, 1, 1]  # the first block has two positions: two steps, then block 1
    for n in per_step:
        plan = s.schedule()
        for it in plan.step_items:
            modes[it.request.request_id] += "ERU"[it.attention]
        s.place(plan, [Picks([i for i, ok in enumerate(it.eligible) if ok][:n], [5] * n) for it in plan.step_items])
    # block 0: R U; block 1 starts by refreshing, its first step kept 2 >= tau (refresh), then
    # three reuses (max_reuse), a refresh, a reuse
    assert modes == {"fb": "RURRUUURU", "exact": "EEEEEEEEE"}


def test_an_id_is_in_flight_while_it_waits_or_runs():
    s = Scheduler(num_pages=8, max_running=1, max_items=4, eot_id=None)
    s.add(GenerateRequest("r", [1] * 10, max_tokens=8))
    s.add(GenerateRequest("w", [1] * 10, max_tokens=8))
    s.schedule()
    assert [q.id for q in s.running] == ["r"] and [q.id for q in s.waiting] == ["w"]
    assert s.in_flight("r") and s.in_flight("w") and not s.in_flight("x")
    assert s.abort("w") and not s.abort("w") and not s.in_flight("w")
    assert s.abort("r") and not s.in_flight("r") and s.pages.num_free == 8
