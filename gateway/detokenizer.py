"""Incremental detokenization: token ids arrive a block at a time; the client must only ever see
whole UTF-8 characters and never text past (or a prefix of) a stop string, and the streamed
pieces must join to exactly the non-streamed text."""

from __future__ import annotations

import bisect
import codecs
from typing import TYPE_CHECKING

from cde.shared.stops import find_stop, first_stop_end

if TYPE_CHECKING:
    from cde.shared.tokenizer import Tokenizer


class Utf8Detokenizer:
    """Token ids -> text. A token can end inside a multi-byte character (byte-level BPE splits
    emoji across tokens), so the trailing incomplete sequence is held back until it completes;
    invalid bytes become U+FFFD exactly as a one-shot `bytes.decode(errors="replace")` would."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: list[int], final: bool = False) -> str:
        return self._decoder.decode(self.tokenizer.decode_bytes(ids), final=final)


class ChoiceText:
    """The client-visible text of one choice, and the tokens it counts.

    Text is handed out only where it is final: never past a stop string, and never from where a
    tail of the text could still grow into one (with stops sharing prefixes, a stop found early
    can still lose to a longer one that starts before it). So whether tokens arrive a block at a
    time or a few per step, the pieces join to the same text, the one a single `find_stop` over
    the whole generation cuts."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], include_stop: bool = False) -> None:
        """`include_stop` (vLLM's include_stop_str_in_output): the text ends after the first stop
        string to be complete, where the worker stopped, instead of before the earliest one."""
        self._detok = Utf8Detokenizer(tokenizer)
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.text = ""  # everything decoded so far
        self.ids: list[int] = []  # every token fed
        self._text_ends: list[int] = []  # len(text) after each token of `ids`
        self._sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found: nothing more will be emitted
        self.released = 0  # tokens of `ids` that the text handed out so far counts

    def add(self, ids: list[int], final: bool = False) -> str:
        """New tokens in; the text that may be sent now out (and `released` updated)."""
        if self.stopped:
            return ""
        for n, t in enumerate(ids):
            self.text += self._detok.add([t], final and n == len(ids) - 1)
            self.ids.append(t)
            self._text_ends.append(len(self.text))
        if final and not ids:
            self.text += self._detok.add([], True)
        end = len(self.text) if final else len(self.text) - self._partial_stop_len()
        if self.include_stop:
            cut = first_stop_end(self.text, self.stops)
        else:
            found = find_stop(self.text, self.stops)
            cut = found[0] if found is not None and found[0] <= end else None
        if cut is not None:
            self.stopped, end = True, cut
        end = max(end, self._sent)
        out = self.text[self._sent : end]
        self._sent = end
        self.released = len(self.ids) if final and not self.stopped else self._tokens_of(end)
        return out

    def _tokens_of(self, chars: int) -> int:
        """The fewest leading tokens whose text covers the first `chars` characters: a token that
        holds the end of the returned text and the start of a stop string counts."""
        return 0 if chars == 0 else bisect.bisect_left(self._text_ends, chars) + 1

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string: it may
        still turn into a stop (or an earlier one than any found) with more tokens, so it is not
        sent yet."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best
