"""The output stage: what a pass's results need after its picks are placed, done while the next
pass computes (the engine calls `finish` after launching it).

- Stop strings: a completed block's text is searched for the request's stops; a block that holds
  one is cut after the token that completes it and ends the request. Its next pass is already in
  flight by then: the scheduler ends it as an abort (`Scheduler.end`), and that pass's picks for
  it are dropped.
- Concept attribution: a request that streams the denoising gets the pass's packed records with
  the step's results, kept with its active block until the block completes, then joined and cut
  to its kept tokens; any other request gets its block's, computed once when the block completes
  from the rows its passes stashed (worker/block_attribution.py), started by `attribute_blocks`
  as soon as the pass's picks are placed, cut the same way.
- Input attribution (worker/input_attribution_runner.py) holds a block's result back until its
  IG is done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cde.shared.config import PAGE
from cde.shared.packed_attribution import PackedAttribution
from cde.shared.protocol import EngineResult, TokenLogprobs
from cde.shared.stops import find_stop
from cde.worker.block_attribution import AttributionStash
from cde.worker.input_attribution_runner import InputAttributionRunner
from cde.worker.plan import StepPlan
from cde.worker.scheduler import Placed, Scheduler
from cde.worker.sequence import Sequence, Status
from cde.worker.staging import HostCopy

if TYPE_CHECKING:
    from cde.shared.tokenizer import Tokenizer
    from cde.worker.model_runner import ModelRunner


class OutputStage:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        input_attribution: InputAttributionRunner,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer  # for stop strings
        self.input_attribution = input_attribution
        self.block_attribution: dict[str, list[PackedAttribution]] = {}  # request id -> its active block's steps'
        self._blocks: tuple[list[Placed], HostCopy, ModelRunner] | None = None  # started by attribute_blocks

    def track(self, seq: Sequence) -> None:
        """A request was queued (input attribution follows the ones that ask)."""
        self.input_attribution.track(seq)

    def holds(self, request_id: str) -> bool:
        """Whether the stage holds results of the request still to send (its scheduler end came first)."""
        return request_id in self.block_attribution or request_id in self.input_attribution.requests

    def abort(self, request_id: str) -> bool:
        """Drop whatever the stage holds of the request; True when it held something."""
        attributed = self.block_attribution.pop(request_id, None) is not None
        return self.input_attribution.abort(request_id) or attributed

    def has_work(self) -> bool:
        return self.input_attribution.has_work()

    def attribute_blocks(self, plan: StepPlan, placed: list[Placed], runner: ModelRunner) -> None:
        """Start the attribution of the blocks the pass of `plan` completed for requests that get
        it per block, from the rows `runner` stashed. Before the pass after the next is launched
        (worker/block_attribution.py)."""
        done = [p for p in placed if p.block_result is not None and p.seq.params.attribution_per_block]
        if not done:
            self._blocks = None
            return
        steps = plan.step_items
        rows = [
            (AttributionStash.key(steps[p.index].slot, steps[p.index].block), [q % PAGE for q in p.block_positions])
            for p in done
        ]
        self._blocks = (done, runner.attribute_blocks(rows), runner)

    def waits_for_blocks(self) -> bool:
        """`finish` will wait for the device: `attribute_blocks` started completed blocks' attribution."""
        return self._blocks is not None

    def finish(self, placed: list[Placed], records: list[PackedAttribution | None]) -> list[EngineResult]:
        """The results of a pass whose picks were placed (`records`: its attribution per step
        item, None where not asked or asked per block), finished, and those that may leave now."""
        blocks, self._blocks = self._blocks, None
        if blocks is not None:
            done, rows, runner = blocks
            for p, packed in zip(done, runner.block_records(rows, [_commits(p) for p in done])):
                records[p.index] = packed
        results: list[EngineResult] = []
        for p in placed:
            if p.block_result is not None and p.seq.req.stop:
                self._stop_strings(p)
            if p.seq.params.attribution_per_block:
                if p.block_result is not None:
                    whole = records[p.index]
                    assert whole is not None, "the block's attribution was started when its picks were placed"
                    p.block_result.attribution = _kept(p, whole)
            elif p.seq.params.attribution:
                self._attach(p, records[p.index])
            results += p.results
        return self.input_attribution.process(results, decoding=self._others_decode())

    def idle(self) -> list[EngineResult]:
        """No pass ran: input attribution has the device to itself."""
        return self.input_attribution.process([], decoding=False)

    def _stop_strings(self, p: Placed) -> None:
        """Cut the completed block after the token that completes a stop string, if one does, and
        end the request there."""
        seq, result = p.seq, p.block_result
        assert result is not None
        cut = stop_cut(self.tokenizer, seq.generated[: p.generated_before], result.token_ids, seq.req.stop)
        if cut is None:
            return
        new, text_tokens, stop = cut
        if not seq.req.include_stop_str_in_output:
            seq.text_tokens = text_tokens
        del seq.generated[p.generated_before + len(new) :]
        result.token_ids = new
        if result.logprobs is not None:
            lp, n = result.logprobs, len(new)
            result.logprobs = TokenLogprobs(lp.logprobs[:n], lp.top_ids[:n], lp.top_logprobs[:n])
        self.scheduler.end(seq, "stop")  # False when its length had ended it already: the stop wins
        result.finished, result.finish_reason, result.stop_str = True, "stop", stop

    def _attach(self, p: Placed, packed: PackedAttribution | None) -> None:
        """The step's attribution records (a request that streams the denoising), per kept pick:
        to its StepResult, and kept with the active block until the block completes, then joined
        and cut to the tokens it keeps."""
        assert packed is not None, "the pass computed attribution for every request that asked"
        records = packed.head(p.kept)
        if p.step_result is not None:
            p.step_result.attribution = records
        rid = p.seq.id
        if p.block_result is not None:
            steps = [*self.block_attribution.pop(rid, []), records]
            p.block_result.attribution = _kept(p, PackedAttribution.join(steps))
        elif p.seq.status is Status.RUNNING:
            self.block_attribution.setdefault(rid, []).append(records)
        else:  # ended by its step (a grammar's refusal) or since (a failed launch): nothing to join
            self.block_attribution.pop(rid, None)

    def _others_decode(self) -> bool:
        """Input attribution yields to other requests (a share of the time), not to its own: to
        those decoding, and to those waiting for a slot (which a full chunk per step would starve)."""
        asked = self.input_attribution.requests
        s = self.scheduler
        return bool(asked) and (bool(s.waiting) or any(seq.id not in asked for seq in s.running))


def _kept(p: Placed, block: PackedAttribution) -> PackedAttribution:
    """A completed block's records cut to the tokens it keeps (a stop may have cut it)."""
    assert p.block_result is not None
    return block.kept(set(p.block_positions[: len(p.block_result.token_ids)]))


def _commits(p: Placed) -> tuple[list[int], list[int], list[int]]:
    """The completed block's kept tokens, their absolute positions and commit steps, in
    `block_positions` order."""
    wanted, by_pos = set(p.block_positions), dict[int, tuple[int, int]]()
    for pos, tok, step in reversed(p.seq.commits):  # the block's are the newest (the last commit of a position holds)
        if pos in wanted:
            by_pos.setdefault(pos, (tok, step))
            if len(by_pos) == len(wanted):
                break
    picked = [by_pos[q] for q in p.block_positions]
    # A commit counts the steps taken with its own; a record, those before it (PlannedItem.step).
    return [t for t, _ in picked], list(p.block_positions), [s - 1 for _, s in picked]


def stop_cut(
    tokenizer: Tokenizer, generated: list[int], new: list[int], stops: list[str]
) -> tuple[list[int], int, str] | None:
    """Where a stop string completes in the block `new` (after `generated`): the block's tokens up
    to the one that completes it, so that the client's detokenizer sees the same stop at the same
    place; how many of those the text before the stop covers, as the gateway counts the completion
    (gateway/detokenizer.py's _tokens_of: a token holding both the text's end and the stop's start
    counts, a character split across tokens counts the one completing it); and the stop. None
    where no stop completes. Stops are found in the text as a stream shows it so far
    (Tokenizer.decode_so_far), as the gateway finds them: a character whose bytes are not all
    written yet is held back, not U+FFFD."""
    decode = tokenizer.decode_so_far
    found = find_stop(decode(generated + new), stops)
    if found is None:
        return None
    stop = found[1]
    n = next((n for n in range(len(new) + 1) if find_stop(decode(generated + new[:n]), [stop]) is not None), len(new))
    kept = new[:n]
    covered = next((n for n in range(len(kept) + 1) if len(decode(generated + kept[:n])) >= found[0]), len(kept))
    return kept, covered, stop
