"""worker/kv_pages.py: the page allocator (the real Scheduler drives it through thousands of
random admit / step / finish / abort sequences in test_scheduler.py)."""

import pytest
from cde.worker.kv_pages import OutOfPages, PageAllocator


# ---- allocator unit tests ---------------------------------------------------------------------
def test_allocate_and_free():
    a = PageAllocator(5)
    assert (a.num_free, a.num_used) == (5, 0)
    pa = a.allocate("a", 2)
    pb = a.allocate("b", 3)
    assert len(set(pa) | set(pb)) == 5 and a.num_free == 0
    assert not a.can_allocate(1) and a.can_allocate(0)
    assert a.free("a") == 2 and a.num_free == 2
    assert a.free("a") == 0  # no pages: a no-op
    pc = a.allocate("c", 2)
    assert sorted(pc) == sorted(pa)  # a's pages, and only they, were returned
    a.free("b"), a.free("c")
    assert a.num_free == 5 and sorted(a._free) == list(range(5))


def test_allocate_errors():
    with pytest.raises(ValueError, match="at least one page"):
        PageAllocator(0)
    a = PageAllocator(3)
    a.allocate("x", 2)
    with pytest.raises(ValueError, match="'x' already holds pages"):
        a.allocate("x", 1)
    with pytest.raises(OutOfPages, match="'y' needs 2 pages, 1 free"):
        a.allocate("y", 2)
    # a failed allocation changes nothing
    assert a.num_free == 1 and a.free("y") == 0
    assert a.allocate("y", 1) == [2]  # the one page left was nobody's


def test_allocate_returns_a_copy():
    a = PageAllocator(2)
    a.allocate("x", 2).clear()
    assert a.free("x") == 2
