"""FlashBlock's reuse rule, per request slot: how each planned step attends.

A step refreshes the cached external attention (ATTN_REFRESH) at the first step of a block and
whenever the last step unmasked `tau` tokens or more, or the cache was already reused `max_reuse`
steps in a row; otherwise it reuses it (ATTN_REUSE). Requests without a FlashBlockSpec attend
exactly (ATTN_EXACT). The scheduler consults the policy while planning and tells it what each
step unmasked and when a request moves to its next block.
"""

from __future__ import annotations

from dataclasses import dataclass

from cde.shared.config import ATTN_EXACT, ATTN_REFRESH, ATTN_REUSE
from cde.shared.protocol import FlashBlockSpec


@dataclass
class _Reuse:
    spec: FlashBlockSpec
    cached: bool = False  # the cached external attention is from the active block
    reused: int = 0  # steps in a row that reused it
    last_unmasked: int = 0  # tokens the last step unmasked


class FlashBlockPolicy:
    def __init__(self) -> None:
        self._slots: dict[int, _Reuse] = {}  # requests with FlashBlock, by slot

    def start(self, slot: int, spec: FlashBlockSpec | bool | None) -> None:
        """A request takes the slot (spec: its resolved `GenerateRequest.flashblock`)."""
        if isinstance(spec, FlashBlockSpec):
            self._slots[slot] = _Reuse(spec)
        else:
            self._slots.pop(slot, None)

    def finish(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def plan_step(self, slot: int) -> int:
        """The attention mode of the step being planned for the slot's request. Counts the step
        as planned (a reuse, or a refresh that makes the cache the block's): call it once per
        step."""
        state = self._slots.get(slot)
        if state is None:
            return ATTN_EXACT
        if state.cached and state.last_unmasked < state.spec.tau and state.reused < state.spec.max_reuse:
            state.reused += 1
            return ATTN_REUSE
        state.cached, state.reused = True, 0
        return ATTN_REFRESH

    def unmasked(self, slot: int, n: int) -> None:
        """The slot's last step unmasked n tokens."""
        state = self._slots.get(slot)
        if state is not None:
            state.last_unmasked = n

    def new_block(self, slot: int) -> None:
        """The slot's request moved to its next block: the cached external attention is stale."""
        state = self._slots.get(slot)
        if state is not None:
            state.cached = False
