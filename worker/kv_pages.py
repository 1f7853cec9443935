"""Page allocator of the paged KV cache (pure Python; the tensors live in the model runner).

A page holds the K/V of one 64-token block of one request in every layer. A request reserves
all the pages its prompt and `max_tokens` can fill when it is admitted, so a running request can
never run out of pages mid-generation and nothing is ever evicted behind its back.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._by_owner: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: str, n: int) -> list[int]:
        if owner in self._by_owner:
            raise ValueError(f"{owner!r} already holds pages")
        if n > len(self._free):
            raise OutOfPages(f"{owner!r} needs {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._by_owner[owner] = pages
        return list(pages)  # the caller's copy: changing it cannot change what free() returns

    def free(self, owner: str) -> int:
        """Return an owner's pages to the free list; freeing an owner with no pages is a no-op."""
        pages = self._by_owner.pop(owner, [])
        self._free.extend(pages)
        return len(pages)
