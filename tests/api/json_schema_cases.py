"""The JSON schemas of the structured-output suite: nested objects, arrays, enums, numbers with
bounds, required and optional fields, anyOf. Strings and arrays are bounded so that the demo model
finishes well inside the suite's max_tokens (a cut answer is the one case that may not parse,
finish_reason "length")."""

WORD = {"type": "string", "maxLength": 8}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS = {
    "flat": obj({"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "boolean": obj({"ok": {"type": "boolean"}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "enum_ints": obj({"level": {"enum": [1, 2, 3]}}),
    "const": obj({"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -9, "maximum": 9}}),
    "int_bounds": obj({"n": {"type": "integer", "minimum": 10, "maximum": 20}}),
    "exclusive_bounds": obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}}),
    "number_bounds": obj({"p": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}),
    "optional": obj({"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}}, required=["a"]),
    "all_optional": obj({"a": {"type": "boolean"}, "b": {"type": "null"}}, required=[]),
    "nested": obj(
        {"user": obj({"id": {"type": "integer", "minimum": 0, "maximum": 99}, "admin": {"type": "boolean"}})}
    ),
    "deep": obj({"a": obj({"b": obj({"c": {"enum": ["deep"]}})})}),
    "array_enum": obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    "array_objects": obj(
        {
            "points": {
                "type": "array",
                "items": obj({"x": {"type": "integer", "minimum": 0, "maximum": 9}}),
                "maxItems": 2,
            }
        }
    ),
    "array_top": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    "tuple": {
        "type": "array",
        "prefixItems": [{"enum": ["id"]}, {"type": "integer", "minimum": 0, "maximum": 9}],
        "items": False,
    },
    "any_of": obj({"v": {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9}]}}),
    "any_of_objects": obj(
        {"shape": {"anyOf": [obj({"circle": {"type": "boolean"}}), obj({"side": {"enum": [1, 2]}})]}}
    ),
    "nullable": obj({"v": {"anyOf": [{"type": "null"}, {"enum": ["on", "off"]}]}}),
    "string_pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    "string_length": obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
    "refs": {
        "$defs": {"item": obj({"ok": {"type": "boolean"}})},
        **obj({"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}}),
    },
}
