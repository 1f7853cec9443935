"""A concept catalog in the official schema for tests, sized for the tiny preset (96 known
concepts, then discovered ones in the same id space), whose names and descriptions draw on a few
words so that searches have many equal scores: the order of ties is part of what the official
search defines. Text is ASCII: pandas 2 (the official pin) and pandas 3 (pyarrow strings, RE2)
agree on it."""

from __future__ import annotations

import random

# A word list, wrapped by hand rather than one word a line.
# fmt: off
WORDS = [
    "ocean", "sea", "water", "blue", "wave", "fish", "boat", "storm", "river", "lake", "cat", "dog", "category",
    "communication", "the", "of", "and", "a", "c++",
]
# fmt: on
N_KNOWN = 96
# Distinct names for the concepts the tests steer by label.
NAMED = {9: "harbor lights", 21: "volcanic ash", 40: "lonely moon", 95: "mixed tide"}
SHARED_NAME = "twin star"  # two known concepts carry it: steering by it is ambiguous
MIXED_GROUP = 500  # known concept 95 grouped with a discovered one
QUERIES = [
    "ocean",
    "sea water",
    "the",
    "a",
    "cat",
    "dog cat",
    "category",
    "blue wave fish",
    "OCEAN  sea",
    "xyz",
    "c++",
    "of of",
    "harbor",
    "Lonely",
    "communication the",
]


def catalog_rows(n_unknown: int = 160, seed: int = 0) -> list[dict]:
    """Known concepts are grouped by eight (id // 8) except multiples of 5, which have no group;
    discovered concepts sit in three groups of their own."""
    rng = random.Random(seed)
    rows = []
    for cid in range(N_KNOWN + n_unknown):
        known = cid < N_KNOWN
        group = (cid // 8 if cid % 5 else None) if known else 1000 + cid % 3
        rows.append(
            {
                "concept_id": cid,
                "concept_name": NAMED.get(cid) or " ".join(rng.choices(WORDS, k=rng.randint(1, 3))),
                "concept_description": None if cid % 37 == 0 else " ".join(rng.choices(WORDS, k=rng.randint(0, 12))),
                "head": "known" if known else "unknown",
                "public_group_id": group,
                "group_name": None if group is None else f"group {group}",
                "is_steerable": cid % 4 != 3,
                "is_tone": cid % 3 == 0,
                "is_alignment": cid % 7 == 0,
                "is_demographic": cid % 11 == 0,
            }
        )
    for cid in (60, 61):
        rows[cid]["concept_name"] = SHARED_NAME
    for cid in (95, N_KNOWN):
        rows[cid].update(public_group_id=MIXED_GROUP, group_name="mixed")
    return rows
