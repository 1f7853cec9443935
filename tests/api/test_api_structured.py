"""Structured outputs through a real `cde serve` of the demo model (cde-reference), with the real
`openai` client: every constrained answer parses and validates (jsonschema) against its schema,
every schema at tokens_per_step 4, one of each kind also at 1, streamed and steered; completions'
`structured_outputs`; logprobs of the tokens a grammar bans; bad schemas are a 400 naming the
field. Tools: tests/api/test_api_tools.py."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs
from pydantic import BaseModel, Field

from tests.api.json_schema_cases import SCHEMAS
from tests.shared.test_schema_finite import SELF_KEY

MODEL = "cde-reference"
MAX_TOKENS = 96


def ask(client, schema: dict, stream: bool, **extra) -> tuple[str, str]:
    """(text, finish_reason) of a chat answer constrained to `schema`."""
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        extra_body=extra,
    )
    if not stream:
        c = client.chat.completions.create(**args).choices[0]
        return c.message.content, c.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


# mode: (streamed, extra body, schemas). Every schema at 4 tokens a step: each pass's first pick under
# the grammar's bitmask (all that 1 token a step does) and the drafts kept while the grammar accepts
# them, which is what a schema's shape changes. One pick a pass, the stream's deltas and a steered
# forward take the same path whatever the schema: one schema of each kind.
KINDS = [
    "flat",  # a free string, a bounded integer
    "string_pattern",
    "number_bounds",  # a number, multipleOf
    "const",
    "optional",  # a field the model may leave out
    "deep",  # nested objects
    "array_objects",
    "tuple",  # a top-level array, prefixItems
    "any_of_objects",
]
MODES = {
    "plain-k1": (False, {"tokens_per_step": 1}, KINDS),
    "plain-k4": (False, {"tokens_per_step": 4}, list(SCHEMAS)),
    "streamed-k4": (True, {"tokens_per_step": 4}, KINDS),
    "steered-k4": (True, {"tokens_per_step": 4, "steering": {"concepts": [1, 5], "strength": 24.0}}, KINDS),
}


@pytest.fixture(scope="module")
def schema_answers(client):
    """A mode's {schema name: (text, finish_reason)}, asked once per module."""
    done = {}

    def of(mode: str) -> dict[str, tuple[str, str]]:
        if mode not in done:
            stream, extra, names = MODES[mode]
            with ThreadPoolExecutor(len(names)) as pool:  # one batch in the engine
                done[mode] = dict(zip(names, pool.map(lambda n: ask(client, SCHEMAS[n], stream, **extra), names)))
        return done[mode]

    return of


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_every_schema_answer_parses_and_validates(schema_answers, mode):
    for name, (text, finish) in schema_answers(mode).items():
        assert finish == "stop", f"{name}: {finish} {text!r}"
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        assert text == text.strip(), f"{name}: whitespace around the JSON {text!r}"


def test_steering_changes_a_constrained_answer(schema_answers):
    plain, steered = schema_answers("plain-k4")["flat"][0], schema_answers("steered-k4")["flat"][0]
    assert plain != steered  # else the steered mode above would test nothing


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    likes_tea: bool


DESCRIBE = [{"role": "user", "content": "Describe a person."}]
PARSE_ARGS = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, extra_body={"tokens_per_step": 4})


@pytest.fixture(scope="module")
def parsed(client):
    """parse()'s answer with the Person model (both tests below read it)."""
    return client.chat.completions.parse(messages=DESCRIBE, response_format=Person, **PARSE_ARGS)


def test_openai_parse_with_a_pydantic_model(parsed):
    r = parsed
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Person)
    assert msg.parsed == Person.model_validate_json(msg.content)


# The SDK's own dump of the parsed reply warns that `parsed` is typed None there; it sends it right.
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_parse_replies_fed_back_change_nothing(client, parsed):
    """The SDK's documented loop appends parse()'s message itself: its `parsed` and its calls'
    `function.parsed_arguments` are accepted and ignored, as vLLM does (docs/api.md)."""
    ask = DESCRIBE
    said = parsed.choices[0].message
    tool = openai.pydantic_function_tool(Person)
    called = client.chat.completions.parse(messages=ask, tools=[tool], tool_choice="required", **PARSE_ARGS)
    called = called.choices[0].message
    assert isinstance(said.parsed, Person) and isinstance(called.tool_calls[0].function.parsed_arguments, Person)
    calls = [
        {"id": t.id, "type": "function", "function": t.function.model_dump(include={"name", "arguments"})}
        for t in called.tool_calls
    ]
    results = [{"role": "tool", "tool_call_id": t.id, "content": "ok"} for t in called.tool_calls]
    after = [{"role": "user", "content": "Another."}]

    def ids(*history):
        r = client.chat.completions.create(
            model=MODEL, messages=[*ask, *history], tools=[tool], max_tokens=1, extra_body={"return_token_ids": True}
        )
        return r.prompt_token_ids  # (the prompt's ids: one generated token is enough)

    assert ids(said, *after) == ids({"role": "assistant", "content": said.content}, *after)
    assert ids(called, *results) == ids({"role": "assistant", "content": None, "tool_calls": calls}, *results)


def test_json_object_answers_an_object(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please."}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"tokens_per_step": 4},
    )
    c = r.choices[0]
    # An open object may run to max_tokens on this model: then it is cut ("length"), else it parses.
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize(
    "outputs,check",
    [
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-" and t[4:].isalpha()),
        ({"json": SCHEMAS["nested"]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["nested"]) is None),
        ({"grammar": 'start: "A" B\nB: /[xy]{2}/'}, lambda t: t[0] == "A" and set(t[1:]) <= {"x", "y"} and len(t) == 3),
    ],
)
def test_completions_structured_outputs(client, outputs, check):
    r = client.completions.create(
        model=MODEL,
        prompt="The answer:",
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": outputs, "tokens_per_step": 4},
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and check(c.text), c.text


def test_max_tokens_cuts_a_constrained_answer_with_length(client):
    text, finish = ask(client, SCHEMAS["flat"], False, max_tokens=3)
    assert finish == "length" and text.startswith("{")


BANNED = -9999.0  # vLLM's logprob for -inf; OpenAI's type is a number, never null
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
LOGPROB_CASES = {
    "response_format": (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": FLAG}}},
    ),
    "tools": (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": FLAG}}], "tool_choice": "required"},
    ),
    "structured_outputs": ("completions", {"structured_outputs": {"choice": ["yes", "no"]}}),
}


def answers(server, endpoint: str, body: dict) -> list[dict]:
    """The JSON body, or each chunk of a stream."""
    url = f"{server.base_url}/{endpoint}"
    if not body["stream"]:
        return [httpx.post(url, json=body, timeout=300).json()]
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def logprob_numbers(lp: dict) -> list:
    if "content" in lp:  # chat
        return [x["logprob"] for t in lp["content"] for x in [t, *t["top_logprobs"]]]
    return lp["token_logprobs"] + [x for top in lp["top_logprobs"] for x in top.values()]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(LOGPROB_CASES))
def test_logprobs_of_tokens_a_grammar_bans_are_numbers(server, case, stream):
    """A grammar leaves fewer tokens than the alternatives asked for: the others' logprob is -inf,
    written as vLLM writes it, so that the SDK's types take the answer (a stream's chunks: their
    logprobs; the SDK's completion chunk type wants a finish_reason on every chunk)."""
    endpoint, constraint = LOGPROB_CASES[case]
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": stream, **constraint}
    if endpoint == "chat":
        body |= {"messages": [{"role": "user", "content": "Is it good?"}], "logprobs": True, "top_logprobs": 5}
        whole, logprobs_type = ChatCompletion, ChoiceLogprobs
    else:
        body |= {"prompt": "Answer:", "logprobs": 5}
        whole, logprobs_type = Completion, Logprobs
    got = answers(server, "chat/completions" if endpoint == "chat" else "completions", body)
    if not stream:
        whole.model_validate(got[0])
    numbers = []
    for c in (c for a in got for c in a["choices"] if c.get("logprobs")):
        logprobs_type.model_validate(c["logprobs"])
        numbers += logprob_numbers(c["logprobs"])
    assert BANNED in numbers and all(x == BANNED or BANNED < x <= 0 for x in numbers), numbers


@pytest.mark.parametrize(
    "field,value,param",
    [
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            "response_format",
        ),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/none"}}},
            "response_format",
        ),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
            "response_format",
        ),
        ("response_format", {"type": "json_schema"}, "response_format"),
        ("response_format", {"type": "yaml"}, "response_format"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "big", "schema": {"enum": ["x" * 40000]}}},
            "response_format",
        ),
        ("structured_outputs", {"regex": "(unclosed"}, "structured_outputs"),
        ("structured_outputs", {"grammar": "start: undefined_rule"}, "structured_outputs"),
        # valid Lark whose language is empty: only the first mask shows it (was a 500 from the worker)
        ("structured_outputs", {"grammar": 'start: x\nx: x "a"'}, "structured_outputs"),
        # ~20 s of compile (a forced literal, quadratic in llguidance): killed at the checker's bound
        ("structured_outputs", {"regex": "a{300000}"}, "structured_outputs"),
        (
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 3, "maxLength": 1}},
            },
            "response_format",
        ),
        ("structured_outputs", {"json": {}, "regex": "a"}, "structured_outputs"),
        ("structured_outputs", {}, "structured_outputs"),
        # a key whose value never ends: the answer met a dead end mid-way (was a 500 from the worker)
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_KEY}},
            "response_format",
        ),
        ("structured_outputs", {"json": SELF_KEY}, "structured_outputs"),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": SELF_KEY}}], "tools"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(client, field, value, param):
    body = {field: value} if field in ("response_format", "tools") else {"extra_body": {field: value}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, **body)
    assert e.value.body["param"].startswith(param), e.value.body


def test_response_format_and_structured_outputs_together_are_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"choice": ["a"]}},
        )
    assert e.value.body["param"] == "structured_outputs"


# Cheap masks for `{"b":1,` (the gateway's first-mask check passes it), then one of ~140 ms:
# a 20,000-character const escapes llguidance's fuel (tests/worker/test_constraint.py).
SLOW_LATER = {
    "type": "object",
    "properties": {"b": {"enum": [1, 2]}, "a": {"const": "a" * 20_000}},
    "required": ["b", "a"],
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "field,constraint,code",
    [
        ("structured_outputs", {"grammar": 'start: "a" x\nx: x "b"'}, "grammar_dead_end"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW_LATER}},
            "grammar_too_slow",
        ),
    ],
    ids=["dead_end", "too_slow"],
)
def test_a_grammar_that_fails_mid_answer_is_a_400_naming_it(server, stream, field, constraint, code):
    """A Lark rule that only recurses passes the first mask ("a" can start the answer); after "a"
    no token continues it. A schema whose first masks are cheap reaches a const whose mask takes
    the engine thread past its bound. Both are the request's fault: a 400 naming the field
    (streamed: the error event), not a 500 a client retries (the openai SDK sends it three times)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 16,
        field: constraint,
        "stream": stream,
    }
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)
    if stream:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        error = events[-1]["error"]
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["param"] == field and error["code"] == code, error
    assert error["type"] == "invalid_request_error"
