"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Messages and params are clipped: an error may quote what the client sent (an unknown field, a
model name, a label), and a hostile client must not get its megabyte echoed back."""

from __future__ import annotations

import logging

from cde.shared.limits import clip
from cde.shared.protocol import grammar_fault
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger("cde.gateway")

# OpenAI's code for a parameter refused by name: unknown to CDE, or known and not honoured here.
UNSUPPORTED = "unsupported_parameter"
# A 401 is OpenAI's "invalid_request_error" with code "invalid_api_key" (its body for a wrong key).
_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}
MAX_MESSAGE_CHARS, MAX_PARAM_CHARS = 512, 128


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.param = None if param is None else clip(param, MAX_PARAM_CHARS)
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class GenerationError(Exception):
    """A request failed after it was accepted: a 500 `generation_failed` (its worker died, the
    engine failed), or a 400 naming `grammar_param` when its grammar failed it (a dead end, a
    token mask too slow)."""

    def __init__(self, message: str, grammar_param: str | None = None):
        super().__init__(message)
        code = grammar_fault(message)
        if code is not None and grammar_param is not None:
            self.error = ApiError(400, f"{grammar_param}: {message}", grammar_param, code)
        else:
            self.error = ApiError(500, message, code="generation_failed")


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _is_type_tag(part: object) -> bool:
    """pydantic puts the union member it tried into `loc` (`str`, `list[int]`, `SteeringParams`);
    clients want the field path only."""
    return isinstance(part, str) and (part in _SCALARS or not part.isidentifier() or part[:1].isupper())


_SCALARS = {"str", "int", "float", "bool", "none"}


def _field_path(loc: tuple) -> list:
    """`loc` without pydantic's union members, and without the tag a discriminated union adds
    after its member's place (`content.0.text.text` is the text part's `content.0.text`)."""
    path, tagged = [], False
    for part in loc:
        if _is_type_tag(part):
            tagged = tagged or "tagged-union[" in str(part)
            continue
        if tagged and isinstance(part, str):  # the member's tag (the list index before it stays)
            tagged = False
            continue
        path.append(part)
    return path


def from_validation_error(exc: ValidationError) -> ApiError:
    # Of a union's failed branches, the deepest error is the one that explains the mistake.
    err = max(exc.errors(include_url=False, include_input=False), key=lambda e: len(e["loc"]))
    param = ".".join(str(p) for p in _field_path(err["loc"])) or None
    if err["type"] == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {param}", param, UNSUPPORTED)
    if err["type"] == UNSUPPORTED:  # a field CDE knows and refuses (gateway/schemas.py's `_reject`)
        return invalid(f"Unsupported parameter: {err['msg']}", param, UNSUPPORTED)
    if err["type"] == "union_tag_invalid":  # a content part of a type CDE does not take (an image)
        tag, expected = err.get("ctx", {}).get("tag"), err.get("ctx", {}).get("expected_tags")
        return invalid(f"Unsupported value: {param} of type {tag!r} (CDE takes {expected})", param, "unsupported_value")
    if err["type"] == "missing":
        return invalid(f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    message = err["msg"].removeprefix("Value error, ")
    return invalid(f"Invalid value for '{param}': {message}" if param else message, param)


async def api_error_handler(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def http_error_handler(request: Request, exc: HTTPException) -> JSONResponse:
    return ApiError(exc.status_code, exc.detail or "error", None, None, dict(exc.headers or {})).response()


async def unhandled_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return ApiError(500, "internal server error").response()
