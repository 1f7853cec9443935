"""Logprobs in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`
and the legacy completions object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

The numbers come from the worker (worker/logprobs.py): per generated token, its log-probability
at the step that committed it, and the top alternatives at that position in that step. Every one
goes out through `_number`."""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

from cde.gateway.generation import TokenLogprob
from cde.gateway.response_schemas import ChatLogprobs, CompletionLogprobs, TopLogprob
from cde.gateway.response_schemas import TokenLogprob as ChatTokenLogprob

if TYPE_CHECKING:
    from cde.shared.tokenizer import Tokenizer


# vLLM's floor. A grammar (tools, response_format, structured_outputs) bans tokens with -inf, and
# fewer tokens than the alternatives asked for may be allowed: JSON has no -inf (it would be written
# null), and OpenAI's types want a number.
_FLOOR = -9999.0


def _number(logprob: float) -> float:
    return logprob if logprob >= _FLOOR else _FLOOR  # NaN too: never null


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    if token_id in tokenizer.special_ids:  # no bytes in the text: OpenAI's null, and the name as vLLM
        return {"token": tokenizer.token_str(token_id), "logprob": _number(logprob), "bytes": None}
    raw = tokenizer.decode_bytes([token_id])
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": _number(logprob), "bytes": list(raw)}


def _legacy_token(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as the legacy object writes it, which has no `bytes`: its text, a special's name,
    bytes that are not whole characters as `bytes:\\xf0\\x9f` (OpenAI's form), and an id with
    neither bytes nor a name as `token_id:100256` (vLLM's form), so that two alternatives never
    share a key of `top_logprobs`."""
    if token_id in tokenizer.special_ids:
        return tokenizer.token_str(token_id)
    raw = tokenizer.decode_bytes([token_id])
    if not raw:
        return f"token_id:{token_id}"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _continues(held: bytes, first: bytes) -> bool:
    """Whether the byte `first` continues the start of a character `held` (else `held` is given up,
    as U+FFFD, before it)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(held + first)
    except UnicodeDecodeError:
        return False
    return True


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], rows: list[TokenLogprob]) -> ChatLogprobs:
    content: list[ChatTokenLogprob] = []
    for token_id, (logprob, top_ids, top_logprobs) in zip(token_ids, rows):
        alternatives = [_top(tokenizer, t, lp) for t, lp in zip(top_ids, top_logprobs)]
        content.append({**_top(tokenizer, token_id, logprob), "top_logprobs": alternatives})
    return ChatLogprobs(content=content, refusal=None)


class CompletionLogprobsRenderer:
    """One choice's legacy logprobs, chunk after chunk: `text_offset` is where each token's text
    starts in the completion's text, in characters (a character split over tokens starts at the
    first; echo with logprobs is refused)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0  # characters of the completion's text so far, a held-back partial one not yet

    def render(self, token_ids: list[int], rows: list[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, (logprob, top_ids, top_logprobs) in zip(token_ids, rows):
            token = _legacy_token(self.tokenizer, token_id)
            out.tokens.append(token)
            out.token_logprobs.append(_number(logprob))
            # OpenAI's "always the logprob of the sampled token" (up to logprobs + 1 entries), first
            # as in vLLM; then the alternatives, best first.
            top: dict[str, float] = {token: _number(logprob)}
            for t, lp in zip(top_ids, top_logprobs):
                top.setdefault(_legacy_token(self.tokenizer, t), _number(lp))
            out.top_logprobs.append(top)
            raw = self.tokenizer.decode_bytes([token_id])
            held = self.text.getstate()[0]
            given_up = held and raw and not _continues(held, raw[:1])
            out.text_offset.append(self.offset + (len(held.decode("utf-8", errors="replace")) if given_up else 0))
            self.offset += len(self.text.decode(raw))
        return out
