"""Prefix caching: the K/V pages of full 64-token prompt blocks, computed once and shared read-only by
every running request whose prompt starts with the same tokens (pure Python; the allocator in
worker/kv_pages.py holds the reference counts).

Why a page can be shared: attention is block-causal, so the K/V of prompt block b depend only on
the token ids of blocks 0..b (the key: a hash chain, shared/prefix_hash.py, rooted in the model,
dtype and quantization). Nothing else reaches them: steering is injected only at masked positions
and only in denoising steps, FlashBlock changes how a step attends, not what a prefill writes, and
attribution (token and input) reads the step's hidden states or re-runs the prompt's token ids,
never a prompt page. So steered, unsteered and attributed requests share the same pages.

What is never shared: the block holding the prompt's tail is the first decode block (its pages hold
masks, then generated tokens), and later blocks are generated; only `shareable_pages` are keyed.

A prompt whose full pages are all cached needs no prefill at all: its first step attends to them
like to pages it wrote itself (the first decode block is computed by the step, never read from a
page), so there is no "last page's logits" to recompute.

A page's life: registered (pending) when the request that will write it is admitted, written once
the pass that prefills it has run (the scheduler says so after the pass's picks, so only later
passes read it), then held while any running request refers to it. Unreferenced and written, it is
parked: still found by later requests, and free-able (the allocator evicts the least recently
parked when its free list runs out, deepest pages of a prompt first). Unreferenced and never
written (its request ended before its prefill ran), it is forgotten at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cde.shared.config import PAGE
from cde.shared.prefix_hash import page_keys


def shareable_pages(prompt_len: int) -> int:
    """Full prompt pages only: the page of the prompt's tail is written with generated tokens."""
    return prompt_len // PAGE


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0  # tokens of the full prompt pages of admitted requests
    hit_tokens: int = 0  # of them, in pages the request found written instead of prefilling
    evictions: int = 0  # parked pages taken back by the allocator


@dataclass
class _Entry:
    key: bytes
    page: int
    written: bool = False


class PrefixCache:
    def __init__(self, namespace: str) -> None:
        """namespace: what the K/V depend on besides the token ids (model, dtype, quantization)."""
        self.namespace = namespace
        self.enabled = True  # off: no key is looked up or registered (the benchmark's cache-off phase)
        self.stats = PrefixCacheStats()
        self._by_key: dict[bytes, _Entry] = {}
        self._by_page: dict[int, _Entry] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()  # least recently parked first

    @property
    def pages_held(self) -> int:
        """Pages the cache knows, referenced or parked (at most the allocator's pages)."""
        return len(self._by_page)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def keys(self, prompt_ids: list[int]) -> list[bytes]:
        if not self.enabled:
            return []
        return page_keys(prompt_ids, shareable_pages(len(prompt_ids)), self.namespace)

    def match(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest registered prefix of `keys` (written or still pending)."""
        pages = []
        for key in keys:
            entry = self._by_key.get(key)
            if entry is None:
                break
            pages.append(entry.page)
        return pages

    def admitted(self, keys: list[bytes], pages: list[int]) -> None:
        """A request got `pages`: its full prompt pages not matched become findable (pending). A key
        already registered (a page whose parent was evicted first) leaves the new page private."""
        self.stats.query_tokens += len(keys) * PAGE
        for key, page in zip(keys, pages):
            if key not in self._by_key:
                entry = _Entry(key, page)
                self._by_key[key] = self._by_page[page] = entry

    def is_written(self, page: int) -> bool:
        entry = self._by_page.get(page)
        return entry is not None and entry.written

    def written(self, page: int) -> None:
        """The pass that prefilled `page` has run (a page forgotten meanwhile is left alone)."""
        entry = self._by_page.get(page)
        if entry is not None:
            entry.written = True

    # ---- the allocator's side ---------------------------------------------------------------
    def park(self, page: int) -> bool:
        """`page` lost its last reference: True when the cache keeps it (written), False when it
        goes back to the free list (never cached, or never written: then forgotten)."""
        entry = self._by_page.get(page)
        if entry is None:
            return False
        if not entry.written:
            self._forget(entry)
            return False
        self._parked[page] = None
        return True

    def unpark(self, page: int) -> None:
        self._parked.pop(page, None)

    def evict(self) -> int:
        """The least recently parked page, forgotten, for the allocator to hand out."""
        page, _ = self._parked.popitem(last=False)
        self._forget(self._by_page[page])
        self.stats.evictions += 1
        return page

    def _forget(self, entry: _Entry) -> None:
        del self._by_key[entry.key], self._by_page[entry.page]
