"""Input attribution in the engine: once a block of a request that asked is complete, the IG of
its tokens (worker/input_attribution.py) runs in chunks between decoding passes, and the block's
result is held back until it is done, then leaves with its `input_attribution` (so a block's
input attribution arrives in that block's event; the request's later results queue behind it).

Slicing: one chunk (at most `token_budget` tokens forwarded and back-propagated) per engine step,
and while other requests are decoding, only as often as keeps the attribution's share of the
wall time at `share`: after a chunk that took t seconds, the next one waits until the decoding
passes in between have taken t * (1 - share) / share. With nothing else to decode, chunks run
back to back. An abort drops the request's jobs and held results; a request without `inputs`
is never tracked and costs nothing. Device memory: the chunk's activations only, released to the
allocator after each chunk and returned to the device when no job is left.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from cde.shared.config import ENDOFCHUNK_ID, MASK_ID, PAGE, ModelConfig
from cde.shared.protocol import BlockResult, EngineResult, InputAttribution, InputAttributionSpec
from cde.shared.settings import INPUT_ATTRIBUTION_SHARE
from cde.worker.input_attribution import InputAttributionJob, build_targets
from cde.worker.model import SteerlingModel
from cde.worker.sequence import Sequence
from cde.worker.steering import SteeringState, prepare_steering


@dataclass
class _Entry:
    result: EngineResult
    job: InputAttributionJob | None = None
    positions: list[int] = field(default_factory=list)
    block_start: int = 0  # the block's first generated position
    commits: int = 0  # the request's commits when its block completed (scope "all")


@dataclass
class _Chunk:
    """The open `<|endofchunk|>` chunk of a request: the sum of its targets' attributions, each
    divided by its absolute mass over the scope (the official aggregate's equal vote)."""

    start: int
    total: torch.Tensor | None = None
    count: int = 0
    end: int = 0


@dataclass
class _Request:
    seq: Sequence
    spec: InputAttributionSpec
    chunking: str
    steering: SteeringState | None
    block: int  # the next block whose result is expected
    queue: deque[_Entry] = field(default_factory=deque)
    chunk: _Chunk | None = None


class InputAttributionRunner:
    def __init__(
        self,
        model: SteerlingModel,
        cfg: ModelConfig,
        token_budget: int | None = None,
        share: float = INPUT_ATTRIBUTION_SHARE,
    ) -> None:
        """token_budget: tokens per chunk (None: the device's default); share: of the wall time
        while other requests decode (EngineArgs, from the CLI's settings)."""
        self.model, self.cfg = model, cfg
        self.device = next(model.parameters()).device
        self.token_budget, self.share = token_budget, share
        self.requests: dict[str, _Request] = {}
        self._wait = 0.0  # decoding time still owed before the next chunk
        self._last = time.perf_counter()
        self.seconds = 0.0  # spent on input attribution (benchmarks)

    # ---- requests ---------------------------------------------------------------------------
    def track(self, seq: Sequence) -> None:
        attribution = seq.req.attribution
        if attribution is None or attribution.inputs is None:
            return
        steering = None
        if seq.req.steering is not None and seq.req.steering.concepts:
            steering = prepare_steering(self.model, self.cfg, seq.req.steering)
        self.requests[seq.id] = _Request(
            seq, attribution.inputs, attribution.chunking, steering, seq.prompt_len // PAGE
        )

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self.requests) and any(r.queue for r in self.requests.values())

    # ---- one engine step --------------------------------------------------------------------
    def process(self, results: list[EngineResult], decoding: bool) -> list[EngineResult]:
        """Queue the results of tracked requests (starting the job of each completed block), run
        at most one chunk, and return what may leave now, in order per request."""
        if not self.requests:  # nobody asked: nothing to do
            return results
        out: list[EngineResult] = []
        for res in results:
            req = self.requests.get(res.request_id)
            if req is None:
                out.append(res)
            elif isinstance(res, BlockResult):
                req.queue.append(self._block_entry(req, res))
            else:
                req.queue.append(_Entry(res))
        self._run_chunk(decoding)
        for rid, req in list(self.requests.items()):
            while req.queue and (req.queue[0].job is None or req.queue[0].job.done):
                entry = req.queue.popleft()
                if isinstance(entry.result, BlockResult):
                    entry.result.input_attribution = self._render(req, entry)
                out.append(entry.result)
            if not req.queue and req.seq.finish_reason is not None:
                del self.requests[rid]
                # Once, when the last one is done (never per step: emptying the cache every step made
                # each pass re-allocate through cudaMalloc, 1.1 ms per pass on the H200).
                if not self.requests and self.device.type == "cuda":
                    torch.cuda.empty_cache()
        return out

    def _run_chunk(self, decoding: bool) -> None:
        now = time.perf_counter()
        self._wait = max(self._wait - (now - self._last), 0.0) if decoding else 0.0
        self._last = now
        job = next(
            (e.job for r in self.requests.values() for e in r.queue if e.job is not None and not e.job.done), None
        )
        if job is None or self._wait > 0.0:
            return
        # While others decode, quarter-size chunks: the same share of the time in shorter stalls.
        job.step(max(1, (job.token_budget or 0) // 4) if decoding else None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        spent = time.perf_counter() - now
        self.seconds += spent
        self._last = time.perf_counter()
        self._wait = spent * (1.0 - self.share) / self.share if decoding else 0.0

    def _block_entry(self, req: _Request, res: BlockResult) -> _Entry:
        """The job of a completed block: its kept tokens (the first ones in position order;
        EOT or a stop cut the rest), each from the snapshot it was committed from."""
        block, req.block = req.block, req.block + 1
        lo, hi = block * PAGE, (block + 1) * PAGE
        kept = len(res.token_ids) if req.seq.text_tokens is None else req.seq.text_tokens
        positions = sorted(p for p, _, _ in req.seq.commits if lo <= p < hi)[:kept]
        start, commits = max(lo, req.seq.prompt_len), len(req.seq.commits)
        if not positions:
            return _Entry(res, block_start=start, commits=commits)
        targets = build_targets(req.seq.req.prompt_ids, req.seq.commits, positions, req.steering)
        job = InputAttributionJob(self.model, targets, req.spec.steps, req.steering, self.token_budget)
        return _Entry(res, job, positions, start, commits)

    # ---- results ----------------------------------------------------------------------------
    def _render(self, req: _Request, entry: _Entry) -> InputAttribution:
        """Per token, its top-k inputs by |contribution| within scope; per chunk closed by this
        block, the official aggregate_chunk (mean of the scope-normalised attributions, signed,
        highest first), top-k."""
        spec, seq, res = req.spec, req.seq, entry.result
        assert isinstance(res, BlockResult)
        prompt_len = seq.prompt_len
        ia = InputAttribution()
        if req.chunk is None:
            req.chunk = _Chunk(entry.block_start)
        if entry.job is None:
            if res.finished:
                self._close(req, ia, entry.commits, res.end_position)
            return ia
        k = spec.top_k
        for target, attr in zip(entry.job.targets, entry.job.attributions):
            a = attr.detach().float().cpu()
            snap = torch.tensor(target.snapshot)
            seen = torch.arange(len(snap)) < prompt_len
            if spec.scope == "all":
                seen |= snap != MASK_ID
            scored = torch.where(seen, a, torch.zeros_like(a))
            cand = seen.nonzero().squeeze(-1)
            order = cand[torch.argsort(scored[cand].abs(), descending=True, stable=True)][:k].tolist()
            ia.positions.append(target.position)
            ia.token_ids.append(target.token_id)
            ia.top_positions.append(order)
            ia.top_token_ids.append([int(snap[p]) for p in order])
            ia.top_scores.append([float(a[p]) for p in order])
            # the chunk aggregate
            if req.chunking == "endofchunk" and target.token_id == ENDOFCHUNK_ID:
                self._close(req, ia, entry.commits, target.position, marker=True)
                req.chunk = _Chunk(target.position + 1)
                continue
            scope_vals = scored  # zero outside the scope
            norm = scope_vals / scope_vals.abs().sum().clamp(min=1e-8)
            c = req.chunk
            if c.total is None:
                c.total = norm
            else:
                n = max(len(c.total), len(norm))
                c.total = F.pad(c.total, (0, n - len(c.total))) + F.pad(norm, (0, n - len(norm)))
            c.count += 1
            c.end = target.position + 1
        if req.chunking == "block" or res.finished:
            # Where EOT ended the generation, the reference's last chunk ends at it (the positions
            # left masked before it count nowhere: the aggregate averages the committed tokens).
            self._close(req, ia, entry.commits, res.end_position if res.finished else None)
        return ia

    def _close(
        self, req: _Request, ia: InputAttribution, commits: int, end: int | None = None, marker: bool = False
    ) -> None:
        """Close the open chunk at `end` (a `marker`'s position, where EOT ended the generation, or
        after its last token), as the concept chunks are cut (shared/chunk_attribution.py's
        chunk_spans): a chunk before a marker even when empty; another only when it holds
        positions. A chunk without tokens aggregates nothing, as the reference's aggregate_chunk
        over none. `commits`: the request's commits when the closing block completed."""
        c, req.chunk = req.chunk, None
        if c is None:
            return
        end = (c.end if c.count else c.start) if end is None else end
        if end < c.start or (end == c.start and not marker):
            return
        ia.chunk_spans.append([c.start, end])
        if c.total is None:
            ia.chunk_positions.append([])
            ia.chunk_token_ids.append([])
            ia.chunk_scores.append([])
            return
        committed = {p: t for p, t, _ in req.seq.commits[:commits]}
        prompt = req.seq.req.prompt_ids
        scope = list(range(len(prompt)))
        if req.spec.scope == "all":  # every generated position, as the official aggregate: diffusion
            scope += sorted(committed)  # commits out of order, so the chunk's tokens saw some after it
        mean: torch.Tensor = c.total / c.count
        vals = torch.tensor([float(mean[p]) if p < len(mean) else 0.0 for p in scope])
        order = torch.argsort(vals, descending=True, stable=True)[: req.spec.top_k].tolist()
        ia.chunk_positions.append([scope[i] for i in order])
        ia.chunk_token_ids.append([prompt[scope[i]] if scope[i] < len(prompt) else committed[scope[i]] for i in order])
        ia.chunk_scores.append([float(vals[i]) for i in order])
