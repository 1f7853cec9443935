"""Every body and SSE event the gateway writes is RFC 8259 JSON: NaN and Infinity (which Python's
json writes by default, and which strict parsers refuse) never reach a client. A float that is
not finite (an attribution score of activations that overflowed) is written as null: by pydantic
for a response model (gateway/response_schemas.py), by `_finite` (and logged) for a plain dict.
A response model is written by pydantic-core in one pass, with only the fields the route set."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from pydantic import BaseModel
from starlette.responses import JSONResponse

log = logging.getLogger("cde.gateway")


def dumps(obj: Any) -> bytes:
    if isinstance(obj, BaseModel):
        return obj.__pydantic_serializer__.to_json(obj, exclude_unset=True)
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # the only one json.dumps raises for our plain values: a non-finite float
        log.warning("a response held non-finite numbers: sent as null")
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class JsonResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content)
