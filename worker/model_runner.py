"""The one place where device tensors live: weights, the paged KV cache, rope tables and the
per-request device state (repetition-penalty token sets, steering vectors). Turns a scheduled
batch into tensors, runs the forward pass, and returns the chosen positions and tokens with a
single device-to-host copy per step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.flashblock import FlashBlockBatch
from kernels.paged_attention import PagedBatch
from shared.config import ATTN_EXACT, ATTN_REFRESH, EOS_ID, MASK_ID, PAD_ID, PAGE, ModelConfig
from worker.attribution import attribute, unpack
from worker.cuda_graphs import GraphedForward
from worker.model import SteerlingModel, rope_tables
from worker.sampler import SamplingBatch, select_and_sample
from worker.scheduler import Batch, Item
from worker.sequence import Sequence
from worker.steering import SteeringState, alpha_now, prepare_steering


class ModelRunner:
    def __init__(self, model: SteerlingModel, cfg: ModelConfig, num_pages: int, max_running: int,
                 cuda_graphs: bool = True):
        self.model, self.cfg = model, cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # Per layer (K, V), each [KVH, pages, 64, Dh]. One page more than the allocator hands out: the scratch page of CUDA-graph padding items.
        shape = (cfg.n_kv_heads, num_pages + 1, PAGE, cfg.head_dim)
        self.kv = [tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in "kv")
                   for _ in range(cfg.n_layers)]
        self.cos, self.sin = rope_tables(cfg, cfg.max_blocks * PAGE, self.device)
        self.max_running = max_running
        self.flashblock_cache: list[tuple] | None = None  # allocated by the first FlashBlock request
        self.seen = torch.zeros(max_running, cfg.vocab_size, dtype=torch.bool, device=self.device)
        self.steering: dict[int, SteeringState] = {}
        self.banned = torch.tensor([EOS_ID, MASK_ID, PAD_ID], device=self.device)
        # The vocabulary (100281) is odd; padded to a multiple of 128 rows the LM head runs on
        # the tensor-core GEMM kernels instead of a slow unaligned fallback.
        self.lm_head = model.transformer.lm_head.weight
        if self.device.type == "cuda":
            self.lm_head = F.pad(self.lm_head, (0, 0, 0, -cfg.vocab_size % 128))
        self.graphed = None
        self._attribute_fn = attribute
        if self.device.type == "cuda" and cuda_graphs:
            # The chunked top-k loops fuse into a few kernels instead of hundreds of launches.
            self._attribute_fn = torch.compile(attribute, dynamic=True)
            self.graphed = GraphedForward(model, cfg, self.kv, self.cos, self.sin, scratch_page=num_pages,
                                          scratch_slot=max_running)
        self.attribution: list[list[dict] | None] = []  # per step item of the last execute()

    # ---- per-request state ------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, seq: Sequence) -> None:
        self.seen[seq.slot] = False
        if seq.req.repetition_penalty != 1.0 and seq.req.prompt_ids:
            self.seen[seq.slot, torch.tensor(seq.req.prompt_ids, device=self.device)] = True
        self.steering.pop(seq.slot, None)
        if seq.req.steering is not None:
            self.steering[seq.slot] = prepare_steering(self.model, self.cfg, seq.req.steering)
        if seq.req.flashblock and self.flashblock_cache is None:
            self._allocate_flashblock_cache()

    def _allocate_flashblock_cache(self) -> None:
        """Per layer, FlashBlock's cached external attention (A, L) of every request slot, plus
        the scratch row written by items that refresh nothing. Its rows are the slots', so a
        request's cache is released with its slot."""
        cfg, rows = self.cfg, self.max_running + 1
        self.flashblock_cache = [
            (torch.zeros(rows, cfg.n_head, PAGE, cfg.head_dim, dtype=self.dtype, device=self.device),
             torch.zeros(rows, cfg.n_head, PAGE, dtype=torch.float32, device=self.device))
            for _ in range(cfg.n_layers)
        ]

    # ---- one forward pass -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[tuple[list[int], list[int]]]:
        items = batch.items
        dev = self.device
        steer_vec, steer_from = self._steering_inputs(items)
        split = self._split_inputs(items)
        if self.graphed is not None:
            hidden = self.graphed([it.tokens for it in items], [it.block for it in items],
                                  [it.page for it in items], [it.pages for it in items], steer_vec, steer_from,
                                  split, self.flashblock_cache)
        else:
            hidden = self._forward_eager(items, steer_vec, steer_from, split)
        steps = [i for i, it in enumerate(items) if it.step]
        if not steps:
            return []
        step_seqs = [items[i].seq for i in steps]
        rows, grid, row_item = self._eligible_rows(steps, step_seqs)
        h_rows = hidden.reshape(-1, self.cfg.n_embd)[torch.tensor(rows, device=dev)]
        logits = F.linear(h_rows, self.lm_head)[:, : self.cfg.vocab_size]
        sb = self._sampling_batch(step_seqs, grid, row_item)
        positions, chosen, valid = select_and_sample(logits, sb)
        if sb.rep_penalty is not None:
            slots = torch.tensor([s.slot for s in step_seqs], device=dev)[:, None].expand_as(chosen)
            self.seen[slots[valid], chosen[valid]] = True
        picks = torch.stack([positions, chosen, valid.long()])
        attributed = [n for n, s in enumerate(step_seqs) if s.req.attribution is not None]
        if not attributed:
            self.attribution = [None] * len(steps)
            host = picks.cpu().tolist()  # the one D2H copy
        else:
            packed = self._attribute(hidden, steps, attributed, logits, sb.grid, positions, chosen)
            # One D2H copy for picks and attribution (float64 holds the small ints exactly).
            flat = torch.cat([picks.flatten().double(), packed.flatten()]).cpu()
            host = flat[: picks.numel()].long().reshape(picks.shape).tolist()
            rows = flat[picks.numel():].reshape(len(attributed), positions.shape[1], -1).tolist()
            self.attribution = self._records(batch, steps, attributed, host, rows)
        return [
            ([p for p, ok in zip(pos, ok_row) if ok], [t for t, ok in zip(tok, ok_row) if ok])
            for pos, tok, ok_row in zip(*host)
        ]

    def _split_inputs(self, items: list[Item]) -> tuple[list[int], list[int], list[int]] | None:
        """FlashBlock per item: (mode, cache row read, cache row written), or None when every
        item attends exactly. Rows other than the item's own go to the scratch row."""
        if all(it.attention == ATTN_EXACT for it in items):
            return None
        scratch = self.max_running
        modes = [it.attention for it in items]
        slots = [it.seq.slot if m != ATTN_EXACT else scratch for it, m in zip(items, modes)]
        writes = [it.seq.slot if m == ATTN_REFRESH else scratch for it, m in zip(items, modes)]
        return modes, slots, writes

    def _forward_eager(self, items: list[Item], steer_vec, steer_from, split) -> torch.Tensor:
        dev = self.device
        tokens = torch.tensor([it.tokens for it in items], device=dev)
        abs_pos = torch.tensor([it.block for it in items], device=dev)[:, None] * PAGE + torch.arange(PAGE, device=dev)
        max_pages = max(len(it.pages) for it in items)
        paged = PagedBatch(
            write_pages=torch.tensor([it.page for it in items], device=dev),
            page_table=torch.tensor([it.pages + [0] * (max_pages - len(it.pages)) for it in items], device=dev),
            n_pages=torch.tensor([len(it.pages) for it in items], device=dev),
            n_pages_host=[len(it.pages) for it in items],
        )
        caches = self.kv
        if split is not None:
            modes, slots, writes = split
            t = lambda xs: torch.tensor(xs, device=dev)  # noqa: E731
            paged.flashblock = FlashBlockBatch(t(modes), t(slots), t(writes), modes)
            caches = [kv + fb for kv, fb in zip(self.kv, self.flashblock_cache)]
        return self.model(tokens, self.cos[abs_pos][:, None], self.sin[abs_pos][:, None], caches, paged,
                          steer_vec, steer_from, tokens == MASK_ID)

    def _attribute(self, hidden, steps, attributed, logits, grid, positions, chosen) -> torch.Tensor:
        """Attribution of every selection slot of the items that asked, in one batched pass:
        [A * K, width]. Slots that commit nothing are computed too (static shapes, no sync) and
        dropped on the host."""
        a = torch.tensor(attributed, device=self.device)
        pos, tok = positions[a], chosen[a]  # [A, K]
        rows = torch.tensor(steps, device=self.device)[a][:, None] * PAGE + pos
        h = hidden.reshape(-1, self.cfg.n_embd)[rows.reshape(-1)]
        target = logits[grid[a].gather(1, pos).clamp(min=0).reshape(-1), tok.reshape(-1)]
        return self._attribute_fn(self.model, self.cfg, h, tok.reshape(-1), target)

    def _records(self, batch, steps, attributed, host, rows) -> list[list[dict] | None]:
        """Per step item: the wire records of the tokens it committed (None: not asked)."""
        out: list[list[dict] | None] = [None] * len(steps)
        for n, packed_rows in zip(attributed, rows):
            item = batch.items[steps[n]]
            out[n] = [
                {"token_id": tok, "position": item.block * PAGE + pos, "step": item.seq.step, **unpack(row, self.cfg)}
                for pos, tok, ok, row in zip(host[0][n], host[1][n], host[2][n], packed_rows) if ok
            ]
        return out

    def _steering_inputs(self, items: list[Item]) -> tuple[torch.Tensor, torch.Tensor]:
        vec = torch.zeros(len(items), self.cfg.n_embd, dtype=self.dtype, device=self.device)
        start = [self.cfg.n_layers + 1] * len(items)  # past the last layer: no injection
        for i, it in enumerate(items):
            state = self.steering.get(it.seq.slot)
            if it.step and state is not None:
                alpha = alpha_now(state, it.seq.committed)
                if alpha != 0.0:
                    vec[i] = alpha * state.direction
                    start[i] = state.inject_layer
        return vec, torch.tensor(start, device=self.device)

    @staticmethod
    def _eligible_rows(steps: list[int], seqs: list[Sequence]):
        """The positions that get logits: every still-masked position of each step item that may
        be unmasked. Returns their rows in the flattened hidden states, the [S, 64] grid mapping a
        position to its logits row (-1: none) and the step item of each row."""
        rows, grid, row_item = [], [], []
        for n, (i, seq) in enumerate(zip(steps, seqs)):
            line = []
            for p, ok in enumerate(seq.eligible()):
                line.append(len(rows) if ok else -1)
                if ok:
                    rows.append(i * PAGE + p)
                    row_item.append(n)
            grid.append(line)
        return rows, grid, row_item

    def _sampling_batch(self, seqs: list[Sequence], grid, row_item) -> SamplingBatch:
        dev, reqs = self.device, [s.req for s in seqs]
        t = lambda xs, dt=None: torch.tensor(xs, device=dev, dtype=dt)  # noqa: E731
        thresholds = [r.confidence_threshold for r in reqs]
        rep = [r.repetition_penalty for r in reqs]
        penalized = any(x != 1.0 for x in rep)
        relu = [self.steering[s.slot].relu_mask if s.slot in self.steering else None for s in seqs]
        vocab = self.cfg.vocab_size
        return SamplingBatch(
            grid=t(grid),
            row_item=t(row_item),
            n_select=t([r.tokens_per_step for r in reqs]),
            threshold=t([2.0 if x is None else x for x in thresholds], torch.float32),
            temperature=t([r.temperature for r in reqs], torch.float32),
            top_p=t([r.top_p for r in reqs], torch.float32),
            top_k=t([r.top_k for r in reqs]),
            entropy=t([r.entropy_sampling for r in reqs]),
            seed=t([r.seed & 0xFFFFFFFF for r in reqs]),
            step=t([s.step for s in seqs]),
            banned=self.banned,
            max_select=PAGE if any(x is not None for x in thresholds) else max(r.tokens_per_step for r in reqs),
            any_sampling=any(r.entropy_sampling or (r.temperature > 0 and r.top_p > 0) for r in reqs),
            rep_penalty=t(rep, torch.float32) if penalized else None,
            seen=self.seen[[s.slot for s in seqs]] if penalized else None,
            relu_mask=(torch.stack([m if m is not None else torch.zeros(vocab, device=dev) for m in relu])
                       if any(m is not None for m in relu) else None),
        )
