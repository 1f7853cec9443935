"""Per-request scheduler (pure Python, no torch).

Every engine iteration builds one forward pass out of *items*, each a 64-token block of one
request: prefill blocks of newly admitted prompts, the commit of a block that just finished, and
one denoising step of every running request's active block. Requests advance independently: one
that finishes a block commits it in the very pass that takes the first step of its next block,
while the others keep denoising; new requests join between any two steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cde.shared.config import ATTN_EXACT, MASK_ID, PAGE
from cde.shared.packed_attribution import PackedAttribution
from cde.shared.protocol import BlockResult, EngineResult, GenerateRequest, PrefixResult, StepResult
from cde.shared.stops import find_stop
from cde.worker.fair_share import FairShare
from cde.worker.kv_pages import PageAllocator
from cde.worker.prefix_cache import PrefixCache
from cde.worker.sequence import Sequence, Status


@dataclass
class Item:
    seq: Sequence
    block: int  # absolute block index
    tokens: list[int]  # 64 ids
    page: int  # page the item's K/V are written to
    pages: list[int]  # pages attended: blocks 0..block of the request
    is_step: bool  # a denoising step (logits, selection) vs a prefill/commit write
    attention: int = ATTN_EXACT  # ATTN_* (shared/config.py): FlashBlock's split and reuse


@dataclass
class Batch:
    items: list[Item] = field(default_factory=list)

    @property
    def step_items(self) -> list[Item]:
        """The denoising steps of the pass, in pass order (the order of its picks)."""
        return [it for it in self.items if it.is_step]


@dataclass
class Scheduled:
    """What `Scheduler.schedule` returns: the next forward pass, and the sequences admitted for
    it (the runner sets up their per-request device state before the pass launches)."""

    batch: Batch
    admitted: list[Sequence]


@dataclass
class Picks:
    """What one step item unmasked: positions within its block (most confident first) and the
    token placed at each."""

    positions: list[int]
    tokens: list[int]
    # Requests with logprobs: per pick (logprob, top ids, top logprobs), worker/logprobs.py.
    logprobs: list[tuple[float, list[int], list[float]]] | None = None


@dataclass
class _Awaiting:
    """One step item of the last `update`, whose results wait for the pass's attribution."""

    index: int  # the item's place in batch.step_items (and in the list `attach` receives)
    request_id: str
    placed: int  # picks the step kept (the others were after EOT or refused by a grammar)
    step_result: StepResult | None  # sent for this step (stream_denoise), if any
    block_result: BlockResult | None  # the block this step completed, if any
    kept: set[int] | None  # that block's positions whose tokens it keeps
    earlier: list[PackedAttribution]  # that block's attribution from its earlier steps


class Scheduler:
    def __init__(
        self,
        num_pages: int,
        max_running: int,
        max_items: int,
        eot_id: int | None,
        decode: Callable[[list[int]], str],
        max_running_per_client: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.prefix_cache = prefix_cache
        self.pages = PageAllocator(num_pages, prefix_cache)
        self.fair = FairShare(max_running_per_client)
        self.max_running = max_running
        self.max_items = max_items
        self.eot_id = eot_id
        self.decode = decode  # token ids -> text, for stop strings
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_running - 1, -1, -1))
        self.block_attribution: dict[str, list[PackedAttribution]] = {}  # request id -> its active block's
        self._awaiting: list[_Awaiting] = []  # update() -> attach(): the last pass's results that want attribution

    # ---- requests in / out --------------------------------------------------------------
    def add(self, req: GenerateRequest) -> Sequence:
        seq = Sequence(req, None if req.ignore_eos else self.eot_id)  # ignore_eos: EOT is a plain token
        if seq.n_blocks > self.pages.num_pages:
            raise ValueError(f"request needs {seq.n_blocks} KV pages, the cache has {self.pages.num_pages}")
        if self.prefix_cache is not None:
            seq.page_keys = self.prefix_cache.keys(req.prompt_ids)
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.id == request_id:
                self.waiting.remove(seq)
                seq.status = Status.FINISHED
                return True
        for seq in self.running:
            if seq.id == request_id:
                self._finish(seq, "abort")
                return True
        return False

    def fail(self, seq: Sequence) -> bool:
        """End a running request with an error (its pass could not be built); False when it had
        already finished."""
        if seq.status is not Status.RUNNING:
            return False
        self._finish(seq, "error")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule -------------------------------------------------------------------------
    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and self._free_slots:
            seq = self.fair.pick(self.waiting)
            if seq is None:
                break
            shared = self.prefix_cache.match(seq.page_keys) if self.prefix_cache is not None else []
            # The chosen one waits for pages rather than be passed by smaller ones: no starvation.
            if not self.pages.can_allocate(seq.n_blocks, shared):
                break
            self.waiting.remove(seq)
            self.fair.admitted(seq)
            seq.pages = self.pages.allocate(seq.id, seq.n_blocks, shared)
            if self.prefix_cache is not None:
                self.prefix_cache.admitted(seq.page_keys, seq.pages)
            seq.slot = self._free_slots.pop()
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def schedule(self) -> Scheduled:
        """The next forward pass and the sequences admitted for it."""
        admitted = self._admit()
        batch = Batch()
        budget = self.max_items
        # Steps first: a running request is never starved by a long prefill.
        for seq in self.running:
            if not seq.prefill_done:
                continue
            need = 2 if seq.pending_commit else 1
            if budget < need and batch.items:
                break
            if seq.pending_commit:
                block, tokens = seq.pending_commit
                batch.items.append(self._item(seq, block, tokens, is_step=False))
                seq.pending_commit = None
            batch.items.append(self._item(seq, seq.block, seq.tokens, is_step=True))
            budget -= need
        # Then prefill chunks; a prompt whose last full block goes in now also takes its first step.
        # A page another request wrote in an earlier pass is skipped (prefix cache); one another
        # request writes in this pass is waited for: read in the same pass, it would be garbage if
        # its writer's items were dropped (worker/isolation.py).
        writing: set[int] = set()
        for seq in self.running:
            if seq.prefill_done:
                continue  # stepped above, or left for the next pass when the budget ran out
            while not seq.prefill_done and budget > 0:
                block = seq.prefilled
                page = seq.pages[block]
                if self.prefix_cache is not None and self.prefix_cache.is_written(page):
                    seq.cached_pages += 1
                    self.prefix_cache.stats.hit_tokens += PAGE
                elif page in writing:
                    break
                else:
                    writing.add(page)
                    batch.items.append(self._item(seq, block, seq.prompt_block(block), is_step=False))
                    budget -= 1
                seq.prefilled += 1
            if seq.prefill_done and budget > 0:
                batch.items.append(self._item(seq, seq.block, seq.tokens, is_step=True))
                budget -= 1
        return Scheduled(batch, admitted)

    @staticmethod
    def _item(seq: Sequence, block: int, tokens: list[int], is_step: bool) -> Item:
        # Prefill and commit items always attend exactly: the K/V they write are final.
        mode = seq.next_attention_mode() if is_step else ATTN_EXACT
        return Item(seq, block, tokens, seq.pages[block], seq.pages[: block + 1], is_step, mode)

    # ---- update ---------------------------------------------------------------------------
    def update(self, batch: Batch, picks: list[Picks]) -> list[EngineResult]:
        """Apply the picks of each step item, in batch.step_items order.
        Requests that stream the denoising get a StepResult per step, before their BlockResult;
        requests that stream tokens a PrefixResult when a step grew their block's committed left
        prefix without completing the block (whose BlockResult then carries the rest).
        The results of requests that asked for attribution get it from `attach`, which the
        engine calls once the pass's attribution has reached the host."""
        results: list[EngineResult] = []
        self._awaiting = []
        if self.prefix_cache is not None:  # the pass has run: later passes may read what it prefilled
            for item in batch.items:
                if not item.is_step and item.block < item.seq.n_prompt_blocks:
                    self.prefix_cache.written(item.page)
        for n, (item, pick) in enumerate(zip(batch.step_items, picks)):
            seq, positions, tokens = item.seq, pick.positions, pick.tokens
            if seq.status is not Status.RUNNING:
                continue  # aborted while its step was in flight
            seq.step += 1
            if pick.logprobs is not None:
                seq.block_logprobs.update(zip(positions, pick.logprobs))
            ended_by_eot = seq.place(positions, tokens)
            if positions and seq.last_unmasked == 0:  # a grammar refused its own bitmask's pick
                results.append(BlockResult(seq.id, [], True, "error", error="the grammar refused the constrained pick"))
                self._finish(seq, "error")
                continue
            step_result = block_result = kept = None
            earlier: list[PackedAttribution] = []  # a completed block's attribution from its earlier steps
            if seq.req.stream_denoise:
                step_result = self._step_result(seq, positions, tokens)
                results.append(step_result)
            if seq.req.stream_tokens and not (ended_by_eot or seq.block_done()):
                prefix = self._prefix_result(seq)
                if prefix is not None:
                    results.append(prefix)
            if ended_by_eot or seq.block_done():
                earlier = self.block_attribution.pop(seq.id, [])
                block_result, kept = self._complete_block(seq, ended_by_eot)
                results.append(block_result)
            if seq.req.attribution is not None:
                self._awaiting.append(_Awaiting(n, seq.id, seq.last_unmasked, step_result, block_result, kept, earlier))
        return results

    def attach(self, attribution: list[PackedAttribution | None]) -> None:
        """The attribution of the last update's pass, per step item (packed arrays): kept with the
        request's active block, and given to the results that update() returned for it."""
        for waiting in self._awaiting:
            records = attribution[waiting.index].head(waiting.placed)
            if waiting.step_result is not None:
                waiting.step_result.attribution = records
            if waiting.block_result is None:
                self.block_attribution.setdefault(waiting.request_id, []).append(records)
            else:
                block = PackedAttribution.join([*waiting.earlier, records])
                waiting.block_result.attribution = block.kept(waiting.kept)
        self._awaiting = []

    def _step_result(self, seq: Sequence, positions: list[int], tokens: list[int]) -> StepResult:
        # Picks after an EOT (or refused by a grammar) were discarded by place(); attach() cuts the records alike.
        n = seq.last_unmasked
        base = seq.block * PAGE
        return StepResult(seq.id, seq.block, seq.step, [base + p for p in positions[:n]], tokens[:n])

    @staticmethod
    def _prefix_result(seq: Sequence) -> PrefixResult | None:
        end = seq.committed_prefix_len(set(seq.req.stop_token_ids))
        if end == seq.streamed:
            return None
        start = max(seq.prompt_len - seq.block * PAGE, 0)
        logprobs = seq.output_logprobs(seq.streamed, end) if seq.req.logprobs is not None else None
        result = PrefixResult(seq.id, seq.tokens[start + seq.streamed : start + end], logprobs)
        seq.streamed = end
        return result

    def _complete_block(self, seq: Sequence, ended_by_eot: bool) -> tuple[BlockResult, set[int] | None]:
        """The block's result, and the positions of the tokens it keeps (for attach; None when
        the request did not ask for attribution)."""
        new = seq.block_output()
        reason = None
        if ended_by_eot:  # by EOT, or by a constrained request's complete grammar
            new = new[: new.index(self.eot_id)] if self.eot_id in new else new
            reason = "stop"
        stop_ids = set(seq.req.stop_token_ids)
        cut = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if cut is not None:
            new, reason = new[:cut], "stop"
        if seq.req.stop and reason is None:
            found = find_stop(self.decode(seq.generated + new), seq.req.stop)
            if found is not None:
                new = _shortest_prefix_with_stop(self.decode, seq.generated, new, found)
                reason, seq.stop_str = "stop", found[1]
        seq.generated.extend(new)
        if reason is None and (seq.block + 1) * PAGE >= seq.end:
            reason = "length"
        result = BlockResult(seq.id, new, prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_pages * PAGE)
        if seq.req.logprobs is not None:
            result.logprobs = seq.output_logprobs(0, len(new))
        kept = self._kept_positions(seq, len(new)) if seq.req.attribution is not None else None
        if reason is None:
            seq.advance()
        else:
            self._finish(seq, reason)
            result.finished, result.finish_reason, result.stop_str = True, reason, seq.stop_str
        return result, kept

    @staticmethod
    def _kept_positions(seq: Sequence, n_kept: int) -> set[int]:
        """The positions of the first n_kept generated tokens of the active block: whatever EOT
        or a stop cut off gets no attribution record."""
        base = seq.block * PAGE
        generated = [base + i for i in range(max(seq.prompt_len - base, 0), PAGE) if seq.tokens[i] != MASK_ID]
        return set(generated[:n_kept])

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.block_attribution.pop(seq.id, None)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.fair.finished(seq)
        self.pages.free(seq.id)
        self._free_slots.append(seq.slot)


def _shortest_prefix_with_stop(
    decode: Callable[[list[int]], str], generated: list[int], new: list[int], found: tuple[int, str]
) -> list[int]:
    """Keep the block's tokens up to the one that completes the stop string, so the client's
    detokenizer sees the same stop at the same place."""
    for n in range(len(new) + 1):
        if find_stop(decode(generated + new[:n]), [found[1]]) is not None:
            return new[:n]
    return new
