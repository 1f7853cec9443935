"""PackedAttribution (the wire's attribution type) and the vectorized chunk aggregation: the
scheduler's operations on it, and chunk sums and rankings equal to the reference's per-token loop
to the last bit, ties included."""

import random

import numpy as np
import pytest
from cde.shared.chunk_attribution import ConceptLabels, aggregate, chunk_concepts
from cde.shared.packed_attribution import PackedAttribution


def records(n: int, kk: int, ku: int, seed: int, start: int = 64, ties: bool = False) -> list[dict]:
    rng = random.Random(seed)

    def value() -> float:
        # Saturated attributions repeat exact values: ties in |contribution| must rank alike.
        return rng.choice([0.5, -0.5, 0.25]) if ties else rng.uniform(-2, 2)

    return [
        {
            "token_id": rng.randrange(1000, 100000),
            "position": start + i,
            "step": i // 4,
            "target_logit": rng.uniform(-5, 5),
            "epsilon": value(),
            "known": [[rng.randrange(8), rng.random(), value()] for _ in range(kk)],
            "discovered": [[rng.randrange(6), rng.random(), value()] for _ in range(ku)],
        }
        for i in range(n)
    ]


def reference_chunk(recs: list[dict], start: int, end: int, n_known: int, top_k: int | None) -> tuple[list, float]:
    """The reference's arithmetic as a plain loop (what the gateway did before the arrays)."""
    labels = ConceptLabels()
    inside = [r for r in recs if start <= r["position"] < end]
    sums: dict[str, dict[int, float]] = {"known": {}, "discovered": {}}
    eps = []
    for r in inside:
        mass = sum(abs(c) for _, _, c in r["known"]) + sum(abs(c) for _, _, c in r["discovered"]) + abs(r["epsilon"])
        mass = max(mass, 1e-8)
        for kind, totals in sums.items():
            for cid, _, c in r[kind]:
                totals[cid] = totals.get(cid, 0.0) + c / mass
        eps.append(r["epsilon"] / mass)
    entries = [
        {
            "id": cid,
            "type": kind,
            "label": labels.label(cid + n_known if kind == "discovered" else cid, kind),
            "contribution": total / (end - start),
        }
        for kind in sums
        for cid, total in sorted(sums[kind].items())
    ]
    ranked = sorted(entries, key=lambda e: abs(e["contribution"]), reverse=True)
    return (ranked if top_k is None else ranked[:top_k]), 100.0 * sum(eps) / max(len(eps), 1)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("top_k", [None, 1, 3, 10])
def test_chunks_equal_the_reference_loop_bit_for_bit(ties: bool, top_k: int | None) -> None:
    recs = records(100, 5, 4, seed=7, ties=ties)
    block = PackedAttribution.from_records(recs)
    for start, end in [(64, 128), (128, 164), (70, 71)]:
        assert chunk_concepts(block, start, end, ConceptLabels(), 10, top_k) == reference_chunk(
            recs, start, end, 10, top_k
        )


def test_round_trip_and_scheduler_operations() -> None:
    recs = records(12, 3, 2, seed=1)
    block = PackedAttribution.from_records(recs)
    assert len(block) == 12 and block.records() == recs and block == recs
    assert block.head(5).records() == recs[:5] and block.head(50) is block
    # The scheduler keeps a block's parts in commit order, then the kept positions in position order.
    parts = [block.take(np.array([3, 1])), block.take(np.array([0, 2, 7]))]
    joined = PackedAttribution.join(parts)
    assert [r["position"] for r in joined] == [67, 65, 64, 66, 71]
    assert joined.kept({64, 66, 67, 99}).records() == [recs[0], recs[2], recs[3]]
    empty = block.take(np.array([], dtype=int))
    assert len(empty) == 0 and empty and aggregate(empty, str, prompt_len=64) == {"chunks": []}
    empty.check()
    block.check()


def test_aggregate_takes_packed_blocks_or_records_alike() -> None:
    recs = records(130, 4, 3, seed=3)
    shuffled = recs[64:] + recs[:64]  # blocks arrive in order, but nothing relies on it
    decode = lambda ids: ",".join(map(str, ids))
    by_records = aggregate(shuffled, decode, prompt_len=64, n_known=4, top_k=5, per_token=True)
    by_blocks = aggregate(
        PackedAttribution.join([PackedAttribution.from_records(recs[64:]), PackedAttribution.from_records(recs[:64])]),
        decode,
        prompt_len=64,
        n_known=4,
        top_k=5,
        per_token=True,
    )
    assert by_records == by_blocks
    assert [(c["start"], c["end"]) for c in by_blocks["chunks"]] == [(0, 64), (64, 128), (128, 130)]
    assert [t["offset"] for t in by_blocks["tokens"]] == list(range(130))
