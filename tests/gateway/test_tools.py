"""gateway/tools.py: the grammar of a tool-calling answer, on llguidance's own matcher."""

import pytest
from cde.gateway.chat_schemas import ChatCompletionRequest
from cde.gateway.errors import ApiError
from cde.gateway.tools import active_tools, tools_grammar
from cde.shared.config import BASE_VOCAB
from cde.shared.grammar import ll_tokenizer, new_matcher
from cde.shared.tokenizer import get_tokenizer

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}


@pytest.mark.parametrize(
    "parameters,arguments,ok",
    [
        (ADD, '{"a":1,"b":2}', True),
        (ADD, '{"a":1,"b":2,"c":3}', False),  # LangChain's @tool leaves additionalProperties out
        ({**ADD, "additionalProperties": True}, '{"a":1,"b":2,"c":3}', True),
    ],
)
def test_a_call_takes_the_declared_arguments_only(parameters, arguments, ok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": parameters}}]
    answer = f'<tool_call>{{"name":"add","arguments":{arguments}}}</tool_call>'
    assert matches({"tools": tools, "tool_choice": "required"}, answer) is ok


def matches(body: dict, text: str) -> bool:
    """Whether the request's tools grammar takes the whole answer `text`."""
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "go"}], **body})
    matcher = new_matcher(tools_grammar(req, active_tools(req), None), ll_tokenizer(False, BASE_VOCAB))
    ids = get_tokenizer(False).enc.encode(text)
    return matcher.validate_tokens(ids) == len(ids)


def defined(key: str) -> dict:
    """Parameters whose enum is a definition under `key` ($defs: pydantic v2; definitions: v1)."""
    return {
        "type": "object",
        key: {"Unit": {"enum": ["C", "F"]}},
        "properties": {"unit": {"$ref": f"#/{key}/Unit"}},
        "required": ["unit"],
    }


@pytest.mark.parametrize("key", ["$defs", "definitions"])
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "a"}}])
def test_definitions_a_tool_refers_to_are_found_whatever_the_choice(key, choice):
    tools = [{"type": "function", "function": {"name": n, "parameters": defined(key)}} for n in ("a", "b")]
    body = {"tools": tools, "tool_choice": choice}
    assert matches(body, '<tool_call>{"name":"a","arguments":{"unit":"F"}}</tool_call>')
    assert not matches(body, '<tool_call>{"name":"a","arguments":{"unit":"K"}}</tool_call>')


def test_a_named_functions_parameters_are_the_root_of_its_arguments():
    """Any pointer resolves from the parameters, as vLLM compiles a named function's schema."""
    params = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}
    body = {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    assert matches(body, '<tool_call>{"name":"f","arguments":{"a":1,"b":2}}</tool_call>')
    assert not matches(body, '<tool_call>{"name":"f","arguments":{"a":1,"b":"x"}}</tool_call>')


@pytest.mark.parametrize(
    "defs,said",
    [({"Unit": {"enum": ["K"]}}, "'Unit' differently"), (["Unit"], "map names to schemas")],
)
def test_definitions_that_cannot_be_lifted_are_a_400_naming_tools(defs, said):
    """Two tools defining one name differently (vLLM refuses it too), or definitions not a map."""
    tools = [
        {"type": "function", "function": {"name": n, "parameters": p}}
        for n, p in (("a", defined("$defs")), ("b", {**defined("$defs"), "$defs": defs}))
    ]
    with pytest.raises(ApiError) as e:
        matches({"tools": tools, "tool_choice": "required"}, "")
    assert e.value.param == "tools" and said in e.value.message


@pytest.mark.parametrize("function", [{"name": "f"}, {"name": "f", "parameters": {}}])
def test_parameters_left_out_or_empty_take_no_arguments(function):
    """OpenAI: "Omitting `parameters` defines a function with an empty parameter list"."""
    body = {"tools": [{"type": "function", "function": function}], "tool_choice": "required"}
    assert matches(body, '<tool_call>{"name":"f","arguments":{}}</tool_call>')
    assert not matches(body, '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>')
    assert not matches(body, '<tool_call>{"name":"f","arguments":"x"}</tool_call>')
