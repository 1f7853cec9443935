"""What a request asks the output to follow, as one llguidance grammar for the worker.

`response_format` (chat), `structured_outputs` (vLLM's extension, chat and completions) and tools
(gateway/tools.py) each become a grammar; it is compiled here once, in a checker process under
a time bound, so a schema llguidance refuses is a 400 naming its field, and the worker never sees
it. The bounds on what one grammar may cost are in shared/grammar.py (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable
from typing import Any

from cde.gateway.client_identity import client_identity
from cde.gateway.errors import ApiError, invalid
from cde.gateway.grammar_checker import CheckersBusy, GrammarChecker
from cde.gateway.model_info import ModelInfo
from cde.gateway.structured_schemas import ResponseFormat, StructuredOutputs
from cde.shared.grammar import MAX_SCHEMA_CHARS, json_schema_grammar, lark_grammar
from starlette.requests import Request

CHECKER = GrammarChecker()
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def schema_text(value: Any, param: str) -> str:
    """A schema (or tools list) as JSON text, bounded in size."""
    text = json.dumps(value, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise invalid(f"{param} is {len(text)} characters of JSON, more than {MAX_SCHEMA_CHARS}", param)
    return text


def lark_string(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text)


def format_grammar(fmt: ResponseFormat | None, outputs: StructuredOutputs | None) -> tuple[str, str] | None:
    """(grammar, param) for response_format / structured_outputs; None when neither constrains."""
    if fmt is not None and fmt.type != "text":
        if outputs is not None:
            raise invalid("set response_format or structured_outputs, not both", "structured_outputs")
        if fmt.type == "json_object":
            return json_schema_grammar(ANY_OBJECT), "response_format"
        assert fmt.json_schema is not None  # the model's validator
        schema_text(fmt.json_schema.schema_, "response_format")
        strict = fmt.json_schema.strict is True
        return _schema_grammar(fmt.json_schema.schema_, "response_format", strict), "response_format"
    if outputs is None:
        return None
    param = "structured_outputs"
    if outputs.json_ is not None:
        schema_text(outputs.json_, param)
        return _schema_grammar(outputs.json_, param), param
    if outputs.json_object:
        return json_schema_grammar(ANY_OBJECT), param
    if outputs.regex is not None:
        schema_text(outputs.regex, param)
        return lark_grammar(f"start: /{_regex_body(outputs.regex, param)}/"), param
    if outputs.choice is not None:
        schema_text(outputs.choice, param)
        return lark_grammar("start: " + " | ".join(lark_string(c) for c in outputs.choice)), param
    assert outputs.grammar is not None  # the model's validator: exactly one is set
    schema_text(outputs.grammar, param)
    return lark_grammar(outputs.grammar), param


def _schema_grammar(schema: dict[str, Any], param: str, strict: bool = True) -> str:
    try:
        return json_schema_grammar(schema, strict)
    except ValueError as exc:
        raise invalid(f"{param}: {exc}", param) from None


def _regex_body(regex: str, param: str) -> str:
    try:
        re.compile(regex)
    except re.error as exc:
        raise invalid(f"{param}.regex is not a regular expression: {exc}", param) from None
    return regex.replace("/", "\\/")


async def check_grammar(grammar: str, param: str, info: ModelInfo, request: Request) -> None:
    """400 naming `param` unless the worker will be able to use the grammar: compiled, with its
    first mask, in a checker process killed past its time bound (gateway/grammar_checker.py).
    429 when too many checks are waiting, in all or from the request's client; a check whose
    client hangs up while it waits is dropped."""
    try:
        check = CHECKER.error(grammar, info.instruct, info.vocab_size, client_identity(request))
        error = await _while_connected(request, check)
    except CheckersBusy as exc:
        raise ApiError(429, f"{param}: {exc}", param, exc.code, {"Retry-After": "1"}) from None
    if error:
        raise invalid(f"{param}: {error}", param)


async def _while_connected(request: Request, check: Awaitable[str]) -> str:
    """The check's answer; if the client hangs up first, the check is cancelled (it leaves its
    line, or, running, ends unread) and the request ends with a 499 nobody receives. Starlette
    does not cancel a handler whose client left, so without this a line of abandoned checks would
    all run."""
    task = asyncio.ensure_future(check)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # nothing once it has its answer
    if not task.done():  # the client left first
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ApiError(499, "the client closed the request while its grammar waited for a check")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
