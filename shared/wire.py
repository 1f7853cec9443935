"""msgpack framing of the messages in `shared.protocol`: one message per ZeroMQ frame, a map
`{"type": <class name>, ...fields}`. Only the known dataclasses decode; never pickle."""

from __future__ import annotations

import dataclasses

import msgpack

from shared.protocol import (
    AbortRequest, BlockResult, ConceptInfo, ConceptQuery, GenerateRequest, Heartbeat, Ping, StepResult,
    request_from_dict,
)

MESSAGES = {cls.__name__: cls for cls in (GenerateRequest, BlockResult, AbortRequest, Ping, Heartbeat,
                                          ConceptQuery, ConceptInfo, StepResult)}


class WireError(ValueError):
    """A frame that is not a well-formed message of this protocol version."""


def encode(msg) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGES:
        raise WireError(f"not a protocol message: {name}")
    return msgpack.packb({"type": name, **dataclasses.asdict(msg)}, use_bin_type=True)


def decode(frame: bytes):
    try:
        # Steering's relu_logit_mask is keyed by concept id, so map keys may be ints.
        data = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"undecodable frame: {exc}") from exc
    if not isinstance(data, dict) or data.get("type") not in MESSAGES:
        raise WireError(f"unknown message type: {data.get('type') if isinstance(data, dict) else type(data).__name__}")
    name = data.pop("type")
    try:
        if name == "GenerateRequest":
            return request_from_dict(data)
        return MESSAGES[name](**data)
    except TypeError as exc:
        raise WireError(f"bad {name}: {exc}") from exc
