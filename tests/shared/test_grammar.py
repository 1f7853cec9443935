"""shared/grammar.py: object schemas that list their properties take no others unless they say so
(xgrammar's strict mode, vLLM's and SGLang's default), checked on llguidance's own matcher."""

import pytest
from cde.shared.config import BASE_VOCAB
from cde.shared.grammar import (
    closed_objects,
    grammar_error,
    json_schema_grammar,
    lark_grammar,
    ll_tokenizer,
    new_matcher,
)
from cde.shared.tokenizer import get_tokenizer

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def accepts(schema: dict, text: str) -> bool:
    """Whether the grammar of `schema` takes `text` as a whole answer."""
    matcher = new_matcher(json_schema_grammar(schema), ll_tokenizer(False, BASE_VOCAB))
    ids = get_tokenizer(False).enc.encode(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize(
    "schema,text,ok",
    [
        (POINT, '{"x":1}', True),
        (POINT, '{"x":1,"y":2}', False),  # undeclared: refused
        ({**POINT, "additionalProperties": True}, '{"x":1,"y":2}', True),  # the schema's own word
        ({**POINT, "additionalProperties": {"type": "string"}}, '{"x":1,"y":"a"}', True),
        ({**POINT, "patternProperties": {"^y": {"type": "integer"}}}, '{"x":1,"y":2}', True),
        ({"type": "object"}, '{"y":2}', True),  # no properties listed: any object (json_object)
        ({"type": "array", "items": POINT}, '[{"x":1,"z":0}]', False),  # nested: closed too
        ({"$defs": {"P": POINT}, "$ref": "#/$defs/P"}, '{"x":1,"y":2}', False),
    ],
)
def test_undeclared_properties_are_refused_unless_the_schema_allows_them(schema, text, ok):
    assert accepts(schema, text) is ok


def test_data_and_combinations_are_left_as_they_are():
    """const, enum and default are values, not schemas; the members of allOf, not and if are
    closed only together (closing one alone would refuse what the whole accepts)."""
    data = {"properties": {"a": {}}}
    schema = {
        "type": "object",
        "properties": {"p": {"const": data, "default": data, "enum": [data]}},
        "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
        "not": {"properties": {"c": {}}},
        "if": {"properties": {"d": {}}},
    }
    closed = closed_objects(schema)
    assert closed["properties"]["p"] == schema["properties"]["p"]
    assert closed["allOf"] == schema["allOf"] and closed["not"] == schema["not"] and closed["if"] == schema["if"]
    assert closed["additionalProperties"] is False and "additionalProperties" not in schema  # a copy


def test_a_grammar_whose_first_mask_is_too_slow_is_refused():
    """A long forced literal escapes llguidance's fuel (~0.4 s of CPU a mask at 30,000
    characters): refused by its first mask's CPU time. A plain schema's mask is far inside."""
    tokenizer = ll_tokenizer(False, BASE_VOCAB)
    assert "over the 50 ms bound" in grammar_error(lark_grammar("start: /a{30000}/"), tokenizer)
    assert grammar_error(json_schema_grammar(POINT), tokenizer) == ""
