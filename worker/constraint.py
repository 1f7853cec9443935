"""Constrained decoding in the worker: each constrained request's matcher, and the token bitmasks
of a pass's constrained step items on their way to the device.

The commit rule (block diffusion commits by confidence, a grammar needs a left prefix): a
constrained request unmasks the leftmost masked positions of its block, up to tokens_per_step per
pass. The first is drawn under the matcher's bitmask, so it is always valid. The others are drafts
drawn from the unconstrained distribution; the matcher keeps them, in order, while they continue
a valid prefix, and drops the rest (they stay masked for the next pass). A kept draft is a sample
of the masked distribution (rejection sampling), and at temperature 0 it is the masked argmax.
Requests without a grammar are not touched: no bitmask, no host work.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

import torch
from cde.shared.config import PAGE
from cde.shared.grammar import ll_tokenizer, new_matcher, slow_mask_error
from cde.shared.protocol import GRAMMAR_DEAD_END, GRAMMAR_TOO_SLOW
from llguidance import LLMatcher

if TYPE_CHECKING:
    from cde.worker.sampler import SamplingBatch


# llguidance's words for a step over its limits (shared/grammar.py's limits): parser items, lexer fuel.
_OVER_LIMITS = re.compile(r"Too many items|fuel exhausted|lex fuel")


class Constraint:
    """One request's matcher, advanced by the tokens its request commits."""

    def __init__(self, grammar: str, instruct: bool, vocab_size: int) -> None:
        self.matcher: LLMatcher = new_matcher(grammar, ll_tokenizer(instruct, vocab_size))
        self.too_slow = ""  # why its masks cost the engine too much (the engine fails the request)

    def fill(self, row: torch.Tensor) -> None:
        """Write the next token's bitmask into `row` (int32, contiguous, on the host), timed: the
        engine thread computes it before the pass launches, so every request waits on it."""
        started = time.thread_time()
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if not self.too_slow and (why := slow_mask_error(time.thread_time() - started)):
            self.too_slow = GRAMMAR_TOO_SLOW + why

    def accept(self, tokens: list[int]) -> int:
        """Consume the longest valid prefix of `tokens` (leftmost first); returns its length."""
        return self.matcher.try_consume_tokens(tokens)

    def refusal(self) -> str:
        """Why the grammar refused its own mask's pick: a dead end (llguidance's NoExtensionBias:
        no token continues the answer), a step over llguidance's per-token limits (the grammar's
        work, as a mask over its CPU bound), else the matcher's own error as it is."""
        error = self.matcher.get_error() if self.matcher.is_error() else ""
        if not error or error.startswith("NoExtensionBias"):
            return GRAMMAR_DEAD_END
        first = error.splitlines()[0]
        return (GRAMMAR_TOO_SLOW if _OVER_LIMITS.search(first) else "grammar: ") + first

    @property
    def complete(self) -> bool:
        """The grammar admits nothing more than the end of the sequence."""
        return self.matcher.is_stopped()


class GrammarInputs:
    """The bitmasks of a pass's constrained step items: filled by their matchers into a pinned
    host buffer and sent in one asynchronous copy (as worker/staging.py: the previous copy must
    have left the buffer before the matchers overwrite it)."""

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device, self.words = torch.device(device), (vocab_size + 31) // 32
        self.cuda = self.device.type == "cuda"
        self.host: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def add_to(self, sampling: SamplingBatch, constraints: list[Constraint | None], grid: list[int]) -> None:
        """Set the sampling batch's grammar fields for the step items whose matchers are
        `constraints` (None: unconstrained; grid: the [S * 64] logits row of each position, -1
        where none): which items take their leftmost positions, and the bitmask of each one's
        leftmost eligible row."""
        constrained = [n for n, c in enumerate(constraints) if c is not None]
        rows = [next(r for r in grid[n * PAGE : (n + 1) * PAGE] if r >= 0) for n in constrained]
        if self.copied is not None:
            self.copied.synchronize()
        if self.host is None or self.host.shape[0] < len(rows):
            self.host = torch.empty(max(len(rows), 8), self.words, dtype=torch.int32, pin_memory=self.cuda)
        for n, row in zip(constrained, self.host):
            constraint = constraints[n]
            assert constraint is not None  # `constrained` holds only those
            constraint.fill(row)
        leftmost = [c is not None for c in constraints]
        host = torch.tensor(rows + leftmost, dtype=torch.int64, pin_memory=self.cuda)
        dev = host.to(self.device, non_blocking=True)
        sampling.grammar_rows = dev[: len(rows)]
        sampling.leftmost = dev[len(rows) :].bool()
        sampling.grammar_bitmask = self.host[: len(rows)].to(self.device, non_blocking=True)
        if self.cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:  # the CPU "copy" is the buffer itself
            sampling.grammar_bitmask = sampling.grammar_bitmask.clone()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Ban, in place, every token of logits[rows[i]] that bitmask[i] does not allow."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)  # [C, words * 32]
    width = logits.shape[1]
    if allowed.shape[1] < width:  # the padded LM head's extra columns are banned anyway
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed[:, :width], float("-inf"))
