"""Tools through a real `cde serve` of the demo model, with the real `openai` client, LangChain
(`with_structured_output`, `bind_tools` with the tool's result fed back) and litellm (`tools=`, its
reply fed back): calls whose arguments validate against the function's schema (pydantic's `$defs`
included), `finish_reason: "tool_calls"` (`"stop"` for a named function), streamed
`delta.tool_calls`, calls cut by max_tokens the same streamed or not, history with tool calls
rendered by the documented template, bad tool specs a 400 naming the field."""

import json
from enum import StrEnum

import httpx
import jsonschema
import openai
import pytest
from cde.shared.tokenizer import get_tokenizer
from pydantic import BaseModel, Field

MODEL = "cde-reference"
FAST = {"tokens_per_step": 4}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, **kw):
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0, extra_body=FAST)
    return client.chat.completions.create(**{**args, **kw})


def check_calls(calls, names=("get_weather", "get_time")) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize(
    "choice,names",
    [
        ("required", ("get_weather", "get_time")),
        ({"type": "function", "function": {"name": "get_time"}}, ("get_time",)),
    ],
)
def test_required_and_named_choices_call_with_valid_arguments(client, choice, names):
    """Streamed or not, calls the model chose end "tool_calls"; the named function's call ends
    "stop" (OpenAI's and vLLM's finish_reason)."""
    c = chat(client, tool_choice=choice).choices[0]
    finish = "stop" if isinstance(choice, dict) else "tool_calls"
    assert c.finish_reason == finish and c.message.content is None
    check_calls(c.message.tool_calls, names)
    if isinstance(choice, dict):
        assert len(c.message.tool_calls) == 1
    calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
    assert streamed(client, tool_choice=choice) == ("", calls, finish)


class Unit(StrEnum):
    C = "C"
    F = "F"


class Place(BaseModel):
    city: str = Field(max_length=10)


class Forecast(BaseModel):
    place: Place
    unit: Unit


class Alert(BaseModel):
    unit: Unit
    above: int = Field(ge=-50, le=50)


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "Forecast"}}])
def test_pydantic_tools_with_definitions_are_called_with_valid_arguments(client, choice):
    """pydantic writes an enum or a nested model as `$defs` and `$ref`s to them (`#/$defs/Unit`):
    they resolve whatever the choice; two tools may define the same name alike."""
    models = {m.__name__: m for m in (Forecast, Alert)}
    tools = [openai.pydantic_function_tool(m) for m in models.values()]
    assert all("$defs" in t["function"]["parameters"] for t in tools)
    c = chat(client, tools=tools, tool_choice=choice, parallel_tool_calls=False).choices[0]
    for call in c.message.tool_calls or []:
        models[call.function.name].model_validate_json(call.function.arguments)
    assert choice == "auto" or len(c.message.tool_calls) == 1


@pytest.mark.parametrize("function", [{"name": "now"}, {"name": "now", "parameters": {}}])
def test_a_function_without_parameters_is_called_without_arguments(client, function):
    """OpenAI: "Omitting `parameters` defines a function with an empty parameter list"."""
    tools = [{"type": "function", "function": function}]
    c = chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert c.finish_reason == "tool_calls"
    assert [json.loads(t.function.arguments) for t in c.message.tool_calls] == [{}]


@pytest.mark.parametrize("arguments", ["", None])
def test_a_past_call_without_arguments_is_read_as_empty_arguments(client, arguments):
    """As vLLM reads them: a call's `arguments` "" or null are `{}`."""

    def prompt(args):
        call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": args}}
        history = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        ]
        r = chat(client, messages=history, max_tokens=1, extra_body={**FAST, "return_token_ids": True})
        return r.model_extra["prompt_token_ids"]

    assert prompt(arguments) == prompt("{}")


def test_parallel_tool_calls_false_allows_one_call(client):
    c = chat(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1


def test_auto_answers_text_or_calls(client):
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        c = chat(client, messages=messages, tool_choice="auto").choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            check_calls(c.message.tool_calls)
        else:
            assert c.message.content and not c.message.content.startswith("<tool_call>")


def test_streamed_tool_calls_are_the_whole_answers(client):
    """Streamed as written: a call's first chunk has its id and name, later chunks more of its
    arguments; joined, the calls of the same request unstreamed."""
    whole = chat(client, tool_choice="required").choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finishes, chunks_with_calls = [], 0
    for k, chunk in enumerate(chat(client, tool_choice="required", stream=True)):
        for c in chunk.choices:
            finishes += [c.finish_reason] if c.finish_reason else []
            assert not c.delta.content
            # no empty delta while the text that opens a call is held (OpenAI sends none)
            assert k == 0 or c.delta.tool_calls or c.finish_reason, chunk
            chunks_with_calls += bool(c.delta.tool_calls)
            for d in c.delta.tool_calls or []:
                first = d.index not in calls
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                assert (d.id is not None) == (d.type == "function") == (d.function.name is not None) == first
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finishes == ["tool_calls"] and chunks_with_calls > 1
    assert [calls[i] for i in sorted(calls)] == [
        {"name": w.function.name, "arguments": w.function.arguments} for w in whole
    ]


def streamed(client, **kw) -> tuple[str, list[dict], str | None]:
    """(content, calls, finish_reason) that a streamed answer's chunks join to."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("max_tokens", [16, 20])  # greedy: cut in the arguments; in the closing tag
def test_calls_cut_by_max_tokens_are_calls_streamed_or_not(client, max_tokens):
    """Unstreamed as streamed: what was written of the calls, as calls, finishing "length"; the
    call markup never reaches `content`."""
    kw = dict(tool_choice="required", max_tokens=max_tokens, extra_body={**FAST, "return_token_ids": True})
    c = chat(client, **kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None and c.message.tool_calls, c.message
    calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
    written = "".join(f'<tool_call>{{"name":"{t["name"]}","arguments":{t["arguments"]}}}</tool_call>' for t in calls)
    assert get_tokenizer(True).decode(c.token_ids).startswith(written[: -len("}</tool_call>")])
    for call in c.message.tool_calls[:-1]:  # the last call is the one cut
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    assert streamed(client, **kw) == ("", calls, "length")


HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
]


def test_tokenize_with_tools_counts_what_the_chat_request_feeds(server, client):
    """vLLM's /tokenize takes the tools too: the ids a chat request with them feeds the model."""
    r = chat(client, tool_choice="none", max_tokens=2, extra_body={**FAST, "return_token_ids": True})
    tokenized = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": ASK, "tools": TOOLS}, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == r.model_extra["prompt_token_ids"]
    assert r.usage.prompt_tokens == tokenized.json()["count"] > len(get_tokenizer(True).chat_prompt(ASK))


def test_history_with_tool_calls_is_rendered_by_the_documented_template(client):
    r = chat(client, messages=HISTORY, tool_choice="none", max_tokens=4, extra_body={**FAST, "return_token_ids": True})
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    tools_turn = (
        "You can call these functions. Each line is one function: its name, description and the JSON schema of "
        "its arguments.\n<tools>\n"
        + "\n".join(
            json.dumps(
                {
                    "name": t["function"]["name"],
                    "description": t["function"].get("description", ""),
                    "parameters": t["function"]["parameters"],
                },
                separators=(",", ":"),
            )
            for t in TOOLS
        )
        + "\n</tools>\nTo call functions, answer only with one "
        + '<tool_call>{"name":"NAME","arguments":{...}}</tool_call> per call; otherwise answer in text.'
    )
    expected = get_tokenizer(True).chat_prompt(
        [
            {"role": "system", "content": tools_turn},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo","unit":"C"}}</tool_call>',
            },
            {"role": "tool", "content": "-3 C, snow"},
        ]
    )
    assert r.model_extra["prompt_token_ids"] == expected


def test_an_assistant_turn_of_calls_may_leave_content_out(client):
    """OpenAI's assistant message needs content only without tool_calls; litellm sends it so."""
    without = [{k: v for k, v in m.items() if k != "content" or v is not None} for m in HISTORY]
    assert "content" not in without[1]

    def ids(history):
        r = chat(
            client, messages=history, tool_choice="none", max_tokens=4, extra_body={**FAST, "return_token_ids": True}
        )
        return r.model_extra["prompt_token_ids"], r.choices[0].token_ids

    assert ids(without) == ids(HISTORY)


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        (  # OpenAI's rule: arguments are an object
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        (  # two tools defining one name differently
            {
                "tools": [
                    {"type": "function", "function": {"name": n, "parameters": {"$defs": {"Unit": {"enum": u}}}}}
                    for n, u in (("a", ["C"]), ("b", ["F"]))
                ]
            },
            "tools",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages"),
        ({"messages": [{"role": "assistant"}]}, "messages.0"),
        ({"messages": [{"role": "user"}]}, "messages.0"),
    ],
)
def test_a_bad_tool_spec_is_a_400_naming_it(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **{"max_tokens": 4, **kw})
    assert e.value.body["param"].startswith(param), e.value.body


def test_a_reply_the_sdk_stream_built_goes_back_into_the_history(client):
    """OpenAI's documented loop with the SDK's stream helper: its final message (whose calls keep
    their stream `index`) appended as it is, then the tool's result."""
    kw = dict(model=MODEL, temperature=0, extra_body=FAST)
    tool = openai.pydantic_function_tool(Weather)
    with client.chat.completions.stream(
        messages=ASK, tools=[tool], tool_choice="required", max_tokens=96, **kw
    ) as stream:
        message = stream.get_final_completion().choices[0].message
    (call,) = message.tool_calls
    assert message.content is None  # as unstreamed (`test_calls_cut_by_max_tokens_are_calls_streamed_or_not`)
    assert call.model_dump()["index"] == 0
    results = [{"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
    for history in ([*ASK, message, *results], [*ASK, message.model_dump(), *results]):
        r = client.chat.completions.create(messages=history, tools=[tool], max_tokens=4, **kw)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# What pydantic writes for set[str] and Path: keywords and formats llguidance does not implement.
LAX = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "uniqueItems": True, "maxItems": 2},
        "where": {"type": "string", "format": "path", "maxLength": 8},
    },
    "required": ["tags", "where"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_tool_schema_with_keywords_llguidance_lacks_is_lenient_unless_strict(client, choice):
    """Non-strict tools (LangChain's bind_tools, litellm) leave what llguidance cannot enforce
    unenforced, as OpenAI does; every other keyword still holds. A strict tool is refused."""
    tools = [{"type": "function", "function": {"name": "tag", "parameters": LAX}}]
    c = chat(client, tools=tools, tool_choice=choice).choices[0]
    for call in c.message.tool_calls or []:
        args = json.loads(call.function.arguments)
        assert set(args) == {"tags", "where"} and len(args["tags"]) <= 2 and len(args["where"]) <= 8
        assert all(isinstance(t, str) and len(t) <= 6 for t in args["tags"])
    assert choice == "auto" or c.message.tool_calls
    strict = [{"type": "function", "function": {"name": "tag", "parameters": LAX, "strict": True}}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=strict, tool_choice=choice, max_tokens=4)
    assert e.value.body["param"] == "tools" and "uniqueItems" in e.value.body["message"]


def test_a_response_format_with_keywords_llguidance_lacks_is_lenient_unless_strict(client):
    def answer(strict):
        fmt = {"type": "json_schema", "json_schema": {"name": "tags", "schema": LAX, "strict": strict}}
        return client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, max_tokens=64, temperature=0, extra_body=FAST
        )

    c = answer(None).choices[0]
    if c.finish_reason == "stop":
        assert set(json.loads(c.message.content)) == {"tags", "where"}
    with pytest.raises(openai.BadRequestError) as e:
        answer(True)
    assert e.value.body["param"] == "response_format" and "uniqueItems" in e.value.body["message"]


# ---- other clients -------------------------------------------------------------------------------
class Weather(BaseModel):
    """Weather of a city."""

    city: str = Field(max_length=10)
    celsius: int = Field(ge=-50, le=50)


def langchain_llm(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL,
        base_url=server.base_url,
        api_key="none",
        temperature=0,
        max_tokens=96,
        extra_body=FAST,
        max_retries=0,
    )


def test_langchain_with_structured_output(server):
    got = langchain_llm(server).with_structured_output(Weather).invoke("Weather in Rome?")
    assert isinstance(got, Weather)


def test_langchain_bind_tools_round_trip(server):
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = langchain_llm(server)
    asked = [HumanMessage("Weather in Rome?")]
    ai = llm.bind_tools([Weather], tool_choice="Weather", strict=True).invoke(asked)
    (call,) = ai.tool_calls
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])
    final = llm.bind_tools([Weather], strict=True).invoke(
        [*asked, ai, ToolMessage("21 C, sunny", tool_call_id=call["id"])]
    )
    assert isinstance(final.content, str)
    assert final.tool_calls or final.content  # auto: text, or another call


def test_litellm_tools_round_trip(server):
    """litellm's documented loop: its Message appended as it is (it leaves a null content out),
    then the tool's result."""
    import litellm

    kw = dict(model=f"openai/{MODEL}", api_base=server.base_url, api_key="none", temperature=0, extra_body=FAST)
    r = litellm.completion(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96, **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    results = [{"role": "tool", "tool_call_id": t.id, "content": "21 C"} for t in c.message.tool_calls]
    final = litellm.completion(messages=[*ASK, c.message, *results], tools=TOOLS, max_tokens=8, **kw)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_call_cut_by_max_tokens_goes_back_into_the_history_as_written(server):
    """An answer cut inside a call's arguments (`finish_reason: "length"`, arguments `{"city":`)
    sent back as the next turn's history (LangChain's bind_tools loop does): OpenAI takes
    `arguments` as an opaque string, so it is accepted and rendered as the model wrote it."""
    cut = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":'}}
    written = '<tool_call>{"name":"get_weather","arguments":{"city":}</tool_call>'

    def prompt(reply: dict) -> list[int]:
        body = {"model": MODEL, "messages": [*ASK, reply, ASK[0]], "max_tokens": 1, "return_token_ids": True}
        r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"]

    assert prompt({"role": "assistant", "content": None, "tool_calls": [cut]}) == prompt(
        {"role": "assistant", "content": written}
    )
