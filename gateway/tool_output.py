"""A chat answer as the client reads it: text `content`, or `tool_calls` when the request has tools
and the answer is calls (gateway/tools.py's format), whole or streamed."""

from __future__ import annotations

from typing import Any

from cde.gateway.tool_format import CALL_OPEN, parse_calls


def answer_message(text: str, finish_reason: str | None, tools: bool) -> tuple[dict[str, Any], str | None]:
    """(message, finish_reason) of a whole answer: calls become tool_calls, finishing "tool_calls"."""
    calls = parse_calls(text) if tools else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


class StreamedAnswer:
    """One choice's stream of deltas from its text deltas, whatever their size. Without tools the
    text goes out as it comes. With tools, text is held while it could still be the start of a
    call; an answer of calls goes out once complete, as one `delta.tool_calls` with the finish."""

    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.held = ""
        self.calls: bool | None = None if tools else False  # None: not known yet

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        self.held += text
        if self.calls is None and not CALL_OPEN.startswith(self.held):
            self.calls = self.held.startswith(CALL_OPEN)
        if self.calls is False or (self.calls is None and finish_reason is not None):
            out, self.held = self.held, ""
            return ({"content": out} if out else {}), finish_reason
        if finish_reason is None:
            return {}, None
        message, reason = answer_message(self.held, finish_reason, True)
        self.held = ""
        if "tool_calls" not in message:  # calls cut short (max_tokens): the text as it is
            return {"content": message["content"]}, reason
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}, reason
