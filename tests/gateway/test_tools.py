"""gateway/tools.py: the grammar of a tool-calling answer, on llguidance's own matcher."""

import pytest
from cde.gateway.schemas import ChatCompletionRequest
from cde.gateway.tools import tools_grammar
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
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "add"}],
            "tools": [{"type": "function", "function": {"name": "add", "parameters": parameters}}],
            "tool_choice": "required",
        }
    )
    matcher = new_matcher(tools_grammar(body, body.tools, None), ll_tokenizer(False, BASE_VOCAB))
    ids = get_tokenizer(False).enc.encode(f'<tool_call>{{"name":"add","arguments":{arguments}}}</tool_call>')
    taken = matcher.validate_tokens(ids)
    assert (taken == len(ids)) is ok
