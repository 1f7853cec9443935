"""The wire format against hostile frames, and the request bounds both ends share: whatever a
frame holds, decoding returns a message or raises WireError with a short text; encoding writes
exactly the msgpack map of the message's fields."""

import contextlib
import dataclasses
import random

import msgpack
import pytest
from cde.shared.packed_attribution import PackedAttribution
from cde.shared.protocol import (
    AttributionSpec,
    BlockResult,
    GenerateRequest,
    Heartbeat,
    Ping,
    SteeringSpec,
    StepResult,
)
from cde.shared.wire import MAX_FRAME_BYTES, WireError, decode, encode, encode_all

ATTRIBUTION = PackedAttribution.from_records(
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
)
VALID = [
    GenerateRequest(
        "r1",
        [1, 2, 3],
        max_tokens=40,
        seed=5,
        stop=["\n"],
        stop_token_ids=[9],
        steering=SteeringSpec([3, 4], strength=-7.0, relu_logit_mask={3: 20.0}),
        attribution=AttributionSpec(top_k=5),
    ),
    BlockResult("r1", [5, 6], True, "stop", attribution=ATTRIBUTION),
    StepResult("r1", 2, 3, [130], [7]),
    Heartbeat("boot", "m", 1024, 100284, True, 2, 96, 16),
    Ping(1.5),
]


@pytest.mark.parametrize(
    "frame",
    [
        msgpack.packb({"type": {"a": 1}}),  # the pen test's 9 bytes: an unhashable type
        msgpack.packb({"type": [1, 2]}),
        msgpack.packb({"type": None}),
        msgpack.packb({"no type": "Ping"}),
        b"\x81\x91\x01\x02",  # {[1]: 2}: an array as a map key
        b"\x81\x81\x01\x02\x03",  # {{1: 2}: 3}: a map as a map key
        msgpack.packb({"type": "Ping", 7: 1}),
        msgpack.packb({"type": "Ping", (1, 2): 1}),
        b"\x91" * 100_000,  # nested too deep
    ],
)
def test_hostile_frames_raise_wire_error(frame):
    with pytest.raises(WireError):
        decode(frame)


def test_error_text_is_clipped():
    big = "x" * 5_000_000
    for frame in (
        msgpack.packb({"type": big}),
        msgpack.packb({"type": "Ping", big: 1}),
        msgpack.packb({"type": "AbortRequest", "request_id": [big]}),
    ):
        with pytest.raises(WireError) as e:
            decode(frame)
        assert len(str(e.value)) < 400


def test_mutated_frames_never_raise_anything_else():
    rng = random.Random(20)
    frames = [encode(m) for m in VALID]
    for _ in range(3000):
        frame = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 4)):
            what, at = rng.random(), rng.randrange(len(frame) or 1)
            if what < 0.5 and frame:
                frame[at] = rng.randrange(256)
            elif what < 0.8:
                del frame[at:]
                frame += bytes(rng.randrange(256) for _ in range(rng.randint(0, 8)))
            else:
                frame[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        with contextlib.suppress(WireError):
            decode(bytes(frame))


def test_random_msgpack_values_never_raise_anything_else():
    rng = random.Random(21)

    def value(depth=0):
        kinds = [
            lambda: rng.randint(-(1 << 63), (1 << 64) - 1),
            lambda: rng.random() * 1e300,
            lambda: None,
            lambda: rng.random() < 0.5,
            lambda: rng.choice(["type", "Ping", "GenerateRequest", "x" * 50]),
            lambda: b"\x00\xff",
        ]
        if depth < 3:
            kinds += [
                lambda: [value(depth + 1) for _ in range(rng.randint(0, 3))],
                lambda: {
                    rng.choice(["type", "request_id", "prompt_ids", "steering", 1]): value(depth + 1)
                    for _ in range(rng.randint(0, 3))
                },
            ]
        return rng.choice(kinds)()

    for _ in range(3000):
        data = value()
        if isinstance(data, dict) and rng.random() < 0.7:
            data["type"] = rng.choice(["GenerateRequest", "BlockResult", "Ping", "Heartbeat", {"a": 1}, [1]])
        try:
            frame = msgpack.packb(data, use_bin_type=True)
        except (TypeError, ValueError):  # an unhashable key msgpack itself will not write
            continue
        with contextlib.suppress(WireError):
            decode(frame)


@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_encode_is_the_msgpack_map_of_the_fields(msg):
    expected = msgpack.packb({"type": type(msg).__name__, **dataclasses.asdict(msg)}, use_bin_type=True)
    assert encode(msg) == expected and decode(expected) == msg


def test_choices_sharing_a_spec_encode_alike():
    steering = SteeringSpec(list(range(50)), relu_logit_mask={1: 2.0})
    reqs = [GenerateRequest(f"c-{i}", [1, 2], seed=i, steering=steering) for i in range(4)]
    assert encode_all(reqs) == [encode(r) for r in reqs]
    assert [decode(f) for f in encode_all(reqs)] == reqs


def test_a_frame_over_the_limit_is_not_encoded():
    with pytest.raises(WireError, match="frame limit"):
        encode(GenerateRequest("big", [1] * (MAX_FRAME_BYTES + 1)))


def _attribution_frame(**changes: object) -> bytes:
    fields = dataclasses.asdict(ATTRIBUTION) | changes
    return msgpack.packb({"type": "BlockResult", "request_id": "r", "token_ids": [], "attribution": fields})


@pytest.mark.parametrize(
    "changes",
    [
        {"known_weights": b"\x00" * 7},  # not the n x k_known float64 the header says
        {"positions": b""},  # fewer positions than tokens
        {"token_ids": b"\x00" * 3},  # not a whole int32
        {"k_known": 2},  # the arrays hold one known concept per token
        {"k_discovered": -1},
        {"epsilon": [0.1]},  # a list, not a packed buffer
        {"extra": b""},  # an unknown field
    ],
)
def test_packed_attribution_is_checked(changes: dict) -> None:
    with pytest.raises(WireError, match="PackedAttribution"):
        decode(_attribution_frame(**changes))


def test_free_form_attribution_records_are_refused() -> None:
    frame = msgpack.packb(
        {"type": "BlockResult", "request_id": "r", "token_ids": [], "attribution": [{"position": 3, "known": []}]}
    )
    with pytest.raises(WireError, match="attribution"):
        decode(frame)


def test_packed_attribution_round_trips_its_records() -> None:
    out = decode(encode(BlockResult("r", [5], attribution=ATTRIBUTION)))
    assert out.attribution == ATTRIBUTION and list(out.attribution) == list(ATTRIBUTION)
    assert out.attribution.records()[0]["discovered"] == [[2, 0.25, -0.3]]
