"""/openapi.json: the request and response schemas from pydantic (gateway/schemas.py,
gateway/response_schemas.py), the errors every route can give, and the live model's limits (its
name, vocabulary, concepts), so that a schema-driven client or fuzzer generates requests this
server can actually run and can check every answer, streamed ones event by event."""

from __future__ import annotations

import copy
import functools

from cde.gateway.chat_schemas import ChatCompletionRequest
from cde.gateway.model_info import ModelInfo
from cde.gateway.response_schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ModelCard,
    ModelList,
    StepChunk,
)
from cde.gateway.schemas import CompletionRequest
from cde.gateway.tokenize_schemas import DetokenizeRequest, TokenizeRequest
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_NULLABLE_STR = {"type": ["string", "null"]}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "additionalProperties": False,
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STR,
                "code": _NULLABLE_STR,
            },
        }
    },
}
_ERROR = {"description": "OpenAI-style error", "content": _json(_ref("ErrorResponse"))}


def _event_stream(chunk: str) -> dict:
    """One SSE event, as Open API 3.1 reads an event stream's schema (schemathesis too): its
    `data` is `[DONE]` (the last event) or JSON, whose schema `contentSchema` gives."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref("StepChunk"), _ref("ErrorResponse")]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            # "message" (no `event:` line): OpenAI's chunks and a late error; "step": stream_denoise.
            "event": {"enum": ["message", "step"]},
            "data": {"anyOf": [{"const": "[DONE]"}, json_data]},
        },
    }


def _closed(required: dict, optional: dict | None = None) -> dict:
    """An object of exactly these properties (`required` always present)."""
    return {
        "type": "object",
        "required": list(required),
        "additionalProperties": False,
        "properties": {**required, **(optional or {})},
    }


_INT, _STR = {"type": "integer"}, {"type": "string"}
_NULLABLE_INT, _NULLABLE_BOOL = {"type": ["integer", "null"]}, {"type": ["boolean", "null"]}
_CONCEPT = _closed(  # gateway/concepts.py ConceptLabels.entry: catalog fields are null without a row
    {
        "id": _INT,
        "type": {"enum": ["known", "discovered"]},
        "label": _STR,
        "name": _NULLABLE_STR,
        "description": _NULLABLE_STR,
        "head": _NULLABLE_STR,
        "group_id": _NULLABLE_INT,
        "group_name": _NULLABLE_STR,
        "is_steerable": _NULLABLE_BOOL,
        "is_tone": _NULLABLE_BOOL,
        "is_alignment": _NULLABLE_BOOL,
        "is_demographic": _NULLABLE_BOOL,
    }
)
_CONCEPT_DETAIL = {
    **_CONCEPT,
    "required": [*_CONCEPT["required"], "group", "top_tokens"],
    "properties": {
        **_CONCEPT["properties"],
        "group": {
            "anyOf": [
                _closed({"id": _INT, "name": _NULLABLE_STR, "concept_ids": {"type": "array", "items": _INT}}),
                {"type": "null"},
            ]
        },
        "top_tokens": {
            "type": "array",
            "items": _closed({"token": _STR, "token_id": _INT, "score": {"type": "number"}}),
        },
    },
}
_LIST = _closed({"object": {"const": "list"}, "data": {"type": "array", "items": _CONCEPT}})
_HEALTH = {
    "type": "object",
    "required": ["status", "workers"],
    "properties": {"status": {"enum": ["ok", "unavailable"]}, "workers": {"type": "array"}},
}
_TOKENS = {"type": "array", "items": _INT}
_TOKENIZED = _closed(
    {"count": _INT, "max_model_len": _INT, "tokens": _TOKENS}, {"token_strs": {"type": "array", "items": _STR}}
)
_SECURED = (401,)  # what every route behind --api-key may answer


def _responses(ok: dict, *errors: int) -> dict:
    return {"200": ok, **{str(s): _ERROR for s in errors}}


def _post(summary: str, request: str, response: str, chunk: str) -> dict:
    ok = {
        "description": "JSON, or text/event-stream when stream is true",
        "content": {**_json(_ref(response)), "text/event-stream": {"schema": _event_stream(chunk)}},
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(_ref(request))},
            "responses": _responses(ok, 400, *_SECURED, 404, 413, 429, 503),
        }
    }


def _query(name: str, schema: dict, where: str = "query") -> dict:
    return {"name": name, "in": where, "required": where == "path", "schema": schema}


def _tokenizer_route(summary: str, request: str, answer: dict) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(_ref(request))},
            "responses": _responses({"description": "result", "content": _json(answer)}, 400, *_SECURED, 404, 413),
        }
    }


@functools.cache
def _static() -> dict:
    requests: list[type[BaseModel]] = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]
    responses: list[type[BaseModel]] = [
        CompletionResponse,
        CompletionChunk,
        ChatCompletionResponse,
        ChatCompletionChunk,
        StepChunk,
        ModelList,
    ]
    _, defs = models_json_schema(
        [(model, "validation") for model in requests] + [(model, "serialization") for model in responses],
        ref_template="#/components/schemas/{model}",
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "CDE, the Causal Diffusion Engine", "version": "1"},
        "paths": {
            "/v1/completions": _post("Text completion", "CompletionRequest", "CompletionResponse", "CompletionChunk"),
            "/v1/chat/completions": _post(
                "Chat completion (instruct checkpoints)",
                "ChatCompletionRequest",
                "ChatCompletionResponse",
                "ChatCompletionChunk",
            ),
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "responses": _responses(
                        {"description": "model list", "content": _json(_ref(ModelList.__name__))}, *_SECURED
                    ),
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One model",
                    "parameters": [_query("model", {"type": "string"}, "path")],
                    "responses": _responses(
                        {"description": "model", "content": _json(_ref(ModelCard.__name__))}, *_SECURED, 404, 503
                    ),
                }
            },
            "/v1/concepts": {
                "get": {
                    "summary": "List or search the concept catalog",
                    "parameters": [
                        _query("search", {"type": "string", "maxLength": 1000}),
                        _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
                        _query("head", {"type": "string", "enum": ["known", "unknown", "any"]}),
                        _query("steerable_only", {"type": "boolean"}),
                    ],
                    "responses": _responses(
                        {"description": "concept list", "content": _json(_LIST)}, 400, *_SECURED, 503
                    ),
                }
            },
            "/v1/concepts/{concept_id}": {
                "get": {
                    "summary": "A known concept's catalog fields, group and top promoted tokens",
                    "parameters": [
                        _query("concept_id", {"type": "integer", "minimum": 0}, "path"),
                        _query("k", {"type": "integer", "minimum": 1, "maximum": 100}),
                    ],
                    "responses": _responses(
                        {"description": "concept", "content": _json(_CONCEPT_DETAIL)}, 400, *_SECURED, 404, 503
                    ),
                }
            },
            "/health": {
                "get": {
                    "summary": "200 when a worker is alive, else 503",
                    "responses": {
                        "200": {"description": "ready", "content": _json(_HEALTH)},
                        "503": {
                            "description": "no live worker, or the server is shutting down (an error)",
                            "content": _json({"anyOf": [_HEALTH, _ref("ErrorResponse")]}),
                        },
                    },
                }
            },
            "/tokenize": _tokenizer_route(
                "vLLM's: the ids a prompt or chat would feed the model", "TokenizeRequest", _TOKENIZED
            ),
            "/detokenize": _tokenizer_route(
                "vLLM's: the text of token ids, special tokens by name", "DetokenizeRequest", _closed({"prompt": _STR})
            ),
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "text exposition",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {"schemas": {**defs["$defs"], "ErrorResponse": _ERROR_SCHEMA}},
    }


def _bound_ints(schema: dict, maximum: int) -> None:
    """Integers anywhere under `schema` (token ids, concept ids) get the model's range."""
    if schema.get("type") == "integer":
        schema.update(minimum=0, maximum=maximum)
    for value in schema.values():
        for sub in value if isinstance(value, list) else [value]:
            if isinstance(sub, dict):
                _bound_ints(sub, maximum)


def openapi_schema(model_name: str | None, info: ModelInfo | None, api_key: bool) -> dict:
    doc = copy.deepcopy(_static())
    defs = doc["components"]["schemas"]
    if model_name is not None and info is not None:
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            defs[name]["properties"]["model"]["anyOf"][0]["enum"] = [model_name]  # or null: the served one
            _bound_ints(defs[name]["properties"]["stop_token_ids"], info.vocab_size - 1)
        for name, field in (
            ("CompletionRequest", "max_tokens"),
            ("ChatCompletionRequest", "max_tokens"),
            ("ChatCompletionRequest", "max_completion_tokens"),
        ):
            defs[name]["properties"][field]["anyOf"][0]["maximum"] = info.context_len - 1
        _bound_ints(defs["CompletionRequest"]["properties"]["prompt"], info.vocab_size - 1)
        _bound_ints(defs["SteeringParams"]["properties"]["concepts"], info.n_concepts - 1)
        defs["SteeringParams"]["properties"]["inject_layer"] = {
            "anyOf": [{"type": "integer", "minimum": 0, "maximum": info.n_layers}, {"type": "null"}]
        }
        doc["paths"]["/v1/concepts/{concept_id}"]["get"]["parameters"][0]["schema"]["maximum"] = info.n_concepts - 1
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        for path in ("/health", "/metrics"):
            doc["paths"][path]["get"]["security"] = []
    return doc
