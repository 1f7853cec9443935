"""worker/prefix_cache.py and the allocator's side of it (worker/kv_pages.py): keys, sharing,
parking, LRU eviction, and the real Scheduler driven through random admit / step / finish / abort
sequences over prompts that share prefixes, with every page's content followed so that a pass
reading a page that does not hold its request's tokens fails the test."""

import random

import pytest
from cde.shared.config import PAGE
from cde.shared.prefix_hash import page_keys
from cde.shared.protocol import GenerateRequest
from cde.worker.kv_pages import OutOfPages, PageAllocator
from cde.worker.prefix_cache import PrefixCache
from cde.worker.scheduler import Scheduler
from cde.worker.sequence import Status

from tests.worker.test_scheduler import fake_picks, results


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1000) for _ in range(n)]


# ---- keys -------------------------------------------------------------------------------------
def test_keys_chain_the_whole_prefix_and_the_namespace():
    a = tokens(3 * PAGE, 1)
    b = a[:PAGE] + tokens(2 * PAGE, 2)  # the same first page only
    ka, kb = page_keys(a, 3), page_keys(b, 3)
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]
    # the same page 2 after a different page 1 is another key: a key names the whole prefix
    c = a[:PAGE] + b[PAGE : 2 * PAGE] + a[2 * PAGE :]
    assert page_keys(c, 3)[2] != ka[2]
    assert page_keys(a, 3, "model|bfloat16|fp8")[0] != ka[0]
    assert len(set(ka) | set(kb)) == 5 and all(len(k) == 32 for k in ka)


def test_only_full_prompt_pages_are_keyed():
    cache = PrefixCache("m")
    assert [len(cache.keys(tokens(n, 0))) for n in (0, 63, 64, 127, 128, 130)] == [0, 0, 1, 1, 2, 2]
    cache.enabled = False
    assert cache.keys(tokens(128, 0)) == []


# ---- allocator with a cache -----------------------------------------------------------------------
def admit(alloc: PageAllocator, cache: PrefixCache, owner: str, prompt: list[int], n: int) -> list[int]:
    keys = cache.keys(prompt)
    pages = alloc.allocate(owner, n, cache.match(keys))
    cache.admitted(keys, pages)
    return pages


def test_shared_pages_are_counted_once_and_parked_when_written():
    cache = PrefixCache("m")
    alloc = PageAllocator(8, cache)
    prompt = tokens(2 * PAGE + 5, 3)
    a = admit(alloc, cache, "a", prompt, 3)
    b = admit(alloc, cache, "b", prompt, 4)
    assert b[:2] == a[:2] and b[2] not in a and alloc.num_used == 5
    cache.written(a[0])  # page 0 prefilled; page 1's pass never ran
    alloc.free("a")
    assert alloc.num_used == 4  # a's private page only
    alloc.free("b")
    # page 0: written, parked (still free-able); page 1: never written, forgotten
    assert (alloc.num_free, cache.num_parked, cache.pages_held) == (8, 1, 1)
    assert cache.match(cache.keys(prompt)) == [a[0]]
    c = admit(alloc, cache, "c", prompt, 3)
    assert c[0] == a[0] and cache.num_parked == 0 and alloc.num_free == 5


def test_parked_pages_are_evicted_least_recently_parked_and_deepest_first():
    cache = PrefixCache("m")
    alloc = PageAllocator(6, cache)
    p, q = tokens(3 * PAGE, 4), tokens(3 * PAGE, 5)
    pa = admit(alloc, cache, "p", p, 3)
    qa = admit(alloc, cache, "q", q, 3)
    for page in pa + qa:
        cache.written(page)
    alloc.free("p")
    alloc.free("q")
    assert alloc.num_free == 6 and cache.num_parked == 6
    # a request of two new pages takes p's last two pages (parked first, deepest first)
    assert sorted(alloc.allocate("x", 2)) == sorted(pa[1:]) and cache.stats.evictions == 2
    assert cache.match(cache.keys(p)) == pa[:1]  # p's first page is still found
    assert cache.match(cache.keys(q)) == qa
    with pytest.raises(OutOfPages, match="'y' needs 5 pages, 4 free"):
        alloc.allocate("y", 5)


def test_a_parked_page_counts_as_free_until_it_is_shared_again():
    cache = PrefixCache("m")
    alloc = PageAllocator(4, cache)
    prompt = tokens(2 * PAGE, 6)
    pages = admit(alloc, cache, "a", prompt, 3)
    for page in pages[:2]:
        cache.written(page)
    alloc.free("a")
    assert alloc.num_free == 4
    shared = cache.match(cache.keys(prompt))
    # sharing both parked pages, a 4-page request needs 2 new ones of the 2 left: it fits, a 5-page one does not
    assert alloc.can_allocate(4, shared) and not alloc.can_allocate(5, shared)
    assert alloc.can_allocate(4) and not alloc.can_allocate(5)  # without sharing: evicting them


# ---- the scheduler, fuzzed -------------------------------------------------------------------------
def expected_content(seq, block: int):
    """What page `block` of `seq` must hold: its prompt's token ids up to the page's end (a full
    prompt page, shareable), or the request's own (the tail and generated blocks)."""
    if block < seq.n_prompt_blocks:
        return tuple(seq.req.prompt_ids[: (block + 1) * PAGE])
    return ("own", seq.id, block)


def run_pass(s: Scheduler, content: dict):
    """Schedule a pass and "run" it: check what it reads, then record what it writes."""
    plan = s.schedule()
    seqs = [s.running_in(it.slot) for it in plan.items]  # as the plan was made
    written_by = {}
    for it, seq in zip(plan.items, seqs):
        assert seq is not None and seq.params is it.request
        assert it.page not in written_by, "two items write one page"
        written_by[it.page] = seq.id
        if not it.is_step and it.block < seq.n_prompt_blocks:
            assert list(it.tokens) == seq.req.prompt_ids[it.block * PAGE : (it.block + 1) * PAGE]
        content[it.page] = expected_content(seq, it.block)
    for it, seq in zip(plan.items, seqs):
        for block, page in enumerate(it.pages):
            # read after this pass's writes, which only its own request's items may provide
            assert written_by.get(page, seq.id) == seq.id, "reads a page another request writes in this pass"
            assert content.get(page) == expected_content(seq, block), "reads a page holding something else"
    return plan


def check_pages(s: Scheduler):
    alloc, cache = s.pages, s.prefix_cache
    refs = {}
    for q in s.running:
        assert alloc._by_owner[q.id] == q.pages and len(q.pages) == q.n_blocks
        assert len(set(q.pages)) == len(q.pages)
        for page in q.pages:
            refs[page] = refs.get(page, 0) + 1
    assert set(alloc._by_owner) == {q.id for q in s.running}
    assert all(alloc._refs[p] == refs.get(p, 0) for p in range(alloc.num_pages)), "a reference count is off"
    free, parked = list(alloc._free), list(cache._parked)
    assert len(free) == len(set(free)) and not set(free) & set(parked)
    assert not (set(free) | set(parked)) & set(refs), "a page is both free and referenced"
    assert set(free) | set(parked) | set(refs) == set(range(alloc.num_pages)), "a page leaked"
    assert all(cache.is_written(p) for p in parked), "a parked page was never written"
    assert alloc.num_used == len(refs)


def test_scheduler_fuzz_with_shared_prefixes():
    total_hits = 0
    for seed in range(30):
        rng = random.Random(seed)
        num_pages, max_running = rng.randint(4, 30), rng.randint(1, 5)
        s = Scheduler(num_pages, max_running, rng.randint(1, 10), None, prefix_cache=PrefixCache("m"))
        stems = [tokens(4 * PAGE, 100 * seed + i) for i in range(3)]
        content: dict = {}
        live, counter, hits = {}, 0, 0
        for _ in range(300):
            op = rng.random()
            if op < 0.25:
                stem = rng.choice(stems)
                n = rng.choice([0, 64, 100, 128, 192, 250, 256])
                prompt = stem[:n] + tokens(rng.choice([0, 0, 10, 64]), rng.random())
                req = GenerateRequest(f"r{counter}", prompt, max_tokens=rng.choice([1, 30, 64, 100]))
                counter += 1
                if -(-(len(prompt) + req.max_tokens) // PAGE) <= num_pages:
                    live[req.request_id] = s.add(req)
            elif op < 0.32 and live:
                rid = rng.choice(sorted(live))
                assert s.abort(rid)
                del live[rid]
            else:
                plan = run_pass(s, content)
                if s.waiting and s._free_slots:  # the head waits only when it would not fit without the cache
                    assert s.waiting[0].n_blocks > s.pages.num_free
                picks = fake_picks(plan, rng, None)
                if plan.step_items and rng.random() < 0.1:  # aborted while its pass runs
                    rid = rng.choice([it.request.request_id for it in plan.step_items])
                    assert s.abort(rid)
                    live.pop(rid)
                for res in results(s.place(plan, picks)):
                    if res.finished:
                        hits += res.cached_tokens
                        live.pop(res.request_id)
            check_pages(s)
        for rid in sorted(live):
            s.abort(rid)
        check_pages(s)
        assert s.pages.num_free == num_pages and all(q.status is Status.FINISHED for q in live.values())
        assert s.prefix_cache.stats.hit_tokens >= hits
        total_hits += s.prefix_cache.stats.hit_tokens
    assert total_hits > 0, "nothing was ever shared: the fuzz would be vacuous"
