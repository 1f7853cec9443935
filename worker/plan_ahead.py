"""Planning the next pass before the picks of the one in flight reach the host (what vLLM v1 calls
async scheduling).

Planned after the picks, the next pass leaves the GPU idle through the host's whole round trip:
reading the picks, placing them, planning and launching (`cde bench roofline`'s host gap, 0.75 ms
of a 32 ms pass at 32 requests on the H200). But for most requests the host can plan the next
pass without the picks. It knows how many positions a step unmasks (tokens_per_step, or what
remains of the block), so it knows whether the block completes; and the next pass's items differ
from what it knows only at the picked positions, which the device fills in from the pass in
flight (`PlannedItem.carry`, worker/carried_picks.py). So the engine launches the next pass before
it reads the picks, and the GPU goes from one pass to the next without waiting.

What needs the picks on the host first is planned after them, as before (`plan_ahead` says None):
the admission of a waiting request and its prefill (also when a request ends by its length in
the pass in flight and someone waits for its slot), a confidence threshold (how many positions
clear it is the GPU's to say), a grammar (its bitmask follows the accepted tokens), FlashBlock
(its refresh rule counts the picks), min_tokens while its bans apply (placed by the tokens), and
anything the pass in flight did not step. A request that the picks end (EOT, a stop token id or
string, an abort) wastes its items of the pass planned ahead: placing drops them, as an abort's.
"""

from __future__ import annotations

from cde.shared.config import PAGE
from cde.worker.plan import PlannedItem, StepPlan
from cde.worker.scheduler import Scheduler, step_item, write_item
from cde.worker.sequence import Sequence


def plan_ahead(s: Scheduler, current: StepPlan) -> StepPlan | None:
    """The pass after `current`, which is launched and whose picks are not placed yet; or None
    when it must wait for them (the module's list). The requests' state is still the one
    `current` was planned from."""
    if s.may_admit():
        return None
    steps = {it.slot: (n, it) for n, it in enumerate(current.step_items)}
    items: list[PlannedItem] = []
    for seq in s.running:
        n, stepped = steps.get(seq.slot, (-1, None))
        after = _next_items(seq, n) if stepped is not None and _foreseeable(seq, stepped) else None
        if after is None or (not after and s.waiting):  # (ending by its length: its slot is for one waiting)
            return None
        items += after
    if not items or len(items) > s.max_items:
        return None
    return StepPlan(tuple(items))


def _foreseeable(seq: Sequence, stepped: PlannedItem) -> bool:
    """The request's next items follow from `stepped`, its step in the pass in flight, without its picks."""
    p = seq.params
    return (
        stepped.request is p
        and stepped.step == seq.step  # planned from the state the request is still in
        and seq.pending_commit is None
        and not p.constrained
        and p.confidence_threshold is None
        and not seq.req.flashblock
    )


def _next_items(seq: Sequence, n: int) -> list[PlannedItem] | None:
    """The request's items after its step `n` of the pass in flight unmasks what it will: the
    next step of its block, or the block's commit and the first step of the next block, or
    nothing when the block is its last; None while min_tokens' bans apply to its next step."""
    picked = min(seq.params.tokens_per_step, seq.remaining)
    committed = seq.committed + picked
    if picked < seq.remaining:  # the block goes on; its picked positions come from the device
        after = [step_item(seq)._replace(step=seq.step + 1, committed=committed, carry=n, carried_picks=picked)]
    elif (seq.block + 1) * PAGE >= seq.end:  # its last block: the request ends with this step
        return []
    else:
        block = seq.block + 1
        tokens, eligible = seq.block_state(block)
        pages = tuple(seq.pages[: block + 1])
        step = PlannedItem(
            seq.slot,
            seq.params,
            block,
            tuple(tokens),
            pages[-1],
            pages,
            is_step=True,
            step=seq.step + 1,
            eligible=tuple(eligible),
            committed=committed,
            generated=len(seq.generated) + len(seq.block_output()) + picked,
        )
        after = [write_item(seq, seq.block, seq.tokens)._replace(carry=n), step]
    return None if after[-1].generated < seq.params.min_tokens else after
