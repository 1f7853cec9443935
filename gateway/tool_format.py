"""The text format of a tool call, written into history (read back from answers by
gateway/tool_stream.py): `<tool_call>{"name":"NAME","arguments":{...}}</tool_call>`, one per call
(docs/api.md, "Tools")."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from cde.gateway.errors import invalid

if TYPE_CHECKING:
    from cde.gateway.schemas import ChatMessage

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def calls_text(m: ChatMessage, index: int) -> str:
    """A message's tool calls in the call format (400 naming an argument that is not JSON)."""
    out = []
    for j, call in enumerate(m.tool_calls or []):
        try:
            # A call without arguments may come back as "" or null (vLLM's chat_utils reads both as {})
            args = json.loads(call.function.arguments or "{}")
        except ValueError:
            raise invalid(
                "arguments must be a JSON object", f"messages.{index}.tool_calls.{j}.function.arguments"
            ) from None
        out.append(CALL_OPEN + _call_json(call.function.name, args) + CALL_CLOSE)
    return "".join(out)


def _call_json(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
