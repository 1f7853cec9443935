"""Incremental detokenization: token ids arrive a block at a time; the client must only ever see
whole UTF-8 characters and never text past (or a prefix of) a stop string, and the streamed
pieces must join to exactly the non-streamed text."""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

from cde.shared.stops import find_stop

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
    """The client-visible text of one choice."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self._detok = Utf8Detokenizer(tokenizer)
        self.stops = [s for s in stops if s]
        self.text = ""  # everything decoded so far
        self._sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string was found: nothing more will be emitted

    def add(self, ids: list[int], final: bool = False) -> str:
        """New tokens in; the text that may be sent now out."""
        if self.stopped:
            return ""
        self.text += self._detok.add(ids, final)
        found = find_stop(self.text, self.stops)
        if found is not None:
            self.stopped = True
            end = found[0]
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._partial_stop_len()
        end = max(end, self._sent)
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string: it may
        still turn into a stop with the next block, so it is not sent yet."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best
