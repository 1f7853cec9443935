"""Schemathesis holds real answers of a real `cde serve` of the demo model to its own /openapi.json:
completions and chat, whole and streamed (every SSE event's JSON against the `contentSchema` the
document gives), with every optional part of a response switched on somewhere (logprobs, usage,
token ids, echo, tool calls, concept, per-token and input attribution, stream_denoise steps), and
the error answers. A fixed set of bodies: the fuzzing of test_api_fuzz.py is random, these make
sure each shape is produced and checked."""

import json

import jsonschema
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MODEL = "cde-reference"
FAST = {"max_tokens": 8, "tokens_per_step": 4, "temperature": 0}
ATTRIBUTION = {"top_k": 3, "per_token": True, "inputs": {"top_k": 2, "steps": 1}}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
STREAM = {"stream": True, "stream_options": {"include_usage": True}}

COMPLETIONS = {
    "plain": {"prompt": "The sea", **FAST},
    "everything": {"prompt": ["The sea", "A ship"], "n": 2, "logprobs": 2, "return_token_ids": True, **FAST},
    "echo": {"prompt": [791, 9581], "echo": True, "return_token_ids": True, **FAST},
    "attribution": {"prompt": "The sea", "attribution": ATTRIBUTION, **FAST},
    "stream": {"prompt": "The sea", "logprobs": 1, "return_token_ids": True, "echo": False, **STREAM, **FAST},
    "stream echo": {"prompt": "The sea", "echo": True, **STREAM, **FAST},
    "stream usage so far": {
        "prompt": "The sea",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **FAST,
    },
    "stream attribution": {"prompt": "The sea", "attribution": ATTRIBUTION, "stream": True, **FAST},
    "stream denoise": {
        "prompt": "The sea",
        "stream": True,
        "stream_denoise": True,
        "attribution": {"top_k": 3, "per_token": True},
        **FAST,
    },
}
CHAT = {
    "plain": {"messages": ASK, **FAST},
    "everything": {"messages": ASK, "n": 2, "logprobs": True, "top_logprobs": 2, "return_token_ids": True, **FAST},
    "tool calls": {"messages": ASK, "tools": TOOLS, "tool_choice": "required", **FAST, "max_tokens": 96},
    "attribution": {"messages": ASK, "attribution": ATTRIBUTION, **FAST},
    "stream": {"messages": ASK, "logprobs": True, "top_logprobs": 1, "return_token_ids": True, **STREAM, **FAST},
    "stream tool calls": {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        **STREAM,
        **FAST,
        "max_tokens": 96,
    },
    "stream denoise": {
        "messages": ASK,
        "stream": True,
        "stream_denoise": True,
        "attribution": {"top_k": 3, "per_token": True},
        **FAST,
    },
}
ERRORS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400),
    ("/v1/completions", {"prompt": "hi", "stream": True, "suffix": "x"}, 400),
    ("/v1/chat/completions", {"messages": ASK, "model": "no-such-model"}, 404),
    ("/v1/chat/completions", {"messages": ASK, "stream": True, "top_logprobs": 2}, 400),
]
# The checks that read a response; those that judge the request (whether a body the schema
# allows may be refused: prompt + max_tokens over the context) belong to test_api_fuzz.py.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def api(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.max_stream_events = 10_000  # whole streams (schemathesis reads 20 events by default)
    return schema


@pytest.fixture(scope="module")
def event_data_check(api):
    """A check for what schemathesis leaves alone in an event stream: each event's `data` is text,
    whose JSON the document describes in `contentSchema` (Open API 3.1 has no other place)."""
    doc = api.raw_schema

    def event_data_conforms(ctx, response, case):
        if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            return None
        ok = doc["paths"][case.operation.path]["post"]["responses"]["200"]["content"]["text/event-stream"]
        data = ok["schema"]["properties"]["data"]["anyOf"][1]["contentSchema"]
        validator = jsonschema.Draft202012Validator({**data, "components": doc["components"]})
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            validator.validate(json.loads(event))
        return True

    return event_data_conforms


def checked(api, check, path: str, body: dict):
    case = api[path]["POST"].Case(body={"model": MODEL, **body})
    response = case.call(timeout=300)
    case.validate_response(response, checks=[*CHECKS, check])
    return response


def succeeded(response) -> bool:
    """A 200 whose stream carried no error event (the schema allows one: a generation that fails
    after the status line went out)."""
    return response.status_code == 200 and '{"error":' not in response.text


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_completions_answer_as_documented(api, event_data_check, name):
    response = checked(api, event_data_check, "/v1/completions", COMPLETIONS[name])
    assert succeeded(response), response.text


@pytest.mark.parametrize("name", list(CHAT))
def test_chat_answers_as_documented(api, event_data_check, name):
    response = checked(api, event_data_check, "/v1/chat/completions", CHAT[name])
    assert succeeded(response), response.text
    if "tool calls" in name:
        assert '"tool_calls"' in response.text  # the calls' shape was produced, so it was checked


@pytest.mark.parametrize("path,body,status", ERRORS)
def test_errors_answer_as_documented(api, event_data_check, path, body, status):
    response = checked(api, event_data_check, path, body)
    assert response.status_code == status, response.text


def test_models_answer_as_documented(api):
    for path, params in (("/v1/models", None), ("/v1/models/{model}", {"model": MODEL})):
        case = api[path]["GET"].Case(path_parameters=params)
        response = case.call(timeout=30)
        case.validate_response(response, checks=CHECKS)
        assert response.status_code == 200


def test_concepts_and_tokenizer_routes_answer_as_documented(api):
    """The routes beside generation: concept list, search and entry, /tokenize in both forms,
    /detokenize, each answer held to its closed schema."""
    for path, params, query in (
        ("/v1/concepts", None, None),
        ("/v1/concepts", None, {"search": "ocean", "limit": 3}),
        ("/v1/concepts/{concept_id}", {"concept_id": 0}, {"k": 2}),
    ):
        case = api[path]["GET"].Case(path_parameters=params, query=query)
        response = case.call(timeout=30)
        case.validate_response(response, checks=CHECKS)
        assert response.status_code == 200 and response.json(), response.text
    for path, body in (
        ("/tokenize", {"prompt": "The sea", "return_token_strs": True}),
        ("/tokenize", {"messages": ASK}),
        ("/detokenize", {"tokens": [791, 9581]}),
    ):
        case = api[path]["POST"].Case(body={"model": MODEL, **body})
        response = case.call(timeout=30)
        case.validate_response(response, checks=CHECKS)
        assert response.status_code == 200, response.text


def test_the_document_leaves_no_response_untyped(api):
    """Every JSON answer of the generation routes, and every object under it, is a closed schema:
    what the route writes is all described (no `object` of anything, as `choices` once was)."""
    doc = api.raw_schema
    schemas = doc["components"]["schemas"]
    response_names = {
        "CompletionResponse",
        "CompletionChunk",
        "ChatCompletionResponse",
        "ChatCompletionChunk",
        "StepChunk",
        "ModelList",
    }
    seen: set[str] = set()

    def walk(schema):
        if isinstance(schema, list):
            for s in schema:
                walk(s)
            return
        if not isinstance(schema, dict):
            return
        ref = schema.get("$ref", "").removeprefix("#/components/schemas/")
        if ref and ref not in seen:
            seen.add(ref)
            walk(schemas[ref])
        if schema.get("type") == "object" and "properties" in schema:
            assert schema.get("additionalProperties") is False, schema
        if schema.get("type") == "array":
            assert "items" in schema and schema["items"] != {"type": "object"}, schema
        for key, value in schema.items():
            if key != "$ref":
                walk(value)

    for name in response_names:
        walk({"$ref": f"#/components/schemas/{name}"})
    for path in ("/v1/concepts", "/v1/concepts/{concept_id}", "/tokenize", "/detokenize"):
        (operation,) = doc["paths"][path].values()
        walk(operation["responses"]["200"]["content"]["application/json"]["schema"])
    assert {"CompletionChoice", "ChatStreamChoice", "Attribution", "TokenAttribution", "DeltaToolCall"} <= seen
