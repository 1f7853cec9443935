"""The CUDA forward pass: regional `torch.compile` of the transformer blocks (compiled once,
reused by all 32 layers) and one CUDA graph per batch bucket that replays the pass (block-mask
update, embedding, steering, 31 blocks with paged FlexAttention and the last one's attention) from
static buffers. The last block's row-wise rest and the final norm run after the replay, compiled
but not captured, on the rows whose logits are read (worker/last_block.py).

Every integer input of a bucket lives in one packed device buffer, filled by a single
asynchronous copy from pinned memory: preparing a step never waits for the GPU.

Padding items of a bucket write to a scratch page that no request owns and attend only to it,
so they can never touch a real request's cache. A pass in which some item splits its attention
(FlashBlock) replays a second graph family with the split and FlashBlock's cache rows; padding
items and exact items read and write the scratch row there.

Steering is plain data in the graph (a zero vector and an out-of-range start layer when off):
turning it on or off never recompiles.

Split-KV is chosen per pass: the one- and two-item buckets also have a long-context graph whose
attention splits every item's pages (`bucket_splits`), replayed when the pass's longest item has
LONG_CONTEXT_PAGES or more; `--kv-splits S` overrides the choice with S ways at any context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from cde.kernels.flashblock import FlashBlockBatch, FlashBlockSplit, external_pages
from cde.kernels.flex_paged_attention import PagedBlockMask
from cde.kernels.paged_attention import PagedBatch
from cde.shared.config import ATTN_EXACT, MASK_ID, PAGE
from cde.worker.last_block import TAIL_VARIANTS, RowsTail, TailInputs, finish, tail_rows

if TYPE_CHECKING:
    from cde.shared.config import ModelConfig
    from cde.worker.model import SteerlingModel

# Batch sizes (items) captured; a pass runs in the smallest that holds it, its padding computed
# for nothing. Past 16 in steps of 8 (as vLLM's): 32 requests out of step (served requests arrive
# at different times) put a block's commit beside the 32 steps in ~40% of their passes, and 33
# items in a bucket of 64 would cost nearly two passes (a 32-request pass is compute-bound).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
# From which context a small batch's attention splits its pages, and how many ways per bucket size:
# one layer on the H200 (docs/benchmarks.md, kernel options) at batch 1 took 8.6 us over 5 pages
# unsplit against 20.0 split 8 ways, and 65.5 us over 64 pages against 41.2 (995.8 against 392.3
# over 1,024); the two lines cross near 26 pages. From batch 4 on, splitting did not pay (4 items
# over 1,024 pages: 1,506 us unsplit, 1,546 split 2 ways): 128 CTAs already fill the SMs.
LONG_CONTEXT_PAGES = 32
AUTO_SPLITS = {1: 8, 2: 4}


def bucket_splits(kv_splits: int, n: int, max_pages: int) -> int:
    """Split-KV ways of a pass in the bucket of n items whose longest item has max_pages pages.
    kv_splits 0 (auto): AUTO_SPLITS from LONG_CONTEXT_PAGES on, else none. kv_splits S (the
    override): S ways at batch 1, halving as the batch doubles, at any context."""
    if kv_splits:
        return max(1, kv_splits // n)
    return AUTO_SPLITS.get(n, 1) if max_pages >= LONG_CONTEXT_PAGES else 1


def bucket_split_choices(kv_splits: int, n: int, max_blocks: int) -> list[int]:
    """The split-KV ways a bucket of n items is captured with (a long-context graph only where
    the model's context reaches LONG_CONTEXT_PAGES)."""
    return sorted({bucket_splits(kv_splits, n, 1), bucket_splits(kv_splits, n, max_blocks)})


def bucket_mask(
    cfg: ModelConfig, n: int, cache_pages: int, device: torch.device | str, kv_splits: int
) -> PagedBlockMask:
    """The block mask of a bucket of n items split kv_splits ways: every pass of a model packs the
    query heads of a KV head together (kernels/flex_paged_attention.py says why, and why always)."""
    return PagedBlockMask(n, cache_pages, device, kv_splits, cfg.n_head // cfg.n_kv_heads)


@dataclass
class _Bucket:
    n: int
    split: bool  # the FlashBlock family
    kv_splits: int  # the split-KV ways of its attention
    ints: torch.Tensor  # packed by `pack`: tokens, page table, blocks, write pages, n pages, steer-from, FlashBlock
    host: torch.Tensor  # its pinned twin
    steer_vec: torch.Tensor
    mask: PagedBlockMask
    graph: torch.cuda.CUDAGraph | None = None
    out: TailInputs | None = None  # the graph's outputs
    steered: bool = False  # steer_vec may hold a non-zero row (zero again at the first unsteered pass)


def pack(
    n: int,
    tokens: list,
    blocks: list,
    write_pages: list,
    pages: list,
    steer_from: list,
    split: FlashBlockSplit | None,
    *,
    scratch_page: int,
    scratch_slot: int,
    width: int,
    no_injection: int,
) -> list[int]:
    """The host lists of len(pages) real items as one bucket of n: the rest become padding items
    that write the scratch page, attend to it alone, inject nothing and (FlashBlock family) read
    and write the scratch slot."""
    real, pad = len(pages), n - len(pages)
    if split is None:
        split = FlashBlockSplit([ATTN_EXACT] * real, [scratch_slot] * real, [scratch_slot] * real)
    flat = [t for row in tokens for t in row] + [MASK_ID] * (PAGE * pad)
    for p in pages:
        flat += [*p, *[scratch_page] * (width - len(p))]
    flat += [scratch_page] * (width * pad)
    for column, fill in (
        (blocks, 0),
        (write_pages, scratch_page),
        ([len(p) for p in pages], 1),
        (steer_from, no_injection),
        (split.modes, ATTN_EXACT),
        (split.slots, scratch_slot),
        (split.writes, scratch_slot),
    ):
        flat += list(column) + [fill] * pad
    return flat


def views(ints: torch.Tensor, n: int, width: int) -> tuple[torch.Tensor, ...]:
    """A packed bucket -> tokens, page table, blocks, write pages, n pages, steer-from, mode, slot, write slot."""
    tokens, table, rest = ints.split([n * PAGE, n * width, 7 * n])
    return (tokens.view(n, PAGE), table.view(n, width), *rest.view(7, n))


def bucket_forward(
    model: SteerlingModel,
    ints: torch.Tensor,
    n: int,
    width: int,
    steer_vec: torch.Tensor,
    mask: PagedBlockMask,
    caches: list,
    split_caches: list | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> TailInputs:
    """The pass of a packed bucket from its device buffers (what a graph captures): its tensors
    are the graph's outputs and the bucket's buffers. `split_caches`: FlashBlock's per-layer
    cache rows for the split family, else None."""
    tokens, table, blocks, write_pages, n_pages, steer_from, mode, slot, write_slot = views(ints, n, width)
    split = FlashBlockBatch(mode, slot, write_slot, []) if split_caches is not None else None
    mask.update(table, n_pages if split is None else external_pages(n_pages, mode))
    pos = blocks[:, None] * PAGE + torch.arange(PAGE, device=ints.device)
    meta = PagedBatch(write_pages, table, n_pages, [], mask, split)
    if split is not None:
        caches = [kv + fb for kv, fb in zip(caches, split_caches)]
    return model(tokens, cos[pos][:, None], sin[pos][:, None], caches, meta, steer_vec, steer_from, tokens == MASK_ID)


class GraphedForward:
    def __init__(
        self,
        model: SteerlingModel,
        cfg: ModelConfig,
        caches: list,
        cos: torch.Tensor,
        sin: torch.Tensor,
        scratch_page: int,
        scratch_slot: int,
        kv_splits: int = 0,
    ) -> None:
        self.model, self.cfg, self.caches = model, cfg, caches
        self.kv_splits = kv_splits
        self.split_caches: list[tuple] | None = None
        self.scratch, self.scratch_slot = scratch_page, scratch_slot
        self.cos, self.sin = cos, sin
        self.cache_pages = caches[0][0].shape[1]
        self.width = cfg.max_blocks
        self.device = cos.device
        self.dtype = next(model.parameters()).dtype
        # cuBLAS for every GEMM: inductor's Triton GEMM templates (chosen to fuse clip_qkv's
        # clamp) ran 4x slower than the memory-bound cuBLAS kernels at 64-token batches.
        torch._inductor.config.max_autotune_gemm_backends = "ATEN"
        # One compiled block serves every bucket and both graph families (exact, FlashBlock split);
        # the default limit of 8 variants would silently fall back to eager FlexAttention.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        for block in model.transformer.blocks:
            block.compile()
        # The graph ends with the last block's attention alone (worker/last_block.py), which must
        # run compiled too: FlexAttention has no fast eager path. The class's method: a model
        # graphed twice wraps no compiled wrapper.
        last = model.transformer.last
        last.head = torch.compile(type(last).head.__get__(last))  # type: ignore[method-assign]
        # The tail after the replay, over a row count that changes from pass to pass: compiled (the
        # eager one is ~40 small kernels), all its variants compiled by `capture_all`.
        self.rows_tail: RowsTail = torch.compile(tail_rows)
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream()
        self.buckets: dict[tuple[int, bool, int], _Bucket] = {}  # (size, FlashBlock family, kv splits)
        self.copied: torch.cuda.Event | None = None

    def _new_bucket(self, n: int, split: bool, kv_splits: int) -> _Bucket:
        size = n * (PAGE + self.width + 7)
        b = _Bucket(
            n=n,
            split=split,
            kv_splits=kv_splits,
            ints=torch.zeros(size, dtype=torch.long, device=self.device),
            host=torch.zeros(size, dtype=torch.long, pin_memory=True),
            steer_vec=torch.zeros(n, self.cfg.n_embd, dtype=self.dtype, device=self.device),
            mask=bucket_mask(self.cfg, n, self.cache_pages, self.device, kv_splits),
        )
        self._fill(b, [], [], [], [], [], None)  # all padding items
        return b

    def _run(self, b: _Bucket) -> TailInputs:
        return bucket_forward(
            self.model,
            b.ints,
            b.n,
            self.width,
            b.steer_vec,
            b.mask,
            self.caches,
            self.split_caches if b.split else None,
            self.cos,
            self.sin,
        )

    def _capture(self, b: _Bucket) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile + autotune outside the capture (dummy items only)
            for _ in range(2):
                self._run(b)
        torch.cuda.current_stream().wait_stream(side)
        b.graph = torch.cuda.CUDAGraph()
        # its own capture stream, hence its own cuBLAS workspace (worker/attribution_runner.py says why)
        with torch.cuda.graph(b.graph, pool=self.pool, stream=self.capture_stream):
            b.out = self._run(b)

    def capture_all(self, split_caches: list | None = None) -> None:
        """Capture every bucket of one family now (the FlashBlock one when `split_caches` is
        given), so no request ever waits for a compile or a capture."""
        self.split_caches = split_caches
        family = split_caches is not None
        for size in BUCKETS:
            for ways in bucket_split_choices(self.kv_splits, size, self.width):
                b = self.buckets[(size, family, ways)] = self._new_bucket(size, family, ways)
                self._capture(b)
        if not family:
            self._warm_tail()

    def _warm_tail(self) -> None:
        """Compile the tail's variants (`TAIL_VARIANTS`) on padding items' outputs."""
        for items, pages in TAIL_VARIANTS:
            out = next(b.out for (n, fam, _), b in self.buckets.items() if n == items and not fam)
            assert out is not None
            finish(self.model, out, torch.arange(pages * PAGE, device=self.device), self.rows_tail)

    def __call__(
        self,
        tokens: list,
        blocks: list,
        write_pages: list,
        pages: list,
        steer_vec: torch.Tensor | None,
        steer_from: list,
        split: FlashBlockSplit | None = None,
        split_caches: list | None = None,
        complete_tokens: Callable[[torch.Tensor], None] | None = None,
    ) -> TailInputs:
        """Host lists of N real items (steer_vec: a device tensor [N, D], None when no item steers)
        -> the pass up to the last block's attention, for `finish` (worker/last_block.py); its
        tensors are the bucket's, overwritten by its next replay. `split`: FlashBlock's modes,
        slots and write slots per item, with its per-layer cache rows. `complete_tokens`: called
        with the items' tokens in the bucket's device buffer ([N, 64]) before the replay, to
        finish them in place (worker/carried_picks.py)."""
        n = len(pages)
        self.split_caches = split_caches
        size = next((s for s in BUCKETS if s >= n), None)
        if size is None:  # a prefill burst beyond the largest bucket: run uncaptured
            b = self._new_bucket(n, split is not None, bucket_splits(self.kv_splits, n, 1))
        else:  # captured by capture_all
            ways = bucket_splits(self.kv_splits, size, max(len(p) for p in pages))
            b = self.buckets[(size, split is not None, ways)]
        self._fill(b, tokens, blocks, write_pages, pages, steer_from, split)
        if complete_tokens is not None:
            complete_tokens(views(b.ints, b.n, self.width)[0][:n])
        # An unsteered pass (the common one) queues no copy before its replay, and no fill
        # unless the bucket's last pass steered.
        if steer_vec is not None:
            b.steer_vec[:n] = steer_vec
            b.steer_vec[n:].zero_()
            b.steered = True
        elif b.steered:
            b.steer_vec.zero_()
            b.steered = False
        if b.graph is None:
            return self._run(b)
        b.graph.replay()
        return b.out.first(n)

    def _fill(
        self,
        b: _Bucket,
        tokens: list,
        blocks: list,
        write_pages: list,
        pages: list,
        steer_from: list,
        split: FlashBlockSplit | None,
    ) -> None:
        flat = pack(
            b.n,
            tokens,
            blocks,
            write_pages,
            pages,
            steer_from,
            split,
            scratch_page=self.scratch,
            scratch_slot=self.scratch_slot,
            width=self.width,
            no_injection=self.cfg.n_layers + 1,
        )
        if self.copied is not None:
            self.copied.synchronize()  # the pinned buffer may still be in flight from the last step
        # Through numpy's view of the pinned buffer: 8x faster than building a tensor of the list
        # (0.45 ms for a 32-item bucket on the CPU here), on the path from a pass's picks to the next
        # pass's launch, which the GPU waits for.
        b.host.numpy()[:] = flat
        b.ints.copy_(b.host, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
