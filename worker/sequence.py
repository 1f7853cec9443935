"""Per-request decoding state: where the request is (block, step) and what it has produced.

Absolute block alignment: the first decode block is the block holding the prompt's tail (its
prompt positions fixed, the rest masked); later blocks start fully masked. Positions at or past
`prompt_len + max_tokens` stay masked and are never unmasked.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from cde.shared.config import MASK_ID, PAGE
from cde.shared.protocol import GenerateRequest, TokenLogprobs
from cde.worker.plan import RequestParams
from cde.worker.sampler import sampling_key

if TYPE_CHECKING:
    from cde.worker.constraint import Constraint


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, req: GenerateRequest, eot_id: int | None, constraint: Constraint | None = None):
        """eot_id: the token that ends the request (None: none does); constraint: its grammar's
        matcher, when constrained."""
        self.req = req
        self.id = req.request_id
        self.eot_id = eot_id
        self.constraint = constraint
        self.prompt_len = len(req.prompt_ids)
        self.end = self.prompt_len + req.max_tokens  # first position never generated
        self.n_blocks = -(-self.end // PAGE)
        self.status = Status.WAITING
        self.slot = -1  # row of the runner's per-request device state
        self.pages: list[int] = []
        self.prefilled = 0  # full prompt blocks already in the cache
        self.page_keys: list[bytes] = []  # of the full prompt pages, when the prefix cache is on
        self.cached_pages = 0  # full prompt pages found written by others (usage's cached_tokens)
        self.block = self.prompt_len // PAGE  # active block (absolute index)
        self.tokens, self._eligible = self.block_state(self.block)
        self._remaining = sum(self._eligible)
        self.pending_commit: tuple[int, list[int]] | None = None  # (block, tokens) to write
        self.generated: list[int] = []  # tokens of completed blocks, in position order
        self.step = 0  # forward steps taken while decoding
        self.committed = 0  # generated tokens unmasked so far
        self.commits: list[tuple[int, int, int]] = []  # (absolute position, token, step), in commit order
        self.streamed = 0  # generated tokens of the active block already sent as PrefixResults
        # Per position of the active block (requests with logprobs): (logprob, top ids, top logprobs).
        self.block_logprobs: dict[int, tuple[float, list[int], list[float]]] = {}
        self.finish_reason: str | None = None
        self.last_unmasked = 0  # picks the last step kept
        # Of the block a stop string ended, the tokens its text covers before the stop (the
        # completion's, as the gateway counts them; the block keeps the one completing the stop)
        self.text_tokens: int | None = None
        self.params = request_params(req, eot_id, constrained=constraint is not None)

    @property
    def n_prompt_blocks(self) -> int:
        return self.prompt_len // PAGE

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= self.n_prompt_blocks

    def block_state(self, block: int) -> tuple[list[int], list[bool]]:
        """A block's tokens and eligible positions before its first step: its prompt positions
        fixed, the rest masked, and eligible below the request's end."""
        start = block * PAGE
        tail = self.req.prompt_ids[start : self.prompt_len] if start < self.prompt_len else []
        tokens = list(tail) + [MASK_ID] * (PAGE - len(tail))
        return tokens, [t == MASK_ID and start + i < self.end for i, t in enumerate(tokens)]

    def prompt_block(self, block: int) -> list[int]:
        return self.req.prompt_ids[block * PAGE : (block + 1) * PAGE]

    def eligible(self) -> list[bool]:
        """Masked positions of the active block that may still be unmasked (read-only). Kept up to
        date as picks land: rebuilt per item twice a step, it was half of the scheduler's host time
        at 32 requests, time in which the GPU waits for the next pass."""
        return self._eligible

    @property
    def remaining(self) -> int:
        """Positions of the active block still to unmask."""
        return self._remaining

    def block_done(self) -> bool:
        return self._remaining == 0

    def place(self, positions: list[int], tokens: list[int]) -> bool:
        """Unmask positions (most confident first). Returns True when EOT (or a complete grammar)
        ended the request: like the reference, what comes after EOT is discarded, later picks of
        the step too. A constrained request keeps only the picks its grammar accepts, in order
        (worker/constraint.py). `last_unmasked` counts the picks kept."""
        if self.constraint is not None:
            kept = self.constraint.accept(tokens)
            positions, tokens = positions[:kept], tokens[:kept]
        self.last_unmasked = len(positions)
        for n, (pos, tok) in enumerate(zip(positions, tokens)):
            self.tokens[pos] = tok
            if self._eligible[pos]:
                self._eligible[pos] = False
                self._remaining -= 1
            self.committed += 1
            self.commits.append((self.block * PAGE + pos, tok, self.step))
            if self.eot_id is not None and tok == self.eot_id:
                self.tokens[pos + 1 :] = [MASK_ID] * (PAGE - pos - 1)
                self.last_unmasked = n + 1
                return True
        return self.constraint is not None and self.constraint.complete

    def committed_prefix_len(self, stop_ids: set[int]) -> int:
        """How many generated tokens of the active block form its committed left prefix (up to
        its first mask), cut before an EOT or stop token id: they can no longer change. Scans on
        from the part already streamed, so a step costs what it added."""
        start = max(self.prompt_len - self.block * PAGE, 0)
        n = self.streamed
        for t in self.tokens[start + n :]:
            if t == MASK_ID or t == self.eot_id or t in stop_ids:
                break
            n += 1
        return n

    def output_logprobs(self, start: int, end: int) -> TokenLogprobs:
        """The logprobs of block_output()[start:end] (requests with logprobs)."""
        first = max(self.prompt_len - self.block * PAGE, 0)
        positions = [p for p in range(first, PAGE) if self.tokens[p] != MASK_ID][start:end]
        rows = [self.block_logprobs[p] for p in positions]
        return TokenLogprobs([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])

    def block_output(self) -> list[int]:
        """The generated tokens of the active block in position order (masks skipped)."""
        start = max(self.prompt_len - self.block * PAGE, 0)
        return [t for t in self.tokens[start:] if t != MASK_ID]

    def advance(self) -> None:
        """Move to the next block; the finished one is committed in the next forward."""
        self.pending_commit = (self.block, list(self.tokens))
        self.block += 1
        self.tokens, self._eligible = self.block_state(self.block)
        self._remaining = sum(self._eligible)
        self.streamed = 0
        self.block_logprobs = {}


def request_params(req: GenerateRequest, eot_id: int | None, constrained: bool) -> RequestParams:
    """The request's fixed parameters as the runner reads them."""
    return RequestParams(
        request_id=req.request_id,
        prompt_len=len(req.prompt_ids),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        entropy_sampling=req.entropy_sampling,
        repetition_penalty=req.repetition_penalty,
        # The engine draws a seed; a scheduler driven alone leaves it unset.
        sampling_key=sampling_key(0 if req.seed is None else req.seed),
        tokens_per_step=req.tokens_per_step,
        confidence_threshold=req.confidence_threshold,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logit_bias=tuple(req.logit_bias.items()),
        min_tokens=req.min_tokens,
        end_ids=tuple(([] if eot_id is None else [eot_id]) + list(req.stop_token_ids)),
        logprobs=req.logprobs,
        attribution=req.attribution is not None,
        stream_denoise=req.stream_denoise,
        constrained=constrained,
    )
