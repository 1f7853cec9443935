"""What crosses from the scheduler to the model runner: one `StepPlan` per forward pass, plain
frozen data (vLLM v1's `SchedulerOutput`).

A plan holds the pass's 64-token items (prefill blocks, the commit of a block that just finished,
one denoising step per running request) and the requests admitted for it. An admitted request's
fixed parameters and per-request objects (`NewRequest`) reach the runner once, when it takes its
slot; the runner keeps what it builds from them per slot. Each step item then carries only what
changes from step to step (its tokens, step counter, eligible positions, counts), copied when the
plan is made: the scheduler may move the request on while the pass is in flight, and the plan
still says what the pass computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from cde.shared.config import ATTN_EXACT

if TYPE_CHECKING:
    from cde.shared.protocol import SteeringSpec
    from cde.worker.constraint import Constraint


@dataclass(frozen=True, slots=True)
class RequestParams:
    """What a request fixes for its whole life and the runner reads at every step (the names are
    `GenerateRequest`'s)."""

    request_id: str
    prompt_len: int
    temperature: float
    top_p: float
    top_k: int
    entropy_sampling: bool
    repetition_penalty: float
    sampling_key: int  # the seed's 32-bit key (worker/sampler.sampling_key), folded once at admission
    tokens_per_step: int
    confidence_threshold: float | None
    frequency_penalty: float
    presence_penalty: float
    logit_bias: tuple[tuple[int, float], ...]  # (token id, added logit)
    min_tokens: int
    end_ids: tuple[int, ...]  # what min_tokens bans: EOT (unless ignored) and the stop token ids
    logprobs: int | None  # top alternatives per token, None: not asked
    attribution: bool  # concept attribution of every committed token
    stream_denoise: bool  # a step event per step (its attribution computed per step, else per block)
    constrained: bool  # a grammar picks the leftmost positions (worker/constraint.py)

    @property
    def attribution_per_block(self) -> bool:
        """Attributed once per completed block (worker/block_attribution.py); with step events, per step."""
        return self.attribution and not self.stream_denoise

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request admitted for this pass: what the runner sets up its slot from."""

    slot: int
    params: RequestParams
    prompt_ids: tuple[int, ...]  # repetition penalty: the prompt counts as seen
    steering: SteeringSpec | None
    # The request's grammar matcher, shared: the scheduler advances it with the tokens it keeps,
    # the runner reads the next token's bitmask from it at launch (after the advance).
    constraint: Constraint | None
    flashblock: bool  # may split its attention (the runner allocates FlashBlock's cache rows)


class PlannedItem(NamedTuple):
    """One 64-token block of one request in the pass. (A named tuple, not a frozen dataclass:
    the scheduler builds one per item per pass, and a frozen dataclass's __init__ took three
    times as long, about 0.25 ms of host time per pass at 32 requests: docs/benchmarks.md.)"""

    slot: int  # the request's row of the runner's per-request state
    request: RequestParams
    block: int  # absolute block index
    tokens: tuple[int, ...]  # 64 ids
    page: int  # page the item's K/V are written to
    pages: tuple[int, ...]  # pages attended: blocks 0..block of the request
    is_step: bool  # a denoising step (logits, selection) vs a prefill/commit write
    attention: int = ATTN_EXACT  # ATTN_* (shared/config.py): FlashBlock's split and reuse
    # Step items only: the request's state when the step was planned.
    step: int = 0  # denoising steps taken before this one (seeds the sampling, stamps the records)
    eligible: tuple[bool, ...] = ()  # per position: still masked and may be unmasked
    committed: int = 0  # generated tokens unmasked so far (steering's cutoff schedule)
    generated: int = 0  # tokens of the request's completed blocks (min_tokens)
    # A pass planned ahead (worker/plan_ahead.py): the step item of the previous pass whose picks
    # complete this item's tokens (and, for a step, take its picked positions out of `eligible`)
    # on the device; -1: none, the item is complete as planned.
    carry: int = -1
    carried_picks: int = 0  # a step that carries picks: how many of its `eligible` they take


@dataclass(frozen=True, slots=True)
class StepPlan:
    items: tuple[PlannedItem, ...]
    new: tuple[NewRequest, ...] = ()  # admitted for this pass: the runner starts them before launching it

    @property
    def step_items(self) -> list[PlannedItem]:
        """The denoising steps of the pass, in pass order (the order of its picks)."""
        return [it for it in self.items if it.is_step]

    def without(self, slots: set[int]) -> StepPlan:
        """The plan without any item or admission of the requests in `slots`."""
        return StepPlan(
            tuple(it for it in self.items if it.slot not in slots), tuple(n for n in self.new if n.slot not in slots)
        )


@dataclass
class Picks:
    """What one step item unmasked (the runner's answer, per step item of the plan): positions
    within its block (most confident first) and the token placed at each."""

    positions: list[int]
    tokens: list[int]
    # Requests with logprobs: per pick (logprob, top ids, top logprobs), worker/logprobs.py.
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
