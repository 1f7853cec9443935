"""msgpack framing of the messages in `shared.protocol`: one message per ZeroMQ frame, a map
`{"type": <class name>, ...fields}`. Only the known dataclasses decode, and only with fields of
their declared types (no msgpack extension types, no pickle): a peer cannot make the other side
build anything but our messages. Whatever a frame holds, decoding either returns a message or
raises WireError with a clipped text: a hostile frame can end neither a loop nor a log line."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import msgpack
from cde.shared.limits import clip
from cde.shared.packed_attribution import PackedAttribution
from cde.shared.protocol import (
    AbortRequest,
    AttributionSpec,
    BlockResult,
    CatalogPart,
    CatalogQuery,
    ConceptInfo,
    ConceptQuery,
    FlashBlockSpec,
    GenerateRequest,
    Heartbeat,
    InputAttribution,
    InputAttributionSpec,
    Ping,
    PrefixResult,
    SteeringSpec,
    StepResult,
    TokenLogprobs,
)

MESSAGES = {
    cls.__name__: cls
    for cls in (
        GenerateRequest,
        BlockResult,
        AbortRequest,
        Ping,
        Heartbeat,
        ConceptQuery,
        ConceptInfo,
        StepResult,
        CatalogQuery,
        CatalogPart,
        PrefixResult,
    )
}
_NESTED = (
    SteeringSpec,
    AttributionSpec,
    FlashBlockSpec,
    PackedAttribution,
    InputAttributionSpec,
    InputAttribution,
    TokenLogprobs,
)

# The largest frame either side sends or accepts (zmq.MAXMSGSIZE on every peer socket). A block
# of attribution at 8B is ~0.2 MB (packed arrays: 64 tokens x 160 concepts x 20 bytes), and the
# largest request the gateway builds (a full context, a ReLU mask over every known concept)
# ~0.6 MB: this only bounds what a hostile peer can make the other side buffer and parse
# (msgpack holds the GIL for ~0.1 s on 4 MB).
MAX_FRAME_BYTES = 4 << 20
# What msgpack may build from one frame, from the protocol's own bounds: the longest list is a
# prompt at the longest context served (128k = 2^17 positions; 2^18 leaves room) or a catalog of
# both heads at 8B (134,928 rows); concept lists and ReLU masks are at most 2^16
# (limits.MAX_CONCEPT_LIST); the longest text is a stop string (1,000 characters), an error or a
# catalog name or description (a few hundred); binaries are packed attribution buffers, at most
# a frame. A longer array, map or string is refused from its header, before it is built.
MAX_WIRE_ITEMS = 1 << 18
MAX_WIRE_STR = 1 << 20
_LIMITS = {
    "max_array_len": MAX_WIRE_ITEMS,
    "max_map_len": MAX_WIRE_ITEMS,  # a ReLU mask (<= 2^16 keys), or a catalog keyed by id
    "max_str_len": MAX_WIRE_STR,
    "max_bin_len": MAX_FRAME_BYTES,
}
_MAX_ERROR_CHARS = 200


class WireError(ValueError):
    """A frame that is not a well-formed message of this protocol version."""


def _fail(message: str) -> WireError:
    return WireError(clip(message, _MAX_ERROR_CHARS))


def encode(msg: Any) -> bytes:
    return encode_all([msg])[0]


def encode_all(msgs: list) -> list[bytes]:
    """One frame per message. A field value the messages share (the steering spec and prompt of
    the n choices of one API request) is packed once, and nothing is deep-copied on the way
    (`dataclasses.asdict` took 0.3 s for a 500,000-entry list)."""
    packer = msgpack.Packer(use_bin_type=True)  # per call: encoding runs on several threads
    memo: dict[int, tuple[object, bytes]] = {}

    def packed(value: Any) -> bytes:
        if not isinstance(value, list | dict) and not dataclasses.is_dataclass(value):
            return packer.pack(value)
        if id(value) not in memo:  # the value is kept with its bytes so that its id stays unique
            memo[id(value)] = (value, packer.pack(_plain(value)))
        return memo[id(value)][1]

    frames = []
    for msg in msgs:
        name = type(msg).__name__
        if name not in MESSAGES:
            raise _fail(f"not a protocol message: {name}")
        fields = dataclasses.fields(msg)
        parts = [packer.pack_map_header(len(fields) + 1), packer.pack("type"), packer.pack(name)]
        for f in fields:
            parts += [packer.pack(f.name), packed(getattr(msg, f.name))]
        frame = b"".join(parts)
        if len(frame) > MAX_FRAME_BYTES:
            raise _fail(f"{name} of {len(frame)} bytes is over the {MAX_FRAME_BYTES}-byte frame limit")
        frames.append(frame)
    return frames


def _plain(value: Any) -> Any:
    """A nested spec as a map of its fields; lists and maps (of plain values) pass as they are."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _no_extensions(code: int, data: bytes) -> None:
    raise WireError(f"msgpack extension type {code} is not part of the protocol")


def decode(frame: bytes) -> Any:
    try:
        # Steering's relu_logit_mask is keyed by concept id, so map keys may be ints.
        data = msgpack.unpackb(frame, raw=False, strict_map_key=False, ext_hook=_no_extensions, **_LIMITS)
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        # TypeError: an array or map as a map key (unhashable).
        raise _fail(f"undecodable frame: {exc}") from exc
    if not isinstance(data, dict):
        raise _fail(f"not a message: a {type(data).__name__}")
    name = data.pop("type", None)
    # The type is checked before the lookup: an unhashable one (a map) would raise TypeError.
    if not isinstance(name, str) or name not in MESSAGES:
        raise _fail(f"unknown message type: {name!r}")
    return _build(MESSAGES[name], data)


def _build(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise _fail(f"bad {cls.__name__}: expected a map, got {type(data).__name__}")
    hints = _fields(cls)
    unknown = [k for k in data if k not in hints]
    if unknown:
        raise _fail(f"bad {cls.__name__}: unknown fields {sorted(map(repr, unknown))}")
    try:
        msg = cls(**{k: _value(v, hints[k], f"{cls.__name__}.{k}") for k, v in data.items()})
    except TypeError as exc:  # a required field is missing
        raise _fail(f"bad {cls.__name__}: {exc}") from exc
    check = getattr(msg, "check", None)
    if check is not None:  # what the field types cannot say (a packed array's length)
        try:
            check()
        except ValueError as exc:
            raise _fail(f"bad {cls.__name__}: {exc}") from exc
    return msg


@functools.cache
def _fields(cls: type) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_SCALARS = (str, int, bool, bytes)  # bytes: a msgpack bin (a packed array)


def _value(value: Any, hint: Any, where: str) -> Any:
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
        if args[0] in _SCALARS:  # the long lists (prompt ids, concepts): one pass, no call per item
            if all(type(v) is args[0] for v in value):
                return value
        else:
            return [_value(v, args[0], where) for v in value]
    elif origin is dict and isinstance(value, dict):
        return {_value(k, args[0], where): _value(v, args[1], where) for k, v in value.items()}
    elif hint is float and type(value) in (int, float):
        return float(value)
    elif (hint is type(None) and value is None) or (type(value) is hint and hint in _SCALARS):
        return value
    raise _fail(f"bad {where}: {type(value).__name__} is not {getattr(hint, '__name__', hint)}")
