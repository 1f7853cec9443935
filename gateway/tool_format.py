"""The text format of a tool call, written into history and read back from answers:
`<tool_call>{"name":"NAME","arguments":{...}}</tool_call>`, one per call (docs/api.md, "Tools")."""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any

from cde.gateway.errors import invalid

if TYPE_CHECKING:
    from cde.gateway.schemas import ChatMessage

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def calls_text(m: ChatMessage, index: int) -> str:
    """A message's tool calls in the call format (400 naming an argument that is not JSON)."""
    out = []
    for j, call in enumerate(m.tool_calls or []):
        try:
            args = json.loads(call.function.arguments)
        except ValueError:
            raise invalid(
                "arguments must be a JSON object", f"messages.{index}.tool_calls.{j}.function.arguments"
            ) from None
        out.append(CALL_OPEN + _call_json(call.function.name, args) + CALL_CLOSE)
    return "".join(out)


def _call_json(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))


def parse_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI's tool_calls of an answer made of calls, None for a text answer (or calls cut short
    by max_tokens, which then stay text)."""
    if not text.startswith(CALL_OPEN):
        return None
    calls, end = [], 0
    for m in _CALL.finditer(text):
        if m.start() != end:
            return None
        try:
            call = json.loads(m.group(1))
            name, args = call["name"], call["arguments"]
        except (ValueError, KeyError, TypeError):
            return None
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, separators=(",", ":"))},
            }
        )
        end = m.end()
    return calls if calls and end == len(text) else None
