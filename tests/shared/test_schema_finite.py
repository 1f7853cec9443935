"""shared/schema_finite.py: a schema part that a value may enter and never finish is refused
before it runs. Each refused kind is first shown to be a real dead end on llguidance's own matcher
(what the worker runs): after the tokens that enter the part, no token continues the answer."""

import pytest
from cde.shared.config import BASE_VOCAB
from cde.shared.grammar import closed_objects, ll_tokenizer, new_matcher
from cde.shared.schema_finite import check_finite, infinite_part
from cde.shared.tokenizer import get_tokenizer
from llguidance import LLMatcher

from tests.shared.test_grammar import POINT

LOOP = {"$defs": {"a": {"$ref": "#/$defs/a"}}}
SELF_KEY = {**LOOP, "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}


def dead_end_after(schema: dict, text: str) -> bool:
    """Whether llguidance, compiled without the check, takes `text` and then allows no token."""
    grammar = LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults={"whitespace_flexible": False})
    matcher = new_matcher(grammar, ll_tokenizer(False, BASE_VOCAB))
    ids = get_tokenizer(False).enc.encode(text)
    assert matcher.consume_tokens(ids) and not matcher.is_error(), text
    mask = matcher.compute_logit_bias()
    return matcher.is_error() or not any(mask)


def test_an_optional_key_whose_value_never_ends_is_a_dead_end_and_refused():
    assert dead_end_after(SELF_KEY, '{"x":')  # llguidance offers the key, then nothing
    assert infinite_part(SELF_KEY) == "#/properties/x"
    with pytest.raises(ValueError, match=r"the schema at #/properties/x admits no finite value"):
        check_finite(SELF_KEY)


@pytest.mark.parametrize(
    "schema,pointer",
    [
        ({**LOOP, "$ref": "#/$defs/a"}, "#"),  # the root itself
        ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "#"),  # requires itself
        ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "#"),
        ({"type": "object", "properties": {"a/b": {"$ref": "#/properties/a~1b"}}}, "#/properties/a~1b"),
        ({**LOOP, "type": "object", "properties": {"u": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}}},
         "#/properties/u/anyOf/0"),
        ({**LOOP, "type": "object", "properties": {"u": {"allOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}}},
         "#/properties/u"),
    ],
)  # fmt: skip
def test_parts_without_a_finite_value_are_named(schema, pointer):
    assert infinite_part(schema) == pointer


@pytest.mark.parametrize(
    "schema",
    [
        POINT,
        {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer"}}},  # a linked list
        {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
         "$ref": "#/$defs/n"},  # a tree: an empty list ends it
        {**LOOP, "type": "string"},  # a definition nothing refers to is never entered
        {"type": "object", "properties": {"x": False}},  # a property that may not appear
        {"$ref": "https://example.com/remote.json"},  # not followed
        {"properties": {"u": {"$ref": "#/$defs/U"}}, "$defs": ["U"]},  # resolves nowhere: llguidance's to refuse
    ],
)  # fmt: skip
def test_recursion_with_a_way_out_is_kept(schema):
    assert infinite_part(schema) is None


def test_a_long_chain_of_definitions_is_followed_without_recursion():
    """900 definitions each requiring the next (76 KB of JSON, flat): the walk is a loop, where
    recursion through the `$ref`s overflowed Python's stack (a 500 from a 2-level-deep body)."""
    n = 900
    chain = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
        for i in range(n)
    }
    assert infinite_part({"$defs": {**chain, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}) is None
    looped = {"$defs": {**chain, f"d{n}": {"$ref": "#/$defs/d0"}}, "$ref": "#/$defs/d0"}
    assert infinite_part(looped) == "#"
