"""Per-request scheduler (pure Python, no torch).

Every engine iteration builds one forward pass out of *items*, each a 64-token block of one
request: prefill blocks of newly admitted prompts, the commit of a block that just finished, and
one denoising step of every running request's active block. Requests advance independently: one
that finishes a block commits it in the very pass that takes the first step of its next block,
while the others keep denoising; new requests join between any two steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cde.shared.config import ATTN_EXACT, MASK_ID, PAGE
from cde.shared.protocol import BlockResult, EngineResult, GenerateRequest, PrefixResult, StepResult
from cde.worker.fair_share import FairShare
from cde.worker.flashblock_policy import FlashBlockPolicy
from cde.worker.kv_pages import PageAllocator
from cde.worker.plan import NewRequest, Picks, PlannedItem, StepPlan
from cde.worker.prefix_cache import PrefixCache
from cde.worker.sequence import Sequence, Status

if TYPE_CHECKING:
    from cde.worker.constraint import Constraint


@dataclass
class Placed:
    """What one step item's picks did to its request (`Scheduler.place` -> the output stage,
    worker/outputs.py, which finishes the results: stop strings, attribution)."""

    index: int  # the item's place in plan.step_items (and in the pass's attribution records)
    seq: Sequence
    kept: int  # picks the step kept (the others were after EOT or refused by a grammar)
    results: list[EngineResult] = field(default_factory=list)  # in order: StepResult, PrefixResult, BlockResult
    step_result: StepResult | None = None  # sent for this step (stream_denoise), if any
    block_result: BlockResult | None = None  # the block this step completed, if any
    generated_before: int = 0  # that block: the request's generated tokens before it
    block_positions: list[int] = field(default_factory=list)  # its generated tokens' absolute positions, in order


class Scheduler:
    def __init__(
        self,
        num_pages: int,
        max_running: int,
        max_items: int,
        eot_id: int | None,
        max_running_per_client: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.prefix_cache = prefix_cache
        self.pages = PageAllocator(num_pages, prefix_cache)
        self.fair = FairShare(max_running_per_client)
        self.flashblock = FlashBlockPolicy()
        self.max_running = max_running
        self.max_items = max_items
        self.eot_id = eot_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_slot: dict[int, Sequence] = {}  # the running requests
        self._live: dict[str, Sequence] = {}  # the waiting and running requests, by id
        self._free_slots = list(range(max_running - 1, -1, -1))

    # ---- requests in / out --------------------------------------------------------------
    def add(self, req: GenerateRequest, constraint: Constraint | None = None) -> Sequence:
        """Queue a request (constraint: its grammar's matcher, when constrained) whose id is not in
        flight (the engine checks: `in_flight`)."""
        seq = Sequence(req, None if req.ignore_eos else self.eot_id, constraint)  # ignore_eos: EOT is a plain token
        if seq.n_blocks > self.pages.num_pages:
            raise ValueError(f"request needs {seq.n_blocks} KV pages, the cache has {self.pages.num_pages}")
        if self.prefix_cache is not None:
            seq.page_keys = self.prefix_cache.keys(req.prompt_ids)
        self.waiting.append(seq)
        self._live[seq.id] = seq
        return seq

    def in_flight(self, request_id: str) -> bool:
        """Waiting or running."""
        return request_id in self._live

    def abort(self, request_id: str) -> bool:
        seq = self._live.get(request_id)
        if seq is None:
            return False
        if seq.status is Status.RUNNING:
            self._finish(seq, "abort")
        else:
            self.waiting.remove(seq)
            seq.status = Status.FINISHED
            del self._live[request_id]
        return True

    def end(self, seq: Sequence, reason: str) -> bool:
        """End a running request now (an error, a stop string found after its next pass was
        launched: that pass's picks are then dropped, as an abort's); False when it had already
        finished."""
        if seq.status is not Status.RUNNING:
            return False
        self._finish(seq, reason)
        return True

    def running_in(self, slot: int) -> Sequence | None:
        return self._by_slot.get(slot)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def may_admit(self) -> bool:
        """The next schedule admits a waiting request (as things stand: a request that ends frees
        its slot and pages only once its picks are placed)."""
        return self._next_admission() is not None

    # ---- schedule -------------------------------------------------------------------------
    def _next_admission(self) -> tuple[Sequence, list[int]] | None:
        """The waiting request a free slot goes to now, with its prompt's cached pages; None when
        no slot is free, every waiting client is at its cap, or the chosen one's pages do not fit."""
        if not self.waiting or not self._free_slots:
            return None
        seq = self.fair.pick(self.waiting)
        if seq is None:
            return None
        shared = self.prefix_cache.match(seq.page_keys) if self.prefix_cache is not None else []
        # The chosen one waits for pages rather than be passed by smaller ones: no starvation.
        if not self.pages.can_allocate(seq.n_blocks, shared):
            return None
        return seq, shared

    def _admit(self) -> list[Sequence]:
        admitted = []
        while (admission := self._next_admission()) is not None:
            seq, shared = admission
            self.waiting.remove(seq)
            self.fair.admitted(seq)
            seq.pages = self.pages.allocate(seq.id, seq.n_blocks, shared)
            if self.prefix_cache is not None:
                self.prefix_cache.admitted(seq.page_keys, seq.pages)
            seq.slot = self._free_slots.pop()
            seq.status = Status.RUNNING
            self.flashblock.start(seq.slot, seq.req.flashblock)
            self.running.append(seq)
            self._by_slot[seq.slot] = seq
            admitted.append(seq)
        return admitted

    def schedule(self) -> StepPlan:
        """The next forward pass, with the requests admitted for it."""
        admitted = self._admit()
        items: list[PlannedItem] = []
        budget = self.max_items
        # Steps first: a running request is never starved by a long prefill.
        for seq in self.running:
            if not seq.prefill_done:
                continue
            need = 2 if seq.pending_commit else 1
            if budget < need and items:
                break
            if seq.pending_commit:
                block, tokens = seq.pending_commit
                items.append(write_item(seq, block, tokens))
                seq.pending_commit = None
            items.append(step_item(seq, self.flashblock.plan_step(seq.slot)))
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
                    items.append(write_item(seq, block, seq.prompt_block(block)))
                    budget -= 1
                seq.prefilled += 1
            if seq.prefill_done and budget > 0:
                items.append(step_item(seq, self.flashblock.plan_step(seq.slot)))
                budget -= 1
        return StepPlan(tuple(items), tuple(_new_request(seq) for seq in admitted))

    def launched_ahead(self, plan: StepPlan) -> None:
        """A pass planned ahead (worker/plan_ahead.py) was launched and the picks before it
        placed: the commits it carries are written, the blocks they complete no longer pending."""
        for item in plan.items:
            seq = self._by_slot.get(item.slot)
            if item.is_step or seq is None or seq.params is not item.request or seq.pending_commit is None:
                continue
            if seq.pending_commit[0] == item.block:
                seq.pending_commit = None

    # ---- place ----------------------------------------------------------------------------
    def place(self, plan: StepPlan, picks: list[Picks]) -> list[Placed]:
        """Apply the picks of each step item, in plan.step_items order, and say what each did.
        Requests that stream the denoising get a StepResult per step, before their BlockResult;
        requests that stream tokens a PrefixResult when a step grew their block's committed left
        prefix without completing the block (whose BlockResult then carries the rest). A request
        whose block completes moves on to its next block (or finishes: EOT, a stop token id, its
        length); stop strings and attribution are the output stage's (worker/outputs.py), which
        gets a `Placed` for every step item that has results (every step of a request that
        streams the denoising)."""
        placed: list[Placed] = []
        if self.prefix_cache is not None:  # the pass has run: later passes may read what it prefilled
            for item in plan.items:
                if not item.is_step and item.block < item.request.prompt_len // PAGE:
                    self.prefix_cache.written(item.page)
        for n, (item, pick) in enumerate(zip(plan.step_items, picks)):
            seq = self._by_slot.get(item.slot)
            if seq is None or seq.params is not item.request:
                continue  # aborted (or ended) while its step was in flight
            positions, tokens = pick.positions, pick.tokens
            seq.step += 1
            if pick.logprobs is not None:
                seq.block_logprobs.update(zip(positions, pick.logprobs))
            ended_by_eot = seq.place(positions, tokens)
            self.flashblock.unmasked(seq.slot, seq.last_unmasked)
            if positions and seq.last_unmasked == 0:  # a grammar refused its own bitmask's pick
                assert seq.constraint is not None  # only a grammar keeps fewer picks than it got
                refused = BlockResult(seq.id, [], True, "error", error=seq.constraint.refusal())
                placed.append(Placed(n, seq, 0, [refused]))
                self._finish(seq, "error")
                continue
            done = ended_by_eot or seq.block_done()
            if not (done or seq.req.stream_denoise or seq.req.stream_tokens):
                continue  # the common step: nothing to say (a Placed per item costs host time)
            out = Placed(n, seq, seq.last_unmasked)
            placed.append(out)
            if seq.req.stream_denoise:
                out.step_result = self._step_result(seq, positions, tokens)
                out.results.append(out.step_result)
            if seq.req.stream_tokens and not done:
                prefix = self._prefix_result(seq)
                if prefix is not None:
                    out.results.append(prefix)
            if done:
                self._complete_block(seq, ended_by_eot, out)
                out.results.append(out.block_result)
        return placed

    def kept_by_grammars(self, plan: StepPlan, picks: list[Picks]) -> list[tuple[int, list[int]]]:
        """(slot, tokens) that the placed pass's constrained requests with a penalty kept: their
        grammar's accepted prefix of the picks (the runner counts them, ModelRunner.count_kept)."""
        kept = []
        for item, pick in zip(plan.step_items, picks):
            p = item.request
            seq = self._by_slot.get(item.slot)
            if p.constrained and (p.repetition_penalty != 1.0 or p.penalized) and seq is not None:
                kept.append((item.slot, pick.tokens[: seq.last_unmasked]))
        return kept

    def _step_result(self, seq: Sequence, positions: list[int], tokens: list[int]) -> StepResult:
        # Picks after an EOT (or refused by a grammar) were discarded by place(); so are their records.
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
        tokens = seq.tokens[start + seq.streamed : start + end]
        result = PrefixResult(seq.id, tokens, logprobs, cached_tokens=seq.cached_pages * PAGE)
        seq.streamed = end
        return result

    def _complete_block(self, seq: Sequence, ended_by_eot: bool, out: Placed) -> None:
        """The block's result (into `out`), then the request moves on or finishes."""
        new = seq.block_output()
        base = seq.block * PAGE
        positions = [base + i for i in range(max(seq.prompt_len - base, 0), PAGE) if seq.tokens[i] != MASK_ID]
        reason, end = None, None
        if ended_by_eot:  # by EOT, or by a constrained request's complete grammar
            if self.eot_id in new:
                end = positions[new.index(self.eot_id)]
                new = new[: new.index(self.eot_id)]
            reason = "stop"
        stop_ids = set(seq.req.stop_token_ids)
        cut = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if cut is not None:
            new, reason, end = new[:cut], "stop", None
        out.generated_before = len(seq.generated)
        seq.generated.extend(new)
        if reason is None and (seq.block + 1) * PAGE >= seq.end:
            reason = "length"
        result = BlockResult(
            seq.id, new, prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_pages * PAGE, end_position=end
        )
        if seq.req.logprobs is not None:
            result.logprobs = seq.output_logprobs(0, len(new))
        out.block_positions = positions[: len(new)]
        out.block_result = result
        if reason is None:
            seq.advance()
            self.flashblock.new_block(seq.slot)
        else:
            self._finish(seq, reason)
            result.finished, result.finish_reason = True, reason

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        del self._live[seq.id]
        self.running.remove(seq)
        del self._by_slot[seq.slot]
        self.fair.finished(seq)
        self.pages.free(seq.id)
        self.flashblock.finish(seq.slot)
        self._free_slots.append(seq.slot)


def write_item(seq: Sequence, block: int, tokens: list[int]) -> PlannedItem:
    """A prefill or commit item: it writes final K/V, so it always attends exactly."""
    pages = tuple(seq.pages[: block + 1])
    return PlannedItem(seq.slot, seq.params, block, tuple(tokens), pages[-1], pages, is_step=False)


def step_item(seq: Sequence, attention: int = ATTN_EXACT) -> PlannedItem:
    """The next denoising step of the request's active block (attention: FlashBlock's mode)."""
    pages = tuple(seq.pages[: seq.block + 1])
    return PlannedItem(
        seq.slot,
        seq.params,
        seq.block,
        tuple(seq.tokens),
        pages[-1],
        pages,
        is_step=True,
        attention=attention,
        step=seq.step,
        eligible=tuple(seq.eligible()),
        committed=seq.committed,
        generated=len(seq.generated),
    )


def _new_request(seq: Sequence) -> NewRequest:
    return NewRequest(
        seq.slot,
        seq.params,
        tuple(seq.req.prompt_ids),
        seq.req.steering,
        seq.constraint,
        flashblock=bool(seq.req.flashblock),
    )
