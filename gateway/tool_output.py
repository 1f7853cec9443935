"""A chat answer as the client reads it: text `content`, or `tool_calls` when the request has tools
and the answer is calls (gateway/tools.py's format), whole or streamed as they are written."""

from __future__ import annotations

from cde.gateway.response_schemas import (
    AssistantMessage,
    ChatDelta,
    DeltaFunction,
    DeltaToolCall,
    FinishReason,
    FunctionCall,
    MessageToolCall,
)
from cde.gateway.structured_schemas import NamedToolChoice, ToolChoice
from cde.gateway.tool_format import CALL_OPEN
from cde.gateway.tool_stream import CallPart, CallReader


def answer_message(
    text: str, finish_reason: FinishReason | None, tools: bool, choice: ToolChoice | None = None
) -> tuple[AssistantMessage, FinishReason | None]:
    """(message, finish_reason) of a whole answer: what its stream joins to, read by the same
    StreamedAnswer in one piece, so that the two agree on calls cut short by max_tokens too."""
    answer = StreamedAnswer(tools, choice)
    delta, finish_reason = answer.delta(text, finish_reason)
    if not delta.tool_calls:
        return AssistantMessage(role="assistant", content=text), finish_reason
    tool_calls = [
        MessageToolCall(id=c.id, type="function", function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in answer.reader.calls
    ]
    return AssistantMessage(role="assistant", content=None, tool_calls=tool_calls), finish_reason


class StreamedAnswer:
    """One choice's stream of deltas from its text deltas, whatever their size. Without tools the
    text goes out as it comes. With tools, text is held while it could still be the start of a
    call; an answer of calls goes out as it is written (gateway/tool_stream.py): each call's id and
    name once the name is complete, then its arguments' text, finishing "tool_calls" (also where
    a stop string cut only the layout after the last call's arguments, as vLLM reports parsed
    calls; also where max_tokens ended the answer after a closed call), or as the engine finished
    ("stop") under a `choice` that names the function. Calls cut short (max_tokens, a stop string
    inside their arguments) end with the engine's finish reason; cut before a name was complete,
    they go out as text."""

    def __init__(self, tools: bool, choice: ToolChoice | None = None) -> None:
        self.held = ""
        self.calls: bool | None = None if tools else False  # None: not known yet
        self.reader = CallReader()
        # OpenAI's and vLLM's finish_reason: "tool_calls" says the model chose to call; a named
        # function's call is the answer the request asked for, so it ends "stop".
        self.chosen = not isinstance(choice, NamedToolChoice)

    def delta(self, text: str, finish_reason: FinishReason | None) -> tuple[ChatDelta, FinishReason | None]:
        if self.calls is None:
            self.held += text
            if not CALL_OPEN.startswith(self.held):
                self.calls = self.held.startswith(CALL_OPEN)
            elif finish_reason is None:
                return ChatDelta(), None
            text, self.held = self.held, ""
        if not self.calls:
            # An answer that ends before it was known to be text or calls is text, "" included:
            # its stream then says so, as the unstreamed message's content does.
            return (ChatDelta(content=text) if text or self.calls is None else ChatDelta()), finish_reason
        parts = self.reader.feed(text)
        if finish_reason is not None and not self.reader.calls:  # no call's name was complete: text
            return ChatDelta(content=self.reader.text), finish_reason
        # Calls that were all closed, or whose closing layout a stop string cut: "tool_calls".
        as_calls = self.reader.complete or (finish_reason == "stop" and self.reader.calls_whole)
        if finish_reason in ("stop", "length") and as_calls and self.chosen:
            finish_reason = "tool_calls"
        return ChatDelta(tool_calls=_joined(parts) or None), finish_reason


def _joined(parts: list[CallPart]) -> list[DeltaToolCall]:
    """One delta per call of what a read added to it."""
    out: dict[int, DeltaToolCall] = {}
    for part in parts:
        if part.index in out:
            out[part.index].function.arguments += part.arguments
        elif part.id is not None:
            out[part.index] = DeltaToolCall(
                index=part.index,
                id=part.id,
                type="function",
                function=DeltaFunction(name=part.name, arguments=part.arguments),
            )
        else:
            out[part.index] = DeltaToolCall(index=part.index, function=DeltaFunction(arguments=part.arguments))
    return list(out.values())
