"""msgpack framing of the messages in `shared.protocol`: one message per ZeroMQ frame, a map
`{"type": <class name>, ...fields}`. Only the known dataclasses decode, and only with fields of
their declared types (no msgpack extension types, no pickle): a peer cannot make the other side
build anything but our messages."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

import msgpack

from shared.protocol import (
    AbortRequest, AttributionSpec, BlockResult, ConceptInfo, ConceptQuery, FlashBlockSpec, GenerateRequest,
    Heartbeat, Ping, SteeringSpec, StepResult,
)

MESSAGES = {cls.__name__: cls for cls in (GenerateRequest, BlockResult, AbortRequest, Ping, Heartbeat,
                                          ConceptQuery, ConceptInfo, StepResult)}
_NESTED = (SteeringSpec, AttributionSpec, FlashBlockSpec)


class WireError(ValueError):
    """A frame that is not a well-formed message of this protocol version."""


def encode(msg) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGES:
        raise WireError(f"not a protocol message: {name}")
    return msgpack.packb({"type": name, **dataclasses.asdict(msg)}, use_bin_type=True)


def _no_extensions(code: int, data: bytes):
    raise WireError(f"msgpack extension type {code} is not part of the protocol")


def decode(frame: bytes):
    try:
        # Steering's relu_logit_mask is keyed by concept id, so map keys may be ints.
        data = msgpack.unpackb(frame, raw=False, strict_map_key=False, ext_hook=_no_extensions)
    except WireError:
        raise
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"undecodable frame: {exc}") from exc
    if not isinstance(data, dict) or data.get("type") not in MESSAGES:
        raise WireError(f"unknown message type: {data.get('type') if isinstance(data, dict) else type(data).__name__}")
    name = data.pop("type")
    return _build(MESSAGES[name], data)


def _build(cls, data):
    if not isinstance(data, dict):
        raise WireError(f"bad {cls.__name__}: expected a map, got {type(data).__name__}")
    hints = _fields(cls)
    unknown = set(data) - set(hints)
    if unknown:
        raise WireError(f"bad {cls.__name__}: unknown fields {sorted(map(str, unknown))}")
    try:
        return cls(**{k: _value(v, hints[k], f"{cls.__name__}.{k}") for k, v in data.items()})
    except TypeError as exc:  # a required field is missing
        raise WireError(f"bad {cls.__name__}: {exc}") from exc


@functools.cache
def _fields(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _value(value, hint, where: str):
    """`value` as the declared type `hint`, or WireError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _value(value, arg, where)
            except WireError:
                pass
    elif hint in _NESTED:
        return _build(hint, value)
    elif origin is list and isinstance(value, list):
        return [_value(v, args[0], where) for v in value]
    elif origin is dict and isinstance(value, dict):
        return {_value(k, args[0], where): _value(v, args[1], where) for k, v in value.items()}
    elif hint is dict and isinstance(value, dict):
        return value  # free-form (attribution records)
    elif hint is float and type(value) in (int, float):
        return float(value)
    elif hint is type(None) and value is None or type(value) is hint and hint in (str, int, bool):
        return value
    raise WireError(f"bad {where}: {type(value).__name__} is not {getattr(hint, '__name__', hint)}")
