"""Tool calls: how tools and past calls are written into the chat template, the grammar of a
call, and how an answer's calls are read back into OpenAI's `tool_calls`.

The format (docs/api.md, "Tools"): the tools are listed in a system turn before the others; a
call is `<tool_call>{"name":"NAME","arguments":{...}}</tool_call>`, one per call, and an answer
that calls tools is only calls. A past assistant turn with tool_calls is rendered as its content
followed by its calls in that format; a `tool` turn is rendered with the role `tool` and its
content. With `tool_choice` `required` or a named function, the grammar admits only calls (of that
function), with arguments valid under the function's `parameters`; with `auto` it admits either
text (or the response_format's JSON, when one is set) or calls, and once an answer starts with
`<tool_call>` the rest must be calls.
"""

from __future__ import annotations

import json
from typing import Any

from cde.gateway.chat_schemas import ChatCompletionRequest, ChatMessage
from cde.gateway.errors import invalid
from cde.gateway.prompts import template_messages
from cde.gateway.structured import ANY_OBJECT, format_grammar, lark_string, schema_text
from cde.gateway.structured_schemas import NamedToolChoice, ToolSpec
from cde.gateway.tool_format import CALL_CLOSE, CALL_OPEN
from cde.shared.grammar import closed_objects, json_options, lark_grammar
from cde.shared.schema_finite import check_finite

_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFINITIONS = ("$defs", "definitions")  # where pointers in a tool's parameters look

PREAMBLE = (
    "You can call these functions. Each line is one function: its name, description and the "
    "JSON schema of its arguments.\n<tools>\n{tools}\n</tools>\n"
    'To call functions, answer only with one <tool_call>{{"name":"NAME","arguments":{{...}}}}</tool_call> '
    "per call; otherwise answer in text."
)


def active_tools(body: ChatCompletionRequest) -> list[ToolSpec]:
    """The tools the answer may call (none with tool_choice "none"); 400 for a choice without tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return []
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise invalid("two tools have the same name", "tools")
    for i, t in enumerate(body.tools):  # arguments are an object: a call's JSON is read as one
        kind = (t.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise invalid(
                f"tool {t.function.name!r}: parameters must be a JSON Schema of type object, got type {kind!r}",
                f"tools.{i}.function.parameters",
            )
    if choice == "none":
        return []
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in body.tools if t.function.name == choice.function.name]
        if not chosen:
            raise invalid(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
        return chosen
    return list(body.tools)


def json_x(strict: bool) -> dict[str, Any]:
    """Compact JSON inside Lark, as in a response_format (shared/grammar.py: strict or lenient)."""
    return {"x-guidance": json_options(strict)}


def render_messages(messages: list[ChatMessage], tools: list[ToolSpec] | None) -> list[dict[str, str]]:
    """The chat template's turns: the tools' system turn (when tools are given), then each
    message with its tool calls written out (a chat request's, or /tokenize's)."""
    turns = []
    if tools:
        lines = [
            json.dumps(
                {"name": t.function.name, "description": t.function.description or "", "parameters": _params(t)},
                separators=(",", ":"),
            )
            for t in tools
        ]
        turns.append({"role": "system", "content": PREAMBLE.format(tools="\n".join(lines))})
    return turns + template_messages(messages)


def _params(tool: ToolSpec) -> dict[str, Any]:
    """A tool's `parameters`, closed (shared/grammar.py). Left out or `{}`: no arguments, as the
    openai SDK documents an omitted `parameters` and vLLM reads both (not any value, or any keys
    written until max_tokens)."""
    return closed_objects(tool.function.parameters or _NO_ARGUMENTS)


def chat_grammar(body: ChatCompletionRequest, tools: list[ToolSpec]) -> tuple[str, str] | None:
    """(grammar, param) of a chat request's answer: its tools' and response_format's, or None."""
    fmt = format_grammar(body.response_format, body.structured_outputs)
    if not tools:
        return fmt
    if fmt is not None and body.structured_outputs is not None:
        raise invalid("structured_outputs cannot be combined with tools; use response_format", "structured_outputs")
    answer = None
    if body.response_format is not None and body.response_format.type != "text":
        spec = body.response_format.json_schema
        answer = (spec.schema_, spec.strict is True) if spec is not None else (ANY_OBJECT, True)
    return tools_grammar(body, tools, answer), "tools"


def tools_grammar(
    body: ChatCompletionRequest, tools: list[ToolSpec], answer: tuple[dict[str, Any], bool] | None
) -> str:
    """The grammar of an answer that may (auto) or must (required, named) call `tools`. `answer`:
    the JSON schema of a non-call answer under auto (a response_format) and whether it is strict,
    None for free text. The calls' schemas are strict when a tool asks for it."""
    for tool in tools:  # bounded in size first: the check is linear in the schema
        params = tool.function.parameters or _NO_ARGUMENTS
        schema_text(params, "tools")
        try:
            check_finite(params)
        except ValueError as exc:
            raise invalid(f"tools: function {tool.function.name!r}'s parameters: {exc}", "tools") from None
    named = isinstance(body.tool_choice, NamedToolChoice)
    single = named or not body.parallel_tool_calls
    strict = any(t.function.strict for t in tools)
    lark = [
        f"calls: call{'' if single else '+'}",
        f"call: {_named_call(tools[0], strict) if named else _call(tools, strict)}",
    ]
    if named or body.tool_choice == "required":
        lark.insert(0, "start: calls")
    else:  # auto: an answer that does not start like a call, or calls
        lark.insert(0, f"start: {'TEXT' if answer is None else 'answer'} | calls")
        if answer is None:
            lark.append(r"TEXT: /[^<](.|\n)*/")
        else:
            schema, answer_strict = answer  # checked as response_format (format_grammar)
            lark.append(
                f"answer: %json {schema_text({**closed_objects(schema), **json_x(answer_strict)}, 'response_format')}"
            )
    return lark_grammar("\n".join(lark))


def _named_call(tool: ToolSpec, strict: bool) -> str:
    """Lark of a call of the named `tool`: its parameters are the root of the arguments' schema, as
    vLLM compiles them, so that every pointer in them (`#/$defs/...`, `#/properties/...`) resolves."""
    head = lark_string(f'{CALL_OPEN}{{"name":{json.dumps(tool.function.name)},"arguments":')
    arguments = schema_text({**_params(tool), **json_x(strict)}, "tools")
    return f"{head} %json {arguments} {lark_string('}' + CALL_CLOSE)}"


def _call(tools: list[ToolSpec], strict: bool) -> str:
    """Lark of a call of any of `tools`: one schema for the call, each tool's parameters under its
    name, their definitions lifted to its root (where pydantic's `#/$defs/...` pointers look)."""
    params = [_params(t) for t in tools]
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": {k: v for k, v in p.items() if k not in _DEFINITIONS},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t, p in zip(tools, params)
        ],
        **_definitions(params),
        **json_x(strict),
    }
    return f"{lark_string(CALL_OPEN)} %json {schema_text(call, 'tools')} {lark_string(CALL_CLOSE)}"


def _definitions(params: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The tools' `$defs` and `definitions` (draft-07's, pydantic v1's) merged, as vLLM's
    get_tool_schema_defs: one name defined two ways by two tools is a 400."""
    merged: dict[str, dict[str, Any]] = {}
    for p in params:
        for key in _DEFINITIONS:
            given = p.get(key, {})
            if not isinstance(given, dict):
                raise invalid(f"{key} must map names to schemas", "tools")
            for name, schema in given.items():
                if merged.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise invalid(f"two tools define {key} {name!r} differently; give them different names", "tools")
    return merged
