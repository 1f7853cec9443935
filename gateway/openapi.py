"""/openapi.json, generated from the pydantic request schemas."""

from __future__ import annotations

import functools

from pydantic.json_schema import models_json_schema

from gateway.schemas import ChatCompletionRequest, CompletionRequest

_ERROR = {"description": "OpenAI-style error", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}}}


def _post(summary: str, schema: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": "JSON, or text/event-stream when stream is true"},
                      "400": _ERROR, "401": _ERROR, "404": _ERROR, "429": _ERROR, "503": _ERROR},
    }}


@functools.cache
def openapi_schema() -> dict:
    _, defs = models_json_schema(
        [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "CDE, the Causal Diffusion Engine", "version": "1"},
        "paths": {
            "/v1/completions": _post("Text completion", "CompletionRequest"),
            "/v1/chat/completions": _post("Chat completion (instruct checkpoints)", "ChatCompletionRequest"),
            "/v1/models": {"get": {"summary": "The served model", "responses": {"200": {"description": "model list"}}}},
            "/v1/concepts": {"get": {"summary": "Search concept labels (?search=, ?limit=)",
                                     "responses": {"200": {"description": "concept list"}, "400": _ERROR}}},
            "/v1/concepts/{concept_id}": {"get": {"summary": "A known concept's top promoted tokens (?k=)",
                                                  "responses": {"200": {"description": "concept"}, "400": _ERROR, "404": _ERROR}}},
            "/health": {"get": {"summary": "200 when a worker is alive, else 503", "responses": {"200": {"description": "ready"}, "503": {"description": "no live worker"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text exposition"}}}},
        },
        "components": {"schemas": defs["$defs"]},
    }
