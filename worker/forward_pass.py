"""The transformer's pass over a plan's items, and the device state it reads and writes: the paged
KV cache, the rope tables and FlashBlock's cache of external attention. On CUDA the pass runs as
the captured graph of its bucket (worker/cuda_graphs.py), elsewhere as the eager model; the CPU
tests hold a padded bucket to the eager pass (tests/worker/test_cuda_logic_cpu.py). A pass stops
after the last block's attention; `finish` then computes the final hidden states of the rows that
are read (worker/last_block.py)."""

from __future__ import annotations

import torch
from cde.kernels.flashblock import FlashBlockSplit
from cde.kernels.paged_attention import PagedBatch
from cde.shared.config import ATTN_EXACT, ATTN_REFRESH, MASK_ID, PAGE, ModelConfig
from cde.worker.carried_picks import CarriedPicks
from cde.worker.cuda_graphs import GraphedForward
from cde.worker.last_block import TailInputs, finish, tail_rows
from cde.worker.model import SteerlingModel
from cde.worker.plan import PlannedItem
from cde.worker.rope import rope_tables

Items = tuple[PlannedItem, ...]  # a plan's items


class ForwardPass:
    def __init__(
        self,
        model: SteerlingModel,
        cfg: ModelConfig,
        num_pages: int,
        max_running: int,
        cuda_graphs: bool = True,
        kv_splits: int = 0,
    ):
        self.model, self.cfg, self.max_running = model, cfg, max_running
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # Per layer (K, V), each [KVH, pages, 64, Dh]. One page more than the allocator hands out: the
        # scratch page of CUDA-graph padding items.
        shape = (cfg.n_kv_heads, num_pages + 1, PAGE, cfg.head_dim)
        self.kv = [
            tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in "kv") for _ in range(cfg.n_layers)
        ]
        self.cos, self.sin = rope_tables(cfg, cfg.max_blocks * PAGE, self.device)
        self.flashblock_cache: list[tuple] | None = None  # allocated by the first FlashBlock request
        self.graphed = None
        if self.device.type == "cuda" and cuda_graphs:
            self.graphed = GraphedForward(
                model,
                cfg,
                self.kv,
                self.cos,
                self.sin,
                scratch_page=num_pages,
                scratch_slot=max_running,
                kv_splits=kv_splits,
            )

    @torch.inference_mode()
    def allocate_flashblock_cache(self) -> None:
        """Per layer, FlashBlock's cached external attention (A, L) of every request slot, plus
        the scratch row written by items that refresh nothing. Its rows are the slots', so a
        request's cache is released with its slot."""
        cfg, rows = self.cfg, self.max_running + 1
        self.flashblock_cache = [
            (
                torch.zeros(rows, cfg.n_head, PAGE, cfg.head_dim, dtype=self.dtype, device=self.device),
                torch.zeros(rows, cfg.n_head, PAGE, dtype=torch.float32, device=self.device),
            )
            for _ in range(cfg.n_layers)
        ]
        if self.graphed is not None:  # the FlashBlock graph family, all buckets at once
            self.graphed.capture_all(self.flashblock_cache)

    def __call__(
        self,
        items: Items,
        steer_vec: torch.Tensor | None,
        steer_from: list[int],
        carried: CarriedPicks | None = None,
    ) -> TailInputs:
        """The pass up to the last block's attention, for `finish`: the items' K/V written,
        FlashBlock rows read or refreshed as their modes say."""
        split = self.split_inputs(items)
        if self.graphed is not None:
            return self.graphed(
                [it.tokens for it in items],
                [it.block for it in items],
                [it.page for it in items],
                [it.pages for it in items],
                steer_vec,
                steer_from,
                split,
                self.flashblock_cache,
                carried.into_tokens if carried is not None else None,
            )
        return self.eager(items, steer_vec, steer_from, split, carried)

    def finish(self, out: TailInputs, rows: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states [R, D] of `rows` (int64 indices into the pass's N * 64
        rows): after the graph (compiled on CUDA, not captured: their count changes from pass to pass)."""
        return finish(self.model, out, rows, self.graphed.rows_tail if self.graphed is not None else tail_rows)

    def split_inputs(self, items: Items) -> FlashBlockSplit | None:
        """FlashBlock per item: its mode, cache row read and cache row written, or None when every
        item attends exactly. Rows other than the item's own go to the scratch row."""
        if all(it.attention == ATTN_EXACT for it in items):
            return None
        scratch = self.max_running
        modes = [it.attention for it in items]
        slots = [it.slot if m != ATTN_EXACT else scratch for it, m in zip(items, modes)]
        writes = [it.slot if m == ATTN_REFRESH else scratch for it, m in zip(items, modes)]
        return FlashBlockSplit(modes, slots, writes)

    def eager(
        self,
        items: Items,
        steer_vec: torch.Tensor | None,
        steer_from: list[int],
        split: FlashBlockSplit | None,
        carried: CarriedPicks | None = None,
    ) -> TailInputs:
        dev = self.device
        if steer_vec is None:
            steer_vec = torch.zeros(len(items), self.cfg.n_embd, dtype=self.dtype, device=dev)
        tokens = torch.tensor([it.tokens for it in items], device=dev)
        if carried is not None:
            carried.into_tokens(tokens)
        abs_pos = torch.tensor([it.block for it in items], device=dev)[:, None] * PAGE + torch.arange(PAGE, device=dev)
        max_pages = max(len(it.pages) for it in items)
        paged = PagedBatch(
            write_pages=torch.tensor([it.page for it in items], device=dev),
            page_table=torch.tensor([[*it.pages, *[0] * (max_pages - len(it.pages))] for it in items], device=dev),
            n_pages=torch.tensor([len(it.pages) for it in items], device=dev),
            n_pages_host=[len(it.pages) for it in items],
        )
        caches = self.kv
        if split is not None:
            assert self.flashblock_cache is not None  # a FlashBlock request's start allocated it
            paged.flashblock = split.to_device(dev)
            caches = [kv + fb for kv, fb in zip(self.kv, self.flashblock_cache)]
        return self.model(
            tokens,
            self.cos[abs_pos][:, None],
            self.sin[abs_pos][:, None],
            caches,
            paged,
            steer_vec,
            torch.tensor(steer_from, device=dev),
            tokens == MASK_ID,
        )
