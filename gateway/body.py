"""The base of every request body model: strict types, unknown fields refused, null as not given."""

from __future__ import annotations

import functools
import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator


def _nullable_in_schema(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """/openapi.json says what the validator takes: null too, for every field with a default."""
    for name in _defaulted(cls):
        prop = schema.get("properties", {}).get(name)
        if prop is None:
            continue
        notes = {k: prop.pop(k) for k in ("default", "description", "title") if k in prop}
        options = prop.pop("anyOf") if set(prop) == {"anyOf"} else [dict(prop)]
        prop.clear()
        prop.update(anyOf=[*options, *([] if {"type": "null"} in options else [{"type": "null"}])], **notes)


@functools.cache
def _defaulted(cls: type[BaseModel]) -> frozenset[str]:
    """The fields with a default other than null and a type without null, by their names on the
    wire (`schema` for `schema_`): an explicit null leaves them at that default (a field whose type
    has null gives it a meaning of its own)."""
    return frozenset(
        field.alias or name
        for name, field in cls.model_fields.items()
        if not field.is_required()
        and (field.default is not None or field.default_factory is not None)
        and not (get_origin(field.annotation) in (Union, types.UnionType) and type(None) in get_args(field.annotation))
    )


class Body(BaseModel):
    # Strict: `0` is not `false` and `false` is not a token id. NaN and Infinity (which Python's
    # json accepts, and `1e999` becomes) are never valid numbers.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra=_nullable_in_schema)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, v: Any) -> Any:
        # The OpenAI SDK types every optional field as nullable and clients pass None through for
        # "not set" (vLLM declares them Optional): null is the field's default, not an error.
        if isinstance(v, dict):
            defaulted = _defaulted(cls)
            return {k: x for k, x in v.items() if not (x is None and k in defaulted)}
        return v
