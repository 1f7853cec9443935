"""msgpack framing of the protocol messages."""

import pickle

import msgpack
import pytest
from cde.shared.packed_attribution import PackedAttribution
from cde.shared.protocol import (
    AbortRequest,
    AttributionSpec,
    BlockResult,
    ConceptInfo,
    ConceptQuery,
    GenerateRequest,
    Heartbeat,
    Ping,
    SteeringSpec,
)
from cde.shared.wire import WireError, decode, encode

MESSAGES = [
    GenerateRequest(
        "r1",
        [1, 2, 3],
        max_tokens=40,
        temperature=0.7,
        seed=5,
        stop=["\n"],
        stop_token_ids=[9],
        steering=SteeringSpec([3, 4], strength=-7.0, relu_logit_mask={3: 20.0}),
        attribution=AttributionSpec(top_k=5, per_token=True, chunking="endofchunk"),
    ),
    GenerateRequest("r2", [7]),
    BlockResult(
        "r1",
        [5, 6],
        finished=True,
        finish_reason="stop",
        stop_str="\n",
        prompt_tokens=3,
        attribution=PackedAttribution.from_records(
            [
                {
                    "token_id": 5,
                    "position": 3,
                    "step": 1,
                    "target_logit": 2.0,
                    "epsilon": 0.1,
                    "known": [[1, 0.5, 0.1]],
                    "discovered": [[2, 0.25, -0.3]],
                }
            ]
        ),
    ),
    BlockResult("r3", [], True, "error", error="boom"),
    AbortRequest("r1"),
    Ping(12.5),
    Heartbeat(
        "boot",
        "m",
        1024,
        100284,
        True,
        2,
        96,
        16,
        running=1,
        waiting=2,
        pages_used=3,
        pages_free=4,
        steps_per_s=9.5,
        forward_passes=10,
        device_idle_ms=2.5,
    ),
    ConceptQuery("q1", 7, k=5),
    ConceptInfo("q1", [11, 12], [0.5, 0.25]),
    ConceptInfo("q2", error="unknown concept id 999"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_roundtrip(msg):
    assert decode(encode(msg)) == msg


def test_steering_mask_keys_stay_ints():
    out = decode(encode(MESSAGES[0]))
    assert out.steering.relu_logit_mask == {3: 20.0}
    assert isinstance(out.steering, SteeringSpec) and isinstance(out.attribution, AttributionSpec)


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2]),
        msgpack.packb({"type": "Pickle", "x": 1}),
        msgpack.packb({"type": "AbortRequest", "request_id": "a", "extra": 1}),
        msgpack.packb({"type": "AbortRequest"}),
    ],
)
def test_bad_frames_raise_wire_error(frame):
    with pytest.raises(WireError):
        decode(frame)


def test_only_protocol_messages_encode():
    with pytest.raises(WireError):
        encode({"type": "GenerateRequest"})


class Evil:
    def __reduce__(self):
        return (print, ("pickled code ran",))


@pytest.mark.parametrize(
    "frame",
    [
        pickle.dumps(Evil()),  # pickle is never a message
        pickle.dumps({"type": "AbortRequest", "request_id": "a"}),
        msgpack.packb({"type": "AbortRequest", "request_id": msgpack.ExtType(1, b"x")}),  # extension types
        msgpack.packb({"type": "AbortRequest", "request_id": 7}),  # wrong scalar type
        msgpack.packb({"type": "Ping", "sent_at": "now"}),
        msgpack.packb({"type": "GenerateRequest", "request_id": "r", "prompt_ids": "abc"}),
        msgpack.packb({"type": "GenerateRequest", "request_id": "r", "prompt_ids": [1, "2"]}),
        msgpack.packb({"type": "GenerateRequest", "request_id": "r", "prompt_ids": [1], "max_tokens": True}),
        msgpack.packb({"type": "GenerateRequest", "request_id": "r", "prompt_ids": [1], "steering": [1, 2]}),
        msgpack.packb(
            {"type": "GenerateRequest", "request_id": "r", "prompt_ids": [1], "steering": {"concepts": [1], "evil": 1}}
        ),
        msgpack.packb(
            {
                "type": "GenerateRequest",
                "request_id": "r",
                "prompt_ids": [1],
                "steering": {"concepts": [1], "relu_logit_mask": {"x": 1.0}},
            }
        ),
        msgpack.packb({"type": "BlockResult", "request_id": "r", "token_ids": [1], "attribution": [1]}),
    ],
)
def test_only_typed_messages_decode(frame):
    with pytest.raises(WireError):
        decode(frame)


def test_ints_stand_for_floats_but_not_the_reverse():
    assert decode(msgpack.packb({"type": "Ping", "sent_at": 3})) == Ping(3.0)
    with pytest.raises(WireError):
        decode(msgpack.packb({"type": "ConceptQuery", "query_id": "q", "concept_id": 1.5}))
