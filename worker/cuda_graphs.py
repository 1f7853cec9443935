"""The CUDA forward pass: regional `torch.compile` of the transformer blocks (compiled once,
reused by all 32 layers) and one CUDA graph per batch bucket that replays the whole pass
(embedding, steering, 32 blocks with paged FlexAttention, final norm) from static buffers.

Padding items of a bucket write to a scratch page that no request owns and attend only to it,
so they can never touch a real request's cache. A pass in which some item splits its attention
(FlashBlock) replays a second graph family with the split and FlashBlock's cache rows; padding
items and exact items read and write the scratch row there. Steering is plain data in the graph (a zero
vector and an out-of-range start layer when off): turning it on or off never recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.flashblock import FlashBlockBatch, external_pages
from kernels.flex_paged_attention import PagedBlockMask
from kernels.paged_attention import PagedBatch
from shared.config import ATTN_EXACT, MASK_ID, PAGE

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Bucket:
    n: int
    tokens: torch.Tensor
    blocks: torch.Tensor
    write_pages: torch.Tensor
    page_table: torch.Tensor
    n_pages: torch.Tensor
    steer_vec: torch.Tensor
    steer_from: torch.Tensor
    mask: PagedBlockMask
    split: FlashBlockBatch | None = None
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None


class GraphedForward:
    def __init__(self, model, cfg, caches, cos, sin, scratch_page: int, scratch_slot: int):
        self.model, self.cfg, self.caches = model, cfg, caches
        self.split_caches: list[tuple] | None = None
        self.scratch_slot = scratch_slot
        self.cos, self.sin = cos, sin
        self.scratch = scratch_page
        self.cache_pages = caches[0][0].shape[1]
        self.device = cos.device
        self.dtype = next(model.parameters()).dtype
        # cuBLAS for every GEMM: inductor's Triton GEMM templates (chosen to fuse clip_qkv's
        # clamp) ran 4x slower than the memory-bound cuBLAS kernels at 64-token batches.
        torch._inductor.config.max_autotune_gemm_backends = "ATEN"
        for block in model.transformer.blocks:
            block.compile()
        self.pool = torch.cuda.graph_pool_handle()
        self.buckets: dict[tuple[int, bool], _Bucket] = {}

    def _new_bucket(self, n: int, split: bool) -> _Bucket:
        dev, cfg = self.device, self.cfg
        b = _Bucket(
            n=n,
            tokens=torch.full((n, PAGE), MASK_ID, dtype=torch.long, device=dev),
            blocks=torch.zeros(n, dtype=torch.long, device=dev),
            write_pages=torch.full((n,), self.scratch, dtype=torch.long, device=dev),
            page_table=torch.full((n, cfg.max_blocks), self.scratch, dtype=torch.long, device=dev),
            n_pages=torch.ones(n, dtype=torch.long, device=dev),
            steer_vec=torch.zeros(n, cfg.n_embd, dtype=self.dtype, device=dev),
            steer_from=torch.full((n,), cfg.n_layers + 1, dtype=torch.long, device=dev),
            mask=PagedBlockMask(n, self.cache_pages, dev),
        )
        if split:
            scratch = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
            b.split = FlashBlockBatch(torch.full((n,), ATTN_EXACT, dtype=torch.long, device=dev),
                                      scratch, scratch.clone(), [])
        b.mask.update(b.page_table, b.n_pages)
        return b

    def _run(self, b: _Bucket) -> torch.Tensor:
        pos = b.blocks[:, None] * PAGE + torch.arange(PAGE, device=self.device)
        meta = PagedBatch(b.write_pages, b.page_table, b.n_pages, [], b.mask.block_mask, b.split)
        caches = self.caches if b.split is None else [kv + fb for kv, fb in zip(self.caches, self.split_caches)]
        return self.model(b.tokens, self.cos[pos][:, None], self.sin[pos][:, None], caches, meta,
                          b.steer_vec, b.steer_from, b.tokens == MASK_ID)

    def _capture(self, b: _Bucket) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile + autotune outside the capture (dummy items only)
            for _ in range(2):
                self._run(b)
        torch.cuda.current_stream().wait_stream(side)
        b.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.graph, pool=self.pool):
            b.out = self._run(b)

    def __call__(self, tokens, blocks, write_pages, pages, steer_vec, steer_from, split=None,
                 split_caches=None) -> torch.Tensor:
        """Host lists/tensors of N real items -> hidden [N, 64, D]. `split`: FlashBlock's
        (modes, slots, write slots) per item, with its per-layer cache rows."""
        n = len(pages)
        self.split_caches = split_caches
        size = next((s for s in BUCKETS if s >= n), None)
        key = (size, split is not None)
        if size is None:
            b = self._new_bucket(n, split is not None)  # a prefill burst beyond the largest bucket: run uncaptured
        elif key in self.buckets:
            b = self.buckets[key]
        else:
            b = self.buckets[key] = self._new_bucket(size, split is not None)
            self._capture(b)
        self._fill(b, n, tokens, blocks, write_pages, pages, steer_vec, steer_from, split)
        if b.graph is None:
            return self._run(b)
        b.graph.replay()
        return b.out[:n]

    def _fill(self, b: _Bucket, n, tokens, blocks, write_pages, pages, steer_vec, steer_from, split) -> None:
        """Copy N real items into the bucket's static buffers; the rest become padding items."""
        pad, width, scratch = b.n - n, b.page_table.shape[1], self.scratch
        b.tokens.copy_(torch.tensor(list(tokens) + [[MASK_ID] * PAGE] * pad))
        b.blocks.copy_(torch.tensor(list(blocks) + [0] * pad))
        b.write_pages.copy_(torch.tensor(list(write_pages) + [scratch] * pad))
        b.page_table.copy_(torch.tensor([p + [scratch] * (width - len(p)) for p in pages] + [[scratch] * width] * pad))
        b.n_pages.copy_(torch.tensor([len(p) for p in pages] + [1] * pad))
        b.steer_vec.zero_()
        b.steer_vec[:n] = steer_vec
        b.steer_from.fill_(self.cfg.n_layers + 1)
        b.steer_from[:n] = steer_from
        if split is None:
            b.mask.update(b.page_table, b.n_pages)
            return
        modes, slots, writes = split
        b.split.mode.copy_(torch.tensor(list(modes) + [ATTN_EXACT] * pad))
        b.split.slot.copy_(torch.tensor(list(slots) + [self.scratch_slot] * pad))
        b.split.write_slot.copy_(torch.tensor(list(writes) + [self.scratch_slot] * pad))
        b.mask.update(b.page_table, external_pages(b.n_pages, b.split.mode))
