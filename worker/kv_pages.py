"""Page allocator of the paged KV cache (pure Python; the tensors live in the model runner).

A page holds the K/V of one 64-token block in every layer. A request reserves all the pages its
prompt and `max_tokens` can fill when it is admitted, so a running request can never run out of
pages mid-generation and nothing is ever evicted behind its back.

With a prefix cache (worker/prefix_cache.py), a request's first pages may be full prompt pages it
shares with others: pages are reference-counted, and one whose last reference goes stays cached
(parked) until a request needs a page and the free list is empty. Parked pages count as free: the
cache never makes a request wait that would have fit without it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cde.worker.prefix_cache import PrefixCache


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, cache: PrefixCache | None = None):
        if num_pages <= 0:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        self.cache = cache
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self._by_owner: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        """Pages a request could get: the free list, and the cached pages nobody refers to."""
        return len(self._free) + (self.cache.num_parked if self.cache else 0)

    @property
    def num_used(self) -> int:
        """Pages referred to by at least one owner."""
        return self.num_pages - self.num_free

    def can_allocate(self, n: int, shared: Sequence[int] = ()) -> bool:
        """Whether `n` pages fit, the first of them `shared` (cached pages, perhaps parked: those
        stop counting as free once taken)."""
        parked = sum(self._refs[p] == 0 for p in shared)
        return n - len(shared) <= self.num_free - parked

    def allocate(self, owner: str, n: int, shared: Sequence[int] = ()) -> list[int]:
        """`n` pages for `owner`: `shared` first (their references counted), then new ones."""
        if owner in self._by_owner:
            raise ValueError(f"{owner!r} already holds pages")
        if not self.can_allocate(n, shared):
            raise OutOfPages(f"{owner!r} needs {n - len(shared)} pages, {self.num_free} free")
        for page in shared:  # taken before any eviction: a page this owner shares is never evicted for it
            if self._refs[page] == 0 and self.cache is not None:
                self.cache.unpark(page)
            self._refs[page] += 1
        pages = list(shared)
        for _ in range(n - len(shared)):
            page = self._free.popleft() if self._free else self.cache.evict()  # type: ignore[union-attr]
            self._refs[page] = 1
            pages.append(page)
        self._by_owner[owner] = pages
        return list(pages)  # the caller's copy: changing it cannot change what free() returns

    def free(self, owner: str) -> int:
        """Drop an owner's references; a page left with none is parked by the cache or returned to
        the free list. Freeing an owner with no pages is a no-op."""
        pages = self._by_owner.pop(owner, [])
        # Deepest first: parked in this order, a prompt's later pages are evicted before its first
        # ones (a page is found only through the pages before it).
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0 and not (self.cache is not None and self.cache.park(page)):
                self._free.append(page)
        return len(pages)
