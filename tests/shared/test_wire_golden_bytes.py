"""The wire's bytes, pinned: a round trip cannot catch a format that changes on both sides at once
(encoder and decoder share the dtype constants), so the expected bytes are written here from the
documented formats: msgpack maps per message, and packed attribution arrays of little-endian int32
and float64 (struct's "<i" and "<d")."""

import struct

import msgpack
from cde.shared.packed_attribution import PackedAttribution
from cde.shared.protocol import AbortRequest, BlockResult
from cde.shared.wire import decode, encode

RECORDS = [
    {"token_id": 100257, "position": 64, "step": 3, "target_logit": 1.5, "epsilon": -0.25,
     "known": [[7, 0.5, 2.0]], "discovered": [[70000, 0.125, -1.0]]},
    {"token_id": 1, "position": 65, "step": 4, "target_logit": -3.0, "epsilon": 0.75,
     "known": [[33731, 1.0, 0.5]], "discovered": [[2, 0.25, 3.0]]},
]  # fmt: skip
# The same two tokens as the documented layout: every field an array over the tokens, row-major.
LITTLE_ENDIAN = {
    "token_ids": struct.pack("<2i", 100257, 1),
    "positions": struct.pack("<2i", 64, 65),
    "steps": struct.pack("<2i", 3, 4),
    "target_logits": struct.pack("<2d", 1.5, -3.0),
    "epsilon": struct.pack("<2d", -0.25, 0.75),
    "known_ids": struct.pack("<2i", 7, 33731),
    "known_weights": struct.pack("<2d", 0.5, 1.0),
    "known_contributions": struct.pack("<2d", 2.0, 0.5),
    "discovered_ids": struct.pack("<2i", 70000, 2),
    "discovered_weights": struct.pack("<2d", 0.125, 0.25),
    "discovered_contributions": struct.pack("<2d", -1.0, 3.0),
}


def test_packed_attribution_is_little_endian():
    packed = PackedAttribution.from_records(RECORDS)
    assert {name: getattr(packed, name) for name in LITTLE_ENDIAN} == LITTLE_ENDIAN


def test_a_frame_written_from_the_documented_format_decodes_to_its_records():
    attribution = {"k_known": 1, "k_discovered": 1, **LITTLE_ENDIAN}
    frame = msgpack.packb(
        {"type": "BlockResult", "request_id": "r", "token_ids": [100257, 1], "attribution": attribution}
    )
    msg = decode(frame)
    assert isinstance(msg, BlockResult) and msg.attribution.records() == RECORDS


def test_a_message_is_a_msgpack_map_of_its_type_and_fields():
    golden = (
        "82"  # a map of 2 entries
        "a4" + b"type".hex() + "ac" + b"AbortRequest".hex()  # str 4, str 12
        + "aa" + b"request_id".hex() + "a2" + b"r1".hex()  # str 10, str 2
    )  # fmt: skip
    assert encode(AbortRequest("r1")).hex() == golden
