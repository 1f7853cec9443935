"""The text format of a tool call, written into history (read back from answers by
gateway/tool_stream.py): `<tool_call>{"name":"NAME","arguments":{...}}</tool_call>`, one per call
(docs/api.md, "Tools")."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cde.gateway.chat_schemas import ChatMessage

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def calls_text(m: ChatMessage) -> str:
    """A message's tool calls in the call format, their arguments as compact JSON; arguments that
    are not JSON (a call cut by max_tokens, `finish_reason: "length"`, sent back as the answer had
    it) as written: OpenAI takes `arguments` as an opaque string."""
    out = []
    for call in m.tool_calls or []:
        # A call without arguments may come back as "" or null (vLLM's chat_utils reads both as {})
        text = call.function.arguments or "{}"
        try:
            args = json.dumps(json.loads(text), separators=(",", ":"))
        except ValueError:
            args = text
        out.append(f'{CALL_OPEN}{{"name":{json.dumps(call.function.name)},"arguments":{args}}}{CALL_CLOSE}')
    return "".join(out)
