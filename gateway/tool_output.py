"""A chat answer as the client reads it: text `content`, or `tool_calls` when the request has tools
and the answer is calls (gateway/tools.py's format), whole or streamed."""

from __future__ import annotations

from cde.gateway.response_schemas import AssistantMessage, ChatDelta, DeltaToolCall, FinishReason, MessageToolCall
from cde.gateway.tool_format import CALL_OPEN, parse_calls


def answer_message(
    text: str, finish_reason: FinishReason | None, tools: bool
) -> tuple[AssistantMessage, FinishReason | None]:
    """(message, finish_reason) of a whole answer: calls become tool_calls, finishing "tool_calls"."""
    calls = parse_calls(text) if tools else None
    if calls is None:
        return AssistantMessage(role="assistant", content=text), finish_reason
    tool_calls = [MessageToolCall.model_validate(call) for call in calls]
    return AssistantMessage(role="assistant", content=None, tool_calls=tool_calls), "tool_calls"


class StreamedAnswer:
    """One choice's stream of deltas from its text deltas, whatever their size. Without tools the
    text goes out as it comes. With tools, text is held while it could still be the start of a
    call; an answer of calls goes out once complete, as one `delta.tool_calls` with the finish."""

    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.held = ""
        self.calls: bool | None = None if tools else False  # None: not known yet

    def delta(self, text: str, finish_reason: FinishReason | None) -> tuple[ChatDelta, FinishReason | None]:
        self.held += text
        if self.calls is None and not CALL_OPEN.startswith(self.held):
            self.calls = self.held.startswith(CALL_OPEN)
        if self.calls is False or (self.calls is None and finish_reason is not None):
            out, self.held = self.held, ""
            return (ChatDelta(content=out) if out else ChatDelta()), finish_reason
        if finish_reason is None:
            return ChatDelta(), None
        held, self.held = self.held, ""
        calls = parse_calls(held)
        if calls is None:  # calls cut short (max_tokens): the text as it is
            return ChatDelta(content=held), finish_reason
        streamed = [DeltaToolCall.model_validate({"index": i, **call}) for i, call in enumerate(calls)]
        return ChatDelta(tool_calls=streamed), "tool_calls"
