"""Request fields of structured outputs and tools (OpenAI's shapes; `structured_outputs` is
vLLM's extension). What they mean for generation: gateway/structured.py and gateway/tools.py."""

from __future__ import annotations

from typing import Any, Literal

from cde.gateway.body import Body
from cde.shared.limits import MAX_NAME_CHARS, MAX_STRUCTURED_CHOICES, MAX_TOOL_CALL_ID_CHARS
from pydantic import Field, model_validator

_NAME = rf"^[A-Za-z0-9_-]{{1,{MAX_NAME_CHARS}}}$"  # OpenAI's rule for schema and function names


class JsonSchemaSpec(Body):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(None, description="accepted; CDE always enforces the schema")


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


class StructuredOutputs(Body):
    """vLLM's `structured_outputs` (chat and completions): exactly one constraint."""

    json_: dict[str, Any] | None = Field(None, alias="json", description="a JSON schema")
    json_object: bool | None = Field(None, description="any JSON object")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_STRUCTURED_CHOICES)
    grammar: str | None = Field(None, description="a Lark grammar in llguidance's syntax")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("set exactly one of json, json_object, regex, choice, grammar")
        return self


class FunctionSpec(Body):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(Body):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(Body):
    name: str = Field(pattern=_NAME)


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(Body):
    name: str = Field(pattern=_NAME)
    arguments: str | None  # a JSON object, as text; "" or null: no arguments (gateway/tool_format.py)
    # The openai SDK's parse() result of `arguments`, in a reply appended to the history: the call
    # is rendered from `arguments` (vLLM ignores it too).
    parsed_arguments: Any = None


class ToolCall(Body):
    id: str = Field(max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"]
    function: CalledFunction
    # The openai SDK's stream accumulator (`chat.completions.stream()`) keeps each call's delta
    # index on the message it builds: accepted with the call, as vLLM does; it renders nothing.
    index: int | None = None
